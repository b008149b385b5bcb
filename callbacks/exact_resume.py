"""What a bit-exact resume needs beyond Lightning's checkpoint, for any LightningModule:
the RNG states of every rank, a fingerprint of what decides the numerics, and weights that
load as they were saved."""

from __future__ import annotations

import os
import random
import warnings
from collections.abc import Sequence
from typing import Any

import lightning
import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.hooks import RemovableHandle
from typing_extensions import override

from lit_spikes.loader import StepLoader

STATE_KEY = "ExactResume{}"
"""Where a checkpoint holds ExactResume's state (``checkpoint["callbacks"][STATE_KEY]``)."""
CUBLAS_WORKSPACE = ":4096:8"
"""``CUBLAS_WORKSPACE_CONFIG`` for deterministic cuBLAS (PyTorch's reproducibility notes)."""


def collect_rng_states() -> dict[str, Any]:
    """torch (CPU, and each CUDA device once CUDA is initialized), Python and NumPy RNG
    states in plain types (``torch.load(weights_only=True)`` reads them)."""
    version, internal, gauss = random.getstate()
    state = np.random.get_state(legacy=True)
    assert isinstance(state, tuple)  # legacy=True: (kind, keys, pos, has_gauss, cached)
    kind, keys, pos, has_gauss, cached = state
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [version, list(internal), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what ``collect_rng_states`` returned."""
    torch.set_rng_state(states["torch"])
    version, internal, gauss = states["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def flush_denormal_enabled() -> bool:
    """Whether this thread flushes subnormal floats: the smallest normal float32 halved
    is subnormal, and comes out as zero when they are flushed."""
    tiny = torch.tensor(torch.finfo(torch.float32).tiny, dtype=torch.float32)
    return bool((tiny / 2) == 0)


def deterministic_settings() -> dict[str, Any]:
    """The switches that make kernels deterministic, as this process has them."""
    return {
        "algorithms": torch.are_deterministic_algorithms_enabled(),
        "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "cublas_workspace": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    }


def gradient_clipping(trainer: pl.Trainer | None) -> dict[str, Any] | None:
    """The Trainer's gradient clipping as a fingerprint records it: None for none (no
    ``gradient_clip_val``, or 0), else its value and algorithm (Lightning's default: norm)."""
    value = getattr(trainer, "gradient_clip_val", None) if trainer is not None else None
    if not value:
        return None
    algorithm = getattr(trainer, "gradient_clip_algorithm", None)
    return {"value": float(value), "algorithm": str(getattr(algorithm, "value", "norm"))}


def software_fingerprint() -> dict[str, str]:
    """The versions and CPU kernels a step's numerics depend on, in this process."""
    return {
        "torch": str(torch.__version__),
        "lightning": str(lightning.__version__),
        # The SIMD kernels torch picked (AVX2, AVX512, ...): they round differently, so
        # the same run on another CPU family is another (equally exact) trajectory.
        "cpu": torch.backends.cpu.get_cpu_capability(),
    }


def _scaler_name(trainer: pl.Trainer | None) -> str | None:
    scaler = getattr(trainer.precision_plugin, "scaler", None) if trainer is not None else None
    return type(scaler).__name__ if scaler is not None else None


def fingerprint(trainer: pl.Trainer | None) -> dict[str, Any]:
    """What decides the numerics of a step, beyond the checkpointed state."""
    device = trainer.strategy.root_device if trainer is not None else torch.device("cpu")
    return {
        **software_fingerprint(),
        "num_threads": torch.get_num_threads(),
        "flush_denormal": flush_denormal_enabled(),
        "device": device.type,
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
        "world_size": trainer.world_size if trainer is not None else 1,
        "precision": str(trainer.precision) if trainer is not None else "32-true",
        # Its state (scale, growth tracker) Lightning saves itself, with the precision plugin.
        "grad_scaler": _scaler_name(trainer),
        "deterministic": deterministic_settings(),
        "gradient_clip": gradient_clipping(trainer),
    }


def fingerprint_differences(saved: dict[str, Any], here: dict[str, Any]) -> list[str]:
    """``"<key>: checkpoint <a>, now <b>"`` for each setting that differs. Clipping added
    where the checkpoint's run had none is not one: that is the clipping remedy."""
    differ = []
    for key in sorted(set(saved) & set(here)):
        if saved[key] == here[key] or (key == "gradient_clip" and saved[key] is None):
            continue
        differ.append(f"{key}: checkpoint {saved[key]!r}, now {here[key]!r}")
    return differ


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
    uses_loader = any(isinstance(loader, StepLoader) for loader in train_loaders(trainer))
    if uses_loader and trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"Trainer(accumulate_grad_batches={trainer.accumulate_grad_batches}) with a "
            "StepLoader: it serves the batch of each global step, one batch per step; give "
            "it batch_size = the rows a step should see instead"
        )


def train_loaders(trainer: pl.Trainer) -> list[Any]:
    """The Trainer's train loaders, flattened from what ``trainer.train_dataloader`` holds."""
    loaders: Any = trainer.train_dataloader
    if isinstance(loaders, dict):
        return list(loaders.values())
    return list(loaders) if isinstance(loaders, Sequence) else [loaders]


class ExactResume(Callback):
    """Makes a run resumed from a checkpoint draw what the uninterrupted run drew.

    Lightning saves no RNG state: a module with dropout (or any random draw in training)
    resumed from a ``.ckpt`` draws other masks than the run that went on. This callback
    saves the torch (CPU, and each CUDA device), Python and NumPy RNG states of every
    rank (every rank draws its own; only rank 0 writes the file) and restores each rank's
    at the start of the first step, after everything else of the resume drew. Whatever
    is drawn between a checkpoint and the next step (a validation with random draws, a
    hook) is not in the training stream: from the next step's start the uninterrupted run
    goes on from the checkpoint's states too, as a resume from it does (Lightning's resume
    skips that validation). A save inside a step (Lightning's ``on_exception`` checkpoint)
    holds the states of that step's start. It also:

    - records a fingerprint (torch and Lightning versions, the CPU's SIMD kernels, CPU
      threads, subnormal flushing, device and GPU, world size, precision, deterministic
      settings, gradient clipping) and warns, naming each, where a resume's differs: the
      run is then not guaranteed bit-exact;
    - refuses weights of other shapes before any step, naming each tensor;
    - loads float64 weights into a ``precision="64-true"`` run unrounded (Lightning loads
      them before its precision plugin converts the module, which rounded them to float32);
    - seeks every ``StepLoader`` of the fit to ``trainer.global_step`` at its start and at
      each epoch's (a reloaded loader), refuses ``accumulate_grad_batches`` with one, and
      refuses a step that trains on another step's batch.

    Everything it writes is plain data (``torch.load(weights_only=True)``).

    Args:
        deterministic: in ``setup``, ask for deterministic kernels:
            ``torch.use_deterministic_algorithms(True)``, cuDNN deterministic and not
            benchmarking, and ``CUBLAS_WORKSPACE_CONFIG`` (set only if unset). Recorded in
            the fingerprint either way.

    Raises:
        ValueError: ``deterministic`` not a bool; weights of other shapes at a resume;
            ``accumulate_grad_batches`` with a ``StepLoader``.
        RuntimeError: a ``StepLoader`` batch of another step than the global step.

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
        self._pending: dict[str, Any] | None = None
        self._rewind: dict[str, Any] | None = None
        self._in_step = False
        self._step_start: dict[str, Any] | None = None
        self._restored = False
        self._hook: RemovableHandle | None = None

    @property
    @override
    def state_key(self) -> str:
        return STATE_KEY  # one per Trainer: the RNGs are the process's

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer, self._pending, self._restored = trainer, None, False
        if self.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
            torch.use_deterministic_algorithms(True)
            torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
        # Lightning loads the weights after the module's on_load_checkpoint and before any
        # callback's: a load pre-hook is where shapes and dtypes can be seen first.
        hook = pl_module.register_load_state_dict_pre_hook  # untyped in torch's stubs
        self._hook = hook(self._before_weights_load)  # type: ignore[no-untyped-call]

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

    @override
    def state_dict(self) -> dict[str, Any]:
        # A save inside a step (Lightning's on_exception checkpoint) resumes that step: it
        # must draw again what the step drew, from its start.
        states = self._step_start if self._in_step else collect_rng_states()
        # What a resume from this file draws next, the uninterrupted run draws too: from
        # the next step's start on it goes on from these states, whatever validation or a
        # hook drew between this save and that step (a resume fast-forwards past them).
        self._rewind = states
        trainer = self._trainer
        by_rank: list[Any] = [states]
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # Every rank builds the checkpoint (this runs on each: a collective), rank 0
            # writes it: each rank's states go in, by rank.
            by_rank = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(by_rank, states)
        return {"rng_by_rank": by_rank, "fingerprint": fingerprint(trainer)}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        trainer = self._trainer
        rank = trainer.global_rank if trainer is not None else 0
        by_rank = state_dict["rng_by_rank"]
        self._restored = True
        self._pending = by_rank[rank] if rank < len(by_rank) else None
        if self._pending is None:
            warnings.warn(
                f"ExactResume: the checkpoint holds the RNG states of {len(by_rank)} "
                f"process(es), none for rank {rank}: this rank goes on with its own RNG "
                "states, so its random draws (dropout) are not those of any earlier run",
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
        check_one_batch_per_step(trainer, pl_module)
        self._seek(trainer)
        resumed = trainer.ckpt_path is not None and trainer.global_step > 0
        if resumed and self._pending is None and not self._restored:
            warnings.warn(
                f"ExactResume: the fit starts at step {trainer.global_step} from a "
                "checkpoint without ExactResume's state (RNG states): its random draws "
                "(dropout) are not those of the run that wrote it",
                stacklevel=2,
            )
        # Put back at the first step's start, after every hook of the fit's start drew.
        self._rewind, self._pending = self._pending, None

    @staticmethod
    def _seek(trainer: pl.Trainer) -> None:
        for loader in train_loaders(trainer):
            if isinstance(loader, StepLoader):  # no batch was fetched yet: it has a length
                loader.seek(trainer.global_step)

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._seek(trainer)  # a loader built anew for the epoch (reload_dataloaders_every_n)

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        for loader in train_loaders(trainer):
            if isinstance(loader, StepLoader) and loader.next_step != trainer.global_step + 1:
                raise RuntimeError(
                    f"the StepLoader delivered the batch of step {loader.next_step - 1} at "
                    f"global step {trainer.global_step}: the global step does not advance by "
                    "one per batch here (an epoch ended early by on_train_batch_start "
                    "returning -1, several optimizer steps per batch under manual "
                    "optimization, or the loader iterated outside the fit). StepLoader "
                    "serves the batch of each global step: advance it once per batch"
                )
        if self._rewind is not None:
            set_rng_states(self._rewind)
            self._rewind = None
        self._in_step, self._step_start = True, collect_rng_states()

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self._in_step = False  # before Lightning's ModelCheckpoint saves (it runs last)

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._trainer = None
