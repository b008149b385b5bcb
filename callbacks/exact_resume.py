"""What a bit-exact resume needs beyond Lightning's checkpoint, for any LightningModule:
the RNG states of every rank, a fingerprint of what decides the numerics, and weights that
load as they were saved."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lit_spikes.callbacks.between_steps import draws_between_steps
from lit_spikes.callbacks.common import step_validates
from lit_spikes.callbacks.fingerprint import (
    CUBLAS_WORKSPACE,
    fingerprint,
    fingerprint_differences,
)
from lit_spikes.callbacks.isolated_validation import isolate_validations
from lit_spikes.callbacks.loader_positions import (
    LoaderGenerators,
    position_warnings,
    train_loaders,
)
from lit_spikes.callbacks.module_generators import ModuleGenerators
from lit_spikes.callbacks.resumed_epoch import rebuild_resumed_epoch
from lit_spikes.callbacks.step_end import (
    AfterFileWatch,
    PlateauCatchUp,
    StepEnd,
    Unfinished,
    epoch_end_hooks,
    replay,
    saved_metrics,
)
from lit_spikes.loader import StepLoader
from lit_spikes.randomness import (
    BETWEEN,
    EPOCH,
    STEP,
    VALIDATION,
    Generator,
    derive,
    derive_in,
    seed_all,
)
from lit_spikes.stacklevel import outside_lightning

STATE_KEY = "ExactResume{}"
"""Where a checkpoint holds ExactResume's state (``checkpoint["callbacks"][STATE_KEY]``)."""


def saved_fingerprint(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The fingerprint ExactResume recorded in a checkpoint (``{}``: none)."""
    state = checkpoint.get("callbacks", {}).get(STATE_KEY, {})
    saved: dict[str, Any] = state.get("fingerprint", {})
    return saved


def clipping_from_checkpoint(checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The Trainer arguments of the gradient clipping a checkpoint's run trained with:
    ``{}`` for none, or where no fingerprint records it."""
    clip = saved_fingerprint(checkpoint).get("gradient_clip")
    if not clip:
        return {}
    return {"gradient_clip_val": clip["value"], "gradient_clip_algorithm": clip["algorithm"]}


def check_state_shapes(saved: dict[str, torch.Tensor], current: dict[str, torch.Tensor]) -> None:
    """Raises ``ValueError`` listing the tensors whose shapes differ."""
    problems = [
        f"{k}: checkpoint {tuple(saved[k].shape)}, now {tuple(current[k].shape)}"
        for k in sorted(set(saved) & set(current))
        if isinstance(saved[k], torch.Tensor) and saved[k].shape != current[k].shape
    ]
    if problems:
        raise ValueError(
            "the checkpoint's weights do not fit this model (" + "; ".join(problems) + "): "
            "build the module with the checkpoint's configuration to resume it"
        )


def check_one_batch_per_step(trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
    """Raises ``ValueError`` for a fit whose global step does not advance once per batch of
    a ``StepLoader`` (it serves the batch of each global step)."""
    problem = one_batch_per_step_problem(trainer.accumulate_grad_batches, train_loaders(trainer))
    if problem is not None:
        raise ValueError(problem)


def one_batch_per_step_problem(accumulate: int, loaders: Sequence[Any]) -> str | None:
    """Why ``accumulate_grad_batches=accumulate`` cannot train on ``loaders`` (None: it
    can): a ``StepLoader`` serves the batch of each global step, one a step."""
    if accumulate == 1 or not any(isinstance(loader, StepLoader) for loader in loaders):
        return None
    return (
        f"Trainer(accumulate_grad_batches={accumulate}) with a StepLoader: it serves the "
        "batch of each global step, one batch per step; give it batch_size = the rows a "
        "step should see instead"
    )


def refuse_a_second_fit(trainer: pl.Trainer) -> None:
    """Raises ``RuntimeError`` for a fit on a Trainer that trained before, without a
    checkpoint: Lightning would go on from its step with a new optimizer and schedule."""
    raise RuntimeError(
        f"this Trainer already trained to step {trainer.global_step}: a second fit on it "
        "would go on with the data from there but restart the LR schedule and the "
        "optimizer's state (Lightning builds them anew), which no run does uninterrupted. "
        "Train on with a new Trainer and fit(..., ckpt_path=<the checkpoint of that step>) "
        "(or the same Trainer with ckpt_path=...), or start over with a new Trainer"
    )


class ExactResume(Callback):
    """Makes a run a pure function of (seed, step): resumed from any of its files, or
    watched by any checkpoint cadence or validation, it draws what the run alone drew.

    Lightning saves no RNG state, and whatever draws between two steps (a validation, a
    hook, a checkpoint's save) moves the stream the next step draws from. This callback
    sets the torch (CPU, and each CUDA device), Python and NumPy RNGs at each step's start
    from a derivation of (seed, global step, micro-batch, rank), and from other domains of
    the same key after the step (what runs between steps), at each validation's start
    and at each epoch's start (``lit_spikes.randomness``). Nothing is rewound and no RNG
    state is saved: a file holds each rank's seed, and a resume from it, or a save inside
    a step (Lightning's ``on_exception`` checkpoint), draws the same from the next step's
    start. The seed is ``torch.initial_seed()`` at the first step (what ``seed_everything``
    or ``torch.manual_seed`` set last), or the checkpoint's. A generator the module holds
    (a torch or NumPy ``Generator``, a ``RandomState``, a ``random.Random``; an attribute
    of it or a submodule, in a list, tuple or dict, or on a plain object it holds) is
    keyed alike, from its own seed when first seen, saved by its path; one made during
    the fit is said (``module_generators``). It also:

    - records a fingerprint (torch and Lightning versions, the CPU's SIMD kernels, CPU
      threads, subnormal flushing, device and GPU, world size, precision, deterministic
      settings, gradient clipping) and warns, naming each, where a resume's differs: the
      run is then not guaranteed bit-exact;
    - refuses weights of other shapes before any step, naming each tensor;
    - loads float64 weights into a ``precision="64-true"`` run unrounded (Lightning loads
      them before its precision plugin converts the module, which rounded them to float32);
    - seeks every ``StepLoader`` of the fit to ``trainer.global_step`` at its start and at
      each epoch's (a reloaded loader), refuses ``accumulate_grad_batches`` with one, and
      refuses a step that trains on another step's batch;
    - replays at a resume what of the file's step came after the file: the step's
      validation (EarlyStopping's and a monitor's updates; a validation that asked the run
      to stop stops the resumed one at once) and a step-interval ``ReduceLROnPlateau``'s
      update, on the logged metrics the file holds (``callback_metrics``), and at an
      epoch's last batch the epoch-interval one (the epoch's ``on_train_epoch_end`` hooks
      are not replayed: a warning names them); makes up the epoch plateau update Lightning
      skips at the end of a resumed fit's first epoch;
    - at a resume at an epoch's start, builds the plain train loaders' iterators anew after
      the epoch's keying, as the run built them (their workers' seeds, a shuffle's order),
      and keys a loader's own ``generator`` at each epoch's start; ends the epoch of a
      file of its end without a batch more (Lightning's restart trained one), keeps
      Lightning's epoch counts the run's, and runs the other callbacks'
      ``on_train_epoch_start`` its restart skips (``resumed_epoch``); warns, at a resume, of
      a train loader it cannot position (not a ``StepLoader`` and no ``state_dict``,
      resumed mid-epoch) and of workers kept across epochs (``persistent_workers``);
    - refuses a second fit on a Trainer that trained, without ``ckpt_path`` (Lightning
      would go on from its step with a new optimizer and LR schedule).

    Everything it writes is plain data (``torch.load(weights_only=True)``).

    Args:
        deterministic: in ``setup``, ask for deterministic kernels:
            ``torch.use_deterministic_algorithms(True)``, cuDNN deterministic and not
            benchmarking, and ``CUBLAS_WORKSPACE_CONFIG`` (set only if unset). Recorded in
            the fingerprint either way.

    Raises:
        ValueError: ``deterministic`` not a bool; weights of other shapes at a resume;
            ``accumulate_grad_batches`` with a ``StepLoader``.
        RuntimeError: a ``StepLoader`` batch of another step than the global step; a
            second fit on a Trainer that trained, without ``ckpt_path``.

    Example:
        >>> trainer = Trainer(max_steps=100, callbacks=[ExactResume()])
        >>> trainer.fit(model, train_dataloaders=StepLoader(dataset, 32), ckpt_path=path)
    """

    def __init__(self, deterministic: bool = False) -> None:
        super().__init__()
        if not isinstance(deterministic, bool):
            raise ValueError(f"deterministic={deterministic!r} must be True or False")
        self.deterministic = deterministic
        self._trainer: pl.Trainer | None = None
        self._seed: int | None = None
        self._gens = ModuleGenerators()
        self._first_step_ended = False
        self._restored = False
        self._loaded = False
        self._hook: RemovableHandle | None = None
        self._step_end = StepEnd()
        self._catch_up = PlateauCatchUp()
        self._after_file = AfterFileWatch()
        self._replay: Unfinished | None = None
        self._metrics: dict[str, Any] = {}
        self._unsaid = False
        self._unisolate: Callable[[], None] = lambda: None
        self._unrebuild: Callable[[], None] = lambda: None
        self._loader_generators = LoaderGenerators()
        self._between = True
        """Key what runs between two steps (``draws_between_steps``), set at each epoch."""
        self._step_loaders: list[StepLoader] = []

    @property
    @override
    def state_key(self) -> str:
        return STATE_KEY  # one per Trainer: the RNGs are the process's

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer, self._seed, self._restored = trainer, None, False
        self._loaded = False  # nothing of an earlier fit carries over
        self._gens, self._first_step_ended = ModuleGenerators(), False
        self._step_end, self._replay, self._metrics = StepEnd(), None, {}
        self._unsaid, self._loader_generators = False, LoaderGenerators()
        self._catch_up, self._between, self._step_loaders = PlateauCatchUp(), True, []
        if self.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        # Lightning loads the weights after the module's on_load_checkpoint and before any
        # callback's: a load pre-hook is where shapes and dtypes can be seen first.
        hook = pl_module.register_load_state_dict_pre_hook  # untyped in torch's stubs
        self._hook = hook(self._before_weights_load)  # type: ignore[no-untyped-call]
        if stage == "fit":  # a validation's draws stay its own: a plain loader's next read
            self._unisolate = isolate_validations(trainer)
            # a resume at an epoch's start builds the plain loaders' iterators where the run did
            self._unrebuild = rebuild_resumed_epoch(trainer, self, self._seed_epoch)

    def _before_weights_load(
        self, module: torch.nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any
    ) -> None:
        live = dict(module.named_parameters()) | dict(module.named_buffers())
        saved = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
        check_state_shapes(saved, {k: t for k, t in live.items() if k in saved})
        trainer = self._trainer
        if trainer is None or not str(trainer.precision).startswith("64"):
            return
        # The precision plugin converts the module to float64 only after this load: widen
        # the tensors now, so the checkpoint's float64 values are copied, not rounded.
        for name, tensor in live.items():
            value = saved.get(name)
            wider = isinstance(value, torch.Tensor) and value.dtype == torch.float64
            if wider and tensor.is_floating_point() and tensor.dtype != torch.float64:
                tensor.data = tensor.data.to(torch.float64)

    def _run_seed(self) -> int:
        """This rank's seed: the checkpoint's, else fixed now from ``torch.initial_seed()``
        (at the first step: after the module's ``on_train_start`` may have seeded)."""
        if self._seed is None:
            self._seed = torch.initial_seed()
        return self._seed

    def _module_generators(self) -> dict[str, Generator]:
        """The module's generators (``module_generators``), found at the first call of a
        fit (after its ``on_train_start``)."""
        trainer = self._trainer
        if trainer is None or trainer.lightning_module is None:
            return {}
        return self._gens.of(trainer.lightning_module)

    def _seed_for(self, domain: int, *key: int, sanity_check: bool = False) -> None:
        """The process's RNGs and the module's generators set from this key. In the
        sanity check (before the first step and the module's ``on_train_start``) the seed
        is not fixed yet, nor are the generators found."""
        trainer = self._trainer
        rank = trainer.global_rank if trainer is not None else 0
        if sanity_check:
            seed = torch.initial_seed() if self._seed is None else self._seed
            seed_all(derive(seed, domain, *key, rank))
            return
        seed_all(derive_in(self._run_seed(), domain, *key, rank))
        if self._gens.found is None:
            self._module_generators()
        if self._gens.found:
            self._gens.seed(domain, *key, rank)

    @override
    def state_dict(self) -> dict[str, Any]:
        trainer = self._trainer
        self._module_generators()
        if trainer is not None and trainer.lightning_module is not None:  # a file names all
            where = f"at the checkpoint of global step {trainer.global_step}"
            self._gens.rescan(trainer.lightning_module, where, first=False)
        mine = (self._run_seed(), self._gens.state())
        by_rank: list[Any] = [mine]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # Every rank builds the checkpoint (this runs on each: a collective), rank 0
            # writes it: each rank's seeds go in, by rank.
            by_rank = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(by_rank, mine)
        unfinished = self._step_end.unfinished(trainer) if trainer is not None else None
        return {
            "seed_by_rank": [seed for seed, _ in by_rank],
            "generator_seeds_by_rank": [generators for _, generators in by_rank],
            "fingerprint": fingerprint(trainer),
            # What of its step's end (validation, plateau update, a stop) the file misses
            "step_end": unfinished.state() if unfinished is not None else None,
            "callback_metrics": saved_metrics(trainer),
        }

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._after_file.saved(trainer, pl_module, self._step_end)

    def _check_after_file(self, pl_module: pl.LightningModule) -> None:
        text = self._after_file.changed(pl_module)
        if text is not None:
            warnings.warn(text, stacklevel=outside_lightning())

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        self._loaded = True  # any checkpoint, with ExactResume's state or without

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        trainer = self._trainer
        rank = trainer.global_rank if trainer is not None else 0
        self._restored = True
        self._replay = Unfinished.from_state(state_dict.get("step_end"))
        self._unsaid = "seed_by_rank" in state_dict and "step_end" not in state_dict
        self._metrics = state_dict.get("callback_metrics", {})
        if "seed_by_rank" not in state_dict:  # written before the per-step seeds
            warnings.warn(
                "ExactResume: the checkpoint holds RNG states of an earlier lit-spikes, not "
                "the run's seed: the resumed run draws from per-step seeds of "
                "torch.initial_seed(), not what the run that wrote it would have drawn",
                stacklevel=2,
            )
        by_rank = state_dict.get("seed_by_rank", [])
        self._seed = by_rank[rank] if rank < len(by_rank) else None
        generators = state_dict.get("generator_seeds_by_rank", [])
        self._gens.saved = dict(generators[rank]) if rank < len(generators) else None
        if self._seed is None and by_rank:
            warnings.warn(
                f"ExactResume: the checkpoint holds the seeds of {len(by_rank)} "
                f"process(es), none for rank {rank}: this rank draws from its own seed, so "
                "its random draws (dropout) are not those of any earlier run",
                stacklevel=2,
            )
        differ = fingerprint_differences(state_dict["fingerprint"], fingerprint(trainer))
        if differ:
            warnings.warn(
                "ExactResume: resuming under a different setup than the checkpoint was "
                f"written in ({'; '.join(differ)}): the resumed run is not guaranteed to be "
                "bit-exact",
                stacklevel=2,
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if trainer.global_step > 0 and not self._loaded:
            refuse_a_second_fit(trainer)
        check_one_batch_per_step(trainer, pl_module)
        self._take_loaders(trainer, pl_module)
        resumed = trainer.ckpt_path is not None and trainer.global_step > 0
        for text in position_warnings(trainer) if resumed else []:
            warnings.warn(text, stacklevel=outside_lightning())
        if resumed and not self._restored:
            warnings.warn(
                f"ExactResume: the fit starts at step {trainer.global_step} from a "
                "checkpoint without ExactResume's state (the run's seed): its random draws "
                "(dropout) are not those of the run that wrote it",
                stacklevel=2,
            )
        if resumed:
            self._finish_the_files_step(trainer, pl_module)
        self._replay, self._metrics, self._unsaid = None, {}, False

    def _finish_the_files_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """At a resume: the logged metrics back (a plateau's, a monitor's), and what of its
        step's end the file came before run now (``step_end.replay``), or said."""
        trainer.callback_metrics.update(self._metrics)
        if self._unsaid and step_validates(trainer):
            warnings.warn(
                f"ExactResume: the checkpoint of step {trainer.global_step} was written by "
                "an earlier lit-spikes, which did not say whether the step's validation ran "
                "before it: if not (a ModelCheckpoint every n steps, a preemption), the "
                "resumed run misses that validation's updates (EarlyStopping's count, a "
                "ReduceLROnPlateau's LR, a monitor's best)",
                stacklevel=outside_lightning(),
            )
        unfinished = self._replay
        if unfinished is None or unfinished.step != trainer.global_step:
            return
        # From what the step left the RNGs at (a shuffled val loader's order)
        micro = trainer.fit_loop.batch_idx % trainer.accumulate_grad_batches
        self._seed_for(BETWEEN, trainer.global_step, micro)
        replay(trainer, pl_module, unfinished, self._step_end)
        hooks = epoch_end_hooks(trainer, ExactResume) if unfinished.epoch_end else []
        if hooks:
            warnings.warn(
                f"ExactResume: the checkpoint of step {unfinished.step} was written at its "
                "epoch's last batch, before the epoch's end, which Lightning's restart "
                f"skips: on_train_epoch_end of {', '.join(hooks)} does not run for that "
                "epoch in the resumed run (a file of another step resumes it)",
                stacklevel=outside_lightning(),
            )

    def _take_loaders(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """At the fit's start and each epoch's (a loader may be built anew for an epoch,
        reload_dataloaders_every_n_epochs): seek the StepLoaders to the global step, keep
        them (each step checks their position), and see whether anything draws between
        two steps."""
        loaders = train_loaders(trainer)
        self._step_loaders = [loader for loader in loaders if isinstance(loader, StepLoader)]
        for loader in self._step_loaders:  # no batch was fetched yet: it has a length
            loader.seek(trainer.global_step)
            loader.restores_rng = False  # each step's start sets the RNGs anyway
        self._between = draws_between_steps(trainer, pl_module, loaders)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._step_end.closed(trainer)  # the last epoch's end ran
        self._catch_up.make_up(trainer)
        self._take_loaders(trainer, pl_module)
        # A DataLoader draws its workers' seeds and a shuffle's order from torch's RNG (or
        # its own generator) right after this hook (from the second epoch on): keyed by
        # the epoch, not by what ran before.
        self._gens.rescan(pl_module, f"at epoch {trainer.current_epoch}'s start", first=False)
        self._seed_epoch(trainer.current_epoch)

    def _seed_epoch(self, epoch: int) -> None:
        """The process's RNGs, the module's generators and the plain train loaders' own
        generators keyed by the epoch (also where Lightning's restart skipped its start)."""
        self._seed_for(EPOCH, epoch)
        if self._trainer is not None:
            loaders, rank = train_loaders(self._trainer), self._trainer.global_rank
            self._loader_generators.seed(loaders, EPOCH, epoch, rank)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        step = trainer.global_step
        for loader in self._step_loaders:
            if loader.next_step != step + 1:
                raise RuntimeError(
                    f"the StepLoader delivered the batch of step {loader.next_step - 1} at "
                    f"global step {step}: the global step does not advance by "
                    "one per batch here (an epoch ended early by on_train_batch_start "
                    "returning -1, several optimizer steps per batch under manual "
                    "optimization, or the loader iterated outside the fit). StepLoader "
                    "serves the batch of each global step: advance it once per batch"
                )
        self._check_after_file(pl_module)
        self._step_end.batch_started(trainer, step)  # the previous step's end ran
        self._seed_for(STEP, step, batch_idx % trainer.accumulate_grad_batches)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
        batch_idx: int,
    ) -> None:  # fmt: skip
        if not self._first_step_ended:  # a generator made in the fit's first step
            self._first_step_ended = True
            where = f"at the end of the fit's first batch, global step {trainer.global_step}"
            self._gens.rescan(pl_module, where, first=True)
        # What runs from here to the next step's start (the module's own hook, a plain
        # loader's next batch) draws from a stream of this step's key: the same whatever
        # watches the run, and the next step starts from its own anyway.
        if self._between:
            micro = batch_idx % trainer.accumulate_grad_batches
            self._seed_for(BETWEEN, trainer.global_step, micro)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # validation_step's draws (dropout left on, a sampled metric): the same validation
        # at a step whichever interval or checkpoint brought it. The sanity check (inside
        # Lightning's isolate_rng, before the first step) is keyed without fixing the seed.
        self._seed_for(VALIDATION, trainer.global_step, sanity_check=trainer.sanity_checking)
        if not trainer.sanity_checking:
            self._check_after_file(pl_module)
            self._step_end.validation_started(trainer)

    @override
    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check_after_file(pl_module)
        self._step_end.epoch_ended(trainer)  # the last step's validation and plateau ran
        self._catch_up.epoch_ended(trainer)

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._check_after_file(pl_module)
        self._catch_up.make_up(trainer)
        self._step_end.closed(trainer)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for loader in train_loaders(trainer):
            if isinstance(loader, StepLoader):
                loader.restores_rng = True  # read outside this fit, it keeps them again
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._unisolate()
        self._unrebuild()
        self._unisolate = self._unrebuild = lambda: None
        self._loader_generators = LoaderGenerators()
        self._trainer = None
