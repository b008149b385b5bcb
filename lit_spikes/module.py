"""The LightningModule around TinyGPT: the seed's optimiser, schedule and records,
plus its model config in the checkpoint; ExactResume adds what a bit-exact resume needs."""

from __future__ import annotations

import atexit
import functools
import math
import random
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
import torchmetrics
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from torch.optim.lr_scheduler import LambdaLR
from typing_extensions import override

from lit_spikes.callbacks.exact_resume import ExactResume
from lit_spikes.checkpoints import CheckpointError
from lit_spikes.data import Batch, StepDataModule, config_differences
from lit_spikes.model import GPTConfig, GPTOutput, build_model
from lit_spikes.schedule import WarmupCosine

DEFAULT_MODEL_SEED = 1
"""Initialisation seed of the default run: with data seed 0 it shows the spike (README)."""

LOGGED_AS = {"loss": "train/loss", "max_logit": "train/max_logit", "position": "data/position"}
"""TensorBoard tag of each per-step record key (the others are logged under their own)."""
STEP_SCALARS = ("loss", "max_logit", "lr", "grad_norm", "position")
"""The per-step ``history`` keys the module logs at every step, as ``LOGGED_AS`` tags them."""

CHECKPOINT_KEY = "lit_spikes"
"""Top-level key of the module's checkpoint entry (model config, skipped steps)."""


@dataclass(frozen=True)
class OptimConfig:
    """AdamW and its schedule. The defaults are the seed's deliberately unstable setup."""

    peak_lr: float = 0.1
    """Peak learning rate, reached at the end of warm-up (0.1 is far too high on purpose)."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to every parameter."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    warmup_steps: int = 100
    """Steps of linear warm-up."""
    max_steps: int = 400
    """Steps the cosine decays over; the run's length."""
    min_lr_ratio: float = 0.1
    """Floor of the cosine as a fraction of the peak."""
    lr_scale: float = 1.0
    """Multiplies the whole schedule."""

    def __post_init__(self) -> None:
        # math.isfinite too: an inf or NaN passes "> 0", and every step then goes NaN.
        if not (math.isfinite(self.peak_lr) and self.peak_lr > 0):
            raise ValueError(f"OptimConfig.peak_lr={self.peak_lr} must be finite and positive")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ValueError(
                f"OptimConfig.weight_decay={self.weight_decay} must be finite and >= 0"
            )
        for name in ("beta1", "beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"OptimConfig.{name}={getattr(self, name)} must be in [0, 1)")
        if self.max_steps < 1:
            raise ValueError(f"OptimConfig.max_steps={self.max_steps} must be >= 1")
        self.schedule()  # validates warm-up, floor and scale with the schedule's own messages

    def schedule(self) -> WarmupCosine:
        return WarmupCosine(self.warmup_steps, self.max_steps, self.min_lr_ratio, self.lr_scale)

    def build(self, parameters: Any) -> tuple[torch.optim.AdamW, LambdaLR]:
        optimizer = torch.optim.AdamW(
            parameters,
            lr=self.peak_lr,
            weight_decay=self.weight_decay,
            betas=(self.beta1, self.beta2),
        )
        return optimizer, LambdaLR(optimizer, self.schedule())


def optimized_parameters(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters ``optimizer`` updates, in its order: those Lightning's gradient
    clipping measures, listed in a few microseconds where ``Module.parameters()`` walks
    every submodule (0.08 ms a step for the default model)."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def grad_norm(parameters: Any) -> torch.Tensor:
    """Total L2 norm of the gradients, what ``clip_grad_norm_`` measures (its own
    ``get_total_norm``), changing nothing."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    return torch.nn.utils.get_total_norm(grads, norm_type=2.0)


def set_flush_denormal(enabled: bool) -> None:
    """Flush subnormal floats to zero in this thread (or stop), where the CPU can."""
    if not torch.set_flush_denormal(enabled) and enabled:
        warnings.warn(
            "flush_denormal=True: this CPU cannot flush subnormal floats (no SSE3), they "
            "are kept, so results differ from a CPU that flushes them",
            stacklevel=2,
        )


def seed_rngs(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


class BitsPerChar(torchmetrics.Metric):
    """Mean cross-entropy over all validated characters, in bits."""

    full_state_update = False

    def __init__(self) -> None:
        super().__init__()
        self.add_state("nats", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("count", torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")
        self.nats: torch.Tensor
        self.count: torch.Tensor

    @override
    def update(self, mean_loss: torch.Tensor, num_chars: int) -> None:
        self.nats += mean_loss.detach().double() * num_chars
        self.count += num_chars

    @override
    def compute(self) -> torch.Tensor:
        return self.nats / self.count / math.log(2.0)


class TinyGPTModule(pl.LightningModule):
    """TinyGPT trained the seed's way, resumable bit-for-bit from its own checkpoints.

    Logs ``train/loss`` (also on the progress bar), ``train/max_logit``, ``lr``,
    ``data/position`` and ``grad_norm`` (before any clipping) with ``self.log`` at every
    step (``on_step=True, on_epoch=False``: what reaches the loggers follows the Trainer's
    ``log_every_n_steps``, every step in this project's runs), and ``val/bpc`` whenever the
    Trainer validates. Each step is also appended to ``history`` (plain floats) for
    scripts and tests.

    It brings ``ExactResume`` (``configure_callbacks``), as any module can be given it: the
    RNG states of every rank and the fingerprint of what decides the numerics. Its own
    entry, ``"lit_spikes"``, holds its model config and the steps whose update it skipped
    for a non-finite loss or gradient. A different model or optimizer config is an error
    before any step.

    Args:
        gpt: shape of the network.
        optim: AdamW and LR schedule.
        model_seed: initialisation seed of the network.
        train_seed: seed of the RNGs used in training (dropout), for a fresh run.
        num_threads: CPU threads for this process; results depend on it.
        flush_denormal: treat subnormal floats as zero in this process's training thread
            (``torch.set_flush_denormal``, set in ``setup`` and left so, as the thread
            count is). Softmax over growing attention logits produces them, and on Intel
            CPUs each one costs a microcode assist: steps of the default model took
            40-48 ms with them against 29 ms without. Results depend on it. It reaches
            the threads a process starts after it is set: with ``num_threads`` > 1 in a
            process whose thread pool already ran, the pool's threads may keep them.

    Example:
        >>> module = TinyGPTModule(gpt=GPTConfig(n_layer=4), optim=OptimConfig(peak_lr=0.1))
        >>> trainer.fit(module, datamodule=StepDataModule())
    """

    def __init__(
        self,
        gpt: GPTConfig = GPTConfig(),  # noqa: B008 (frozen dataclass: immutable default)
        optim: OptimConfig = OptimConfig(),
        model_seed: int = DEFAULT_MODEL_SEED,
        train_seed: int = 0,
        num_threads: int = 1,
        flush_denormal: bool = True,
    ) -> None:
        super().__init__()
        # Dicts are accepted too: that is how load_from_checkpoint passes the saved hparams.
        self.model_config = _as(GPTConfig, gpt)
        self.optim_config = _as(OptimConfig, optim)
        if num_threads < 1:
            raise ValueError(f"num_threads={num_threads} must be >= 1")
        if not 0 <= train_seed < 2**31:  # rank r seeds NumPy (< 2**32) with train_seed + r
            raise ValueError(f"train_seed={train_seed} must be in [0, 2**31)")
        self.model_seed, self.train_seed, self.num_threads = model_seed, train_seed, num_threads
        self.flush_denormal = flush_denormal
        # Plain dicts only: the checkpoint must load with torch.load(weights_only=True).
        self.save_hyperparameters(
            {
                "gpt": asdict(self.model_config),
                "optim": asdict(self.optim_config),
                "model_seed": model_seed,
                "train_seed": train_seed,
                "num_threads": num_threads,
                "flush_denormal": flush_denormal,
            }
        )
        self.model = build_model(self.model_config, model_seed)
        self.val_bpc = BitsPerChar()
        self.history: list[dict[str, float]] = []
        self._restored_for_fit = False
        """Whether the fit now starting restored a checkpoint (its on_load_checkpoint ran)."""
        self.nonfinite_steps: list[int] = []
        """Steps whose loss or gradient was NaN/inf: their update was not applied."""

    @override
    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> GPTOutput:
        out: GPTOutput = self.model(idx, targets)
        return out

    @override
    def setup(self, stage: str) -> None:
        trainer = self.trainer
        datamodule = getattr(trainer, "datamodule", None)
        check_training_setup(
            self.model_config,
            datamodule if isinstance(datamodule, StepDataModule) else None,
            trainer.accumulate_grad_batches,
            getattr(trainer, "overfit_batches", 0),  # set on it, untyped
        )
        torch.set_num_threads(self.num_threads)
        set_flush_denormal(self.flush_denormal)
        self._restored_for_fit = False  # before this fit's restore, if it has one
        if trainer.world_size > 1:
            destroy_process_group_at_exit()

    @override
    def configure_callbacks(self) -> list[Callback]:
        # RNG states (dropout), the fingerprint and unrounded float64 weights: what a
        # bit-exact resume needs beyond Lightning's checkpoint, as for any module.
        return [ExactResume()]

    @override
    def on_train_start(self) -> None:
        # After any checkpoint restore (ExactResume has put back the RNG states).
        if not self._restored_for_fit:
            if self.global_step > 0:
                raise RuntimeError(
                    f"this Trainer already trained to step {self.global_step}: a second fit "
                    "on it would go on with the data from there but restart the LR schedule "
                    "and AdamW's moments (Lightning builds them anew). Resume with a new "
                    "Trainer and fit(..., ckpt_path=<the checkpoint of that step>)"
                )
            # A new run, from weights loaded by load_from_checkpoint or of an earlier fit
            # of this module: the skipped steps read with them are not its own.
            self.nonfinite_steps = []
        if self.global_step == 0:
            # Each rank its own stream (dropout masks differ across ranks).
            seed_rngs(self.train_seed + self.global_rank)

    @override
    def training_step(self, batch: Batch, batch_idx: int) -> torch.Tensor:
        out = self.model(batch["x"], batch["y"])
        assert out.loss is not None
        self._record(out.loss.detach(), out.max_logit, int(batch["position"]))
        # The loss's Python float, kept by _record: torch.isfinite on it cost 0.05 ms.
        finite = math.isfinite(self.history[-1]["loss"])
        everywhere = finite
        if self.trainer.world_size > 1:
            # Under DDP every rank must skip the same steps: one rank's NaN skips them all.
            everywhere = self.trainer.strategy.reduce_boolean_decision(finite, all=True)
        if not everywhere:
            self._skip_update("loss" if not finite else "loss on another rank")
        # Backward runs even so (DDP's gradient all-reduce needs every rank), and the
        # callbacks see the step's real loss; on_before_optimizer_step drops the gradients
        # of a skipped step, so AdamW changes nothing (no decay, no moments).
        loss: torch.Tensor = out.loss
        return loss

    def _skip_update(self, what: str) -> None:
        self.nonfinite_steps.append(self.global_step)
        self.history[-1]["skipped"] = 1.0
        warnings.warn(
            f"non-finite {what} at step {self.global_step}: its update is skipped, and no "
            "checkpoint written after it will be chosen as a rollback target",
            stacklevel=2,
        )

    def _record(self, loss: torch.Tensor, max_logit: torch.Tensor, position: int) -> None:
        lr = self.trainer.optimizers[0].param_groups[0]["lr"]
        # Here, not at the batch's end: callbacks (a monitor, the progress bar) read
        # callback_metrics in their on_train_batch_end, which runs before the module's.
        # To the loggers with the step's other scalars (on_train_batch_end): one call each.
        self.log(LOGGED_AS["loss"], loss, on_step=True, on_epoch=False, prog_bar=True, logger=False)
        self.history.append(
            {
                "step": self.global_step,
                "loss": loss.item(),
                "max_logit": max_logit.item(),
                "lr": lr,
                "position": position,
            }
        )

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self.global_step in self.nonfinite_steps:
            # A skipped loss: its gradients must not reach AdamW. No norm is recorded.
            for parameter in self.parameters():
                parameter.grad = None
            return
        parameters = optimized_parameters(optimizer)
        if all(p.grad is None for p in parameters):
            return  # a callback (SkipStep) dropped the update, and recorded the real norm
        norm = grad_norm(parameters).item()  # before the Trainer clips
        if self.history and self.history[-1]["step"] == self.global_step:
            self.history[-1]["grad_norm"] = norm
        if not math.isfinite(norm):
            # A finite loss with inf/NaN gradients: drop the gradients (zeroing them would
            # still let weight decay and momentum move the weights). Under DDP the
            # gradients were all-reduced, so every rank drops the same step.
            for parameter in self.parameters():
                parameter.grad = None
            self._skip_update("gradient norm")

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        # The per-step scalars go to the loggers in one log_metrics call: each self.log of
        # a step value costs Lightning 0.7 ms (its result collection walks the metric's
        # state to move it), 8% of a step here for four more of them.
        record = self.history[-1]
        step = int(record["step"])
        every: int = getattr(self.trainer, "log_every_n_steps", 1)  # set on it, untyped
        # Lightning's rule for what self.log sends: every n-th step and a stopping one
        if not every or ((step + 1) % every and not self.trainer.should_stop):
            return
        keys = [k for k in STEP_SCALARS if k in record]
        metrics = {LOGGED_AS.get(k, k): float(record[k]) for k in keys}
        for logger in self.loggers:
            logger.log_metrics(metrics, step=step)

    @override
    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        out = self.model(batch["x"], batch["y"])
        assert out.loss is not None
        self.val_bpc.update(out.loss, batch["y"].numel())
        self.log("val/bpc", self.val_bpc, on_step=False, on_epoch=True, prog_bar=True)

    @override
    def configure_optimizers(self) -> Any:
        optimizer, scheduler = self.optim_config.build(self.parameters())
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint[CHECKPOINT_KEY] = {
            "model": asdict(self.model_config),
            "nonfinite_steps": list(self.nonfinite_steps),
        }

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # What a resume needs beyond the weights: not for validate, test, or weights loaded
        # with load_from_checkpoint (no Trainer), which a weights-only file serves too.
        fitting = _fitting(self)
        if fitting and "optimizer_states" not in checkpoint:
            raise CheckpointError(
                Path(self.trainer.ckpt_path or "(unnamed)"),
                "holds weights only (no optimizer state): it cannot resume a run bit-exactly; "
                "validate or test with it, or start a new run from its weights "
                "(TinyGPTModule.load_from_checkpoint)",
            )
        entry = checkpoint.get(CHECKPOINT_KEY)
        if entry is None:
            raise ValueError(
                "this checkpoint has no 'lit_spikes' entry (model config, skipped steps): it "
                "was not written by TinyGPTModule, so it cannot be resumed here"
            )
        check_model_config(entry["model"], asdict(self.model_config))
        saved_optim = checkpoint.get("hyper_parameters", {}).get("optim")
        if fitting and saved_optim is not None:  # weights alone need no optimizer config
            # load_from_checkpoint merges its keyword arguments in: an OptimConfig here
            check_optim_config(asdict(_as(OptimConfig, saved_optim)), asdict(self.optim_config))
        for key, label in (("optimizer_states", "optimizers"), ("lr_schedulers", "schedulers")):
            count = len(checkpoint.get(key, []))
            if fitting and count != 1:
                raise ValueError(
                    f"the checkpoint holds {count} {label}, TinyGPTModule configures 1: it was "
                    "written by another training setup and cannot be resumed here"
                )
        if not fitting:
            return  # the weights are all that validate, test or a new run take from it
        self._restored_for_fit = True
        self.nonfinite_steps = list(entry.get("nonfinite_steps", []))


def _fitting(module: pl.LightningModule) -> bool:
    """Whether ``module`` is attached to a Trainer that fits (not validate, test, or
    ``load_from_checkpoint``'s bare module, whose ``trainer`` property raises)."""
    try:
        return module.trainer.state.fn == TrainerFn.FITTING
    except RuntimeError:
        return False


def destroy_process_group() -> None:
    """Tear the process group down, if there is one, before the interpreter does.

    Left to the interpreter's teardown, gloo's threads were destroyed while still
    joinable: ``terminate called without an active exception``, and rank 0 exited with
    -6 after writing everything (seen in this project's DDP tests and CI).
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@functools.cache
def destroy_process_group_at_exit() -> None:
    """Call ``destroy_process_group`` when the interpreter exits (registered once)."""
    atexit.register(destroy_process_group)


def check_training_setup(
    gpt: GPTConfig,
    datamodule: StepDataModule | None,
    accumulate_grad_batches: int = 1,
    overfit_batches: float = 0,
) -> None:
    """Raises ``ValueError`` naming every part of a model, data and Trainer setup that
    would fail at the first step or silently train on other batches: a text too short
    for a row, rows longer than the model's context, characters beyond its vocabulary,
    gradient accumulation (the batch of global step k is one whole batch), Lightning's
    ``overfit_batches`` (the batches never repeat)."""
    problems = []
    if datamodule is not None:
        try:
            datamodule.setup("fit")  # builds the text, checking that rows can be cut from it
        except ValueError as error:
            problems.append(str(error))
        rows, vocab = datamodule.config.block_size, datamodule.tokenizer.vocab_size
        if rows > gpt.block_size:
            problems.append(
                f"DataConfig.block_size={rows} exceeds GPTConfig.block_size={gpt.block_size}: "
                "rows must fit the model's context (make them equal)"
            )
        if gpt.vocab_size < vocab:
            problems.append(
                f"GPTConfig.vocab_size={gpt.vocab_size} is smaller than the {vocab} characters "
                f"of the data's alphabet: use vocab_size={vocab}"
            )
    if accumulate_grad_batches != 1:
        problems.append(
            f"Trainer(accumulate_grad_batches={accumulate_grad_batches}): the batch of global "
            "step k is one whole batch here; set DataConfig.batch_size to the rows a step "
            "should see instead"
        )
    if overfit_batches:
        problems.append(
            f"Trainer(overfit_batches={overfit_batches}): the batch of global step k is drawn "
            "for (data seed, k), so no batch comes again and Lightning's overfitting mode "
            "would train on fresh batches without saying so; leave it at 0"
        )
    if problems:
        raise ValueError("; ".join(problems))


def _refuse_differences(
    saved: dict[str, Any], current: dict[str, Any], what: str, advice: str
) -> None:
    differ = config_differences(saved, current)
    if differ:
        raise ValueError(
            f"the checkpoint's {what} differs from this module's ({'; '.join(differ)}): {advice}"
        )


def check_model_config(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Raises ``ValueError`` listing every model-config field that differs."""
    advice = "build the module with the checkpoint's config to resume it"
    _refuse_differences(saved, current, "model config", advice)


def check_optim_config(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Raises ``ValueError`` listing every optimizer-config field that differs: a resume
    restores AdamW's hyperparameters and the schedule's own from the checkpoint, so a
    different config would be silently overridden."""
    advice = (
        "a resume restores AdamW and the LR schedule from the checkpoint, so these would be "
        "silently ignored. Resume with the checkpoint's config; to change the LR from the "
        "resume point on, add an LRScaler callback"
    )
    _refuse_differences(saved, current, "optimizer config", advice)


def _as(cls: type, value: Any) -> Any:
    if value is None:
        return cls()
    if isinstance(value, dict):
        return cls(**value)
    if isinstance(value, cls):
        return value
    raise TypeError(f"expected {cls.__name__} or dict, got {type(value).__name__}")
