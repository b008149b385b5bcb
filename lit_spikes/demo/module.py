"""The LightningModule around TinyGPT: the seed's optimiser, schedule and records,
plus its model config in the checkpoint; ExactResume adds what a bit-exact resume needs."""

from __future__ import annotations

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
from lit_spikes.checkpoints import CheckpointError, record_nonfinite
from lit_spikes.demo.data import Batch, StepDataModule
from lit_spikes.demo.model import GPTConfig, GPTOutput, build_model
from lit_spikes.demo.schedule import WarmupCosine
from lit_spikes.demo.setup_checks import (
    check_model_config,
    check_optim_config,
    check_training_setup,
)
from lit_spikes.demo.step_records import MaskedStep, Row, StepRecords
from lit_spikes.shared.processes import destroy_process_group_at_exit
from lit_spikes.tool_facts import Column, ToolFacts, Variant

DEFAULT_MODEL_SEED = 1
"""Initialisation seed of the default run: with data seed 0 it shows the spike (README)."""

LOGGED_AS = {"loss": "train/loss", "max_logit": "train/max_logit", "position": "data/position"}
"""TensorBoard tag of each per-step record key (the others are logged under their own)."""
STEP_SCALARS = ("loss", "max_logit", "lr", "grad_norm", "position")
"""The per-step ``history`` keys the module logs at every step, as ``LOGGED_AS`` tags them."""

DETECTOR_RULE = {"ratio": 1.4, "window": 20}
"""The demo's spike rule: its spike at 1.65x the mean is caught, and its healthy steps
stay below 1.4x (docs/detector.md)."""
MAX_LOGIT_COLUMN = Column("max_logit", "max attn logit", digits=1)
QK_NORM_VARIANT = Variant(
    "qk_norm", "QK-norm at the same LR (from scratch)", {"gpt": {"qk_norm": True}}
)
"""recover's comparison row of the fix aimed at the cause (the attention logit's growth)."""
"""The tools' column of the largest attention logit (recover's: after the first spike)."""

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


def _check_setup(gpt: GPTConfig, trainer: pl.Trainer, datamodule: Any) -> None:
    """``check_training_setup`` of this model with the Trainer's data (the demo's only)."""
    own_data = datamodule if isinstance(datamodule, StepDataModule) else None
    overfit = getattr(trainer, "overfit_batches", 0)  # set on it, untyped
    check_training_setup(gpt, own_data, trainer.accumulate_grad_batches, overfit)


class TinyGPTModule(pl.LightningModule):
    """TinyGPT trained the seed's way, resumable bit-for-bit from its own checkpoints.

    Logs ``train/loss`` (on the progress bar: the latest value read back, updated every
    50 steps), ``train/max_logit``, ``lr``,
    ``data/position`` and ``grad_norm`` (before any clipping) at every step as
    ``self.log(on_step=True)`` would (the Trainer's ``log_every_n_steps``, every step in
    this project's runs), and ``val/bpc`` whenever the Trainer validates. Each step is
    also a record of ``history`` (plain floats) for scripts and tests. No step reads a
    value back to the host: they stay on the device and are read back with the watching
    callbacks' values (``StepRecords``): every 50 steps, at a checkpoint, at the fit's end
    and when ``history`` is read; the loggers get them then, each at its own step.

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

    logs_lr_and_grad_norm = True
    """It logs ``lr`` and ``grad_norm`` itself: ``TrainingCurves`` leaves it alone."""

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
        self._records: list[dict[str, float]] = []
        self._nonfinite: list[int] = []
        self._reader = StepRecords(self._take)
        self._to_log: list[dict[str, float]] = []
        """Records of logging steps whose values are still on the device."""
        self._loss: torch.Tensor | None = None
        """This step's loss, on the device."""
        self._masked = MaskedStep()
        """Drops the update of a non-finite step, as decided on the device."""
        self.nonfinite_guard = "auto"
        """How a non-finite step's update is dropped: ``"device"``, decided on the device
        (``MaskedStep`` puts the weights and AdamW's state back, no host read); ``"host"``,
        its gradients dropped after one read of the decision; ``"auto"``, the device on an
        accelerator and the host on a CPU, where a read waits for nothing and the masked
        step's copies would cost 5% of a step. Both give the same weights."""
        self._restored_for_fit = False
        """Whether the fit now starting restored a checkpoint (its on_load_checkpoint ran)."""

    @property
    def tool_facts(self) -> ToolFacts:
        """What the tools read of this module (``lit_spikes.SpikeToolsModule``): its
        curves' tags, the demo's spike rule, validation bits/char (lower is better), the
        run's end and warm-up from its LR schedule, the largest attention logit, and QK-norm
        as the variant that aims at the cause of its spikes."""
        return ToolFacts(
            curves=LOGGED_AS,
            detector=DETECTOR_RULE,
            val_metric="val/bpc",
            val_label="val bits/char",
            val_mode="min",
            run_steps=self.optim_config.max_steps,
            warmup_steps=self.optim_config.warmup_steps,
            columns=(MAX_LOGIT_COLUMN,),
            variants=(QK_NORM_VARIANT,),
        )

    @property
    def history(self) -> list[dict[str, float]]:
        """One record a step (plain floats: step, loss, max_logit, lr, position,
        grad_norm, and ``skipped`` for a non-finite step), read back from the device
        first: complete up to the last step trained (the step in training has its
        loss and max_logit from its training_step on, its grad_norm after backward)."""
        self._flush()
        return self._records

    @history.setter
    def history(self, records: list[dict[str, float]]) -> None:
        self._flush()
        self._records = records

    @property
    def nonfinite_steps(self) -> list[int]:
        """Steps whose loss or gradient was NaN/inf: their update was not applied.

        The update is dropped on the device in the step itself (``optimizer_step``); the
        step is listed here, and warned of, when the step's values are read back: every
        50 steps, before any checkpoint is written (rollback refuses the files written
        after one), at the fit's end, or at once when this is read."""
        self._flush()
        return self._nonfinite

    @nonfinite_steps.setter
    def nonfinite_steps(self, steps: list[int]) -> None:
        self._flush()
        self._nonfinite = list(steps)

    @property
    def nonfinite_steps_read(self) -> list[int]:
        """``nonfinite_steps`` as read back so far, without a read: complete up to the
        newest checkpoint written (CheckpointRetention needs no more)."""
        return self._nonfinite

    def _flush(self) -> None:
        reader = self.__dict__.get("_reader")  # absent while __init__ runs
        if reader is not None:
            reader.flush()

    @override
    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> GPTOutput:
        out: GPTOutput = self.model(idx, targets)
        return out

    @override
    def setup(self, stage: str) -> None:
        trainer = self.trainer
        _check_setup(self.model_config, trainer, getattr(trainer, "datamodule", None))
        torch.set_num_threads(self.num_threads)
        set_flush_denormal(self.flush_denormal)
        self._restored_for_fit = False  # before this fit's restore, if it has one
        if trainer.world_size > 1:
            destroy_process_group_at_exit()

    def check_run(
        self,
        stage: str,
        trainer: pl.Trainer,
        *,
        model: Any,
        datamodule: Any,
        checkpoint: dict[str, Any] | None,
    ) -> None:
        """``lit_spikes.ChecksItsRun``: what ``setup`` would refuse at the first step,
        before ``lit-spikes fit`` writes a file; and an example input for the model
        summary it prints (without one its FLOPs column said 0; a forward in eval mode,
        no grad: no RNG drawn, no state kept)."""
        _check_setup(self.model_config, trainer, datamodule)
        if self.example_input_array is None:
            rows = self.model_config.block_size
            self.example_input_array = torch.zeros((1, rows), dtype=torch.long)

    @override
    def configure_callbacks(self) -> list[Callback]:
        # RNG states (dropout), the fingerprint and unrounded float64 weights: what a
        # bit-exact resume needs beyond Lightning's checkpoint, as for any module.
        # StepRecords reads the step records back with the watchers' rows, in their read.
        return [ExactResume(), self._reader]

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
        self._record(out.loss.detach(), out.max_logit, batch["position"])
        # Backward runs even for a non-finite loss (DDP's gradient all-reduce needs every
        # rank), and the callbacks see the step's real loss; optimizer_step then puts the
        # weights and AdamW's state back, so the step changes nothing.
        loss: torch.Tensor = out.loss
        return loss

    def _record(self, loss: torch.Tensor, max_logit: torch.Tensor, position: Any) -> None:
        lr = self.trainer.optimizers[0].param_groups[0]["lr"]
        # Here, not at the batch's end: callbacks (a monitor) read callback_metrics in their
        # on_train_batch_end, which runs before the module's. To the loggers with the
        # step's other scalars (on_train_batch_end): one call each. Not prog_bar: Lightning
        # turns every progress-bar tensor into a float at every step (a host read); the
        # bar shows the loss read back with the records instead (_take).
        self.log(LOGGED_AS["loss"], loss, on_step=True, on_epoch=False, logger=False)
        # The read fills in loss, max_logit and position (in the records' key order).
        record: dict[str, Any] = {
            "step": self.global_step,
            "loss": math.nan,
            "max_logit": math.nan,
            "lr": lr,
            "position": -1,
        }
        self._records.append(record)
        self._loss, self._masked.skip = loss, None
        # Loss, max_logit and the data position stay on the device until the next read.
        values = [loss, max_logit.detach(), torch.as_tensor(position, device=loss.device)]
        self._reader.add(record, "scalars", torch.stack([v.double() for v in values]))

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # The non-finite guard: decided on the device, applied by MaskedStep or (host) here.
        if not self._records or self._records[-1]["step"] != self.global_step:
            return  # no training_step of this step (nothing recorded, nothing to judge)
        assert self._loss is not None  # set by this step's training_step
        bad_here = ~torch.isfinite(self._loss)
        bad_loss = bad_here
        if self.trainer.world_size > 1:
            # Every rank must skip the same steps: one rank's NaN skips them all (a device
            # all-reduce; its gradients are most likely NaN everywhere too, but not surely).
            bad_loss = self.trainer.strategy.reduce(bad_here.double(), reduce_op="sum") > 0
        parameters = optimized_parameters(optimizer)
        if any(p.grad is not None for p in parameters):
            # Before the Trainer clips; after DDP's all-reduce, so the same on every rank.
            norm = grad_norm(parameters).double()
            skip = bad_loss | ~torch.isfinite(norm)
            if not self._guard_on_device():
                if skip:  # the one read of the host guard (no device sync on a CPU)
                    for parameter in self.parameters():
                        parameter.grad = None  # AdamW then changes nothing
            else:
                self._masked.skip = skip
            has_norm = ~bad_loss  # a skipped loss records no norm
        else:  # a callback dropped the gradients: AdamW has nothing to apply, no norm
            norm = has_norm = torch.zeros((), dtype=torch.float64, device=bad_here.device)
        flags = [norm, has_norm, bad_here, bad_loss, ~torch.isfinite(norm)]
        self._reader.add(self._records[-1], "guard", torch.stack([f.double() for f in flags]))

    @override
    def on_fit_start(self) -> None:
        # A step with a non-finite loss or gradient norm applies nothing: the weights and
        # AdamW's state (moments, step count) are put back on the device after the step
        # (dropping the gradients would take a host read to decide, and zeroing them
        # would still let weight decay and momentum move the weights).
        if self._guard_on_device():
            self._masked.attach(self.trainer.optimizers)

    def _guard_on_device(self) -> bool:
        if self.nonfinite_guard not in ("auto", "device", "host"):
            raise ValueError(
                f"nonfinite_guard={self.nonfinite_guard!r} must be 'auto', 'device' or 'host'"
            )
        if self.nonfinite_guard == "auto":
            return self.device.type != "cpu"
        return self.nonfinite_guard == "device"

    @override
    def teardown(self, stage: str) -> None:
        self._masked.detach()

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self._records:
            return
        record = self._records[-1]
        step = int(record["step"])
        every: int = getattr(self.trainer, "log_every_n_steps", 1)  # set on it, untyped
        # Lightning's rule for what self.log sends: every n-th step and a stopping one
        if not every or ((step + 1) % every and not self.trainer.should_stop):
            return
        self._to_log.append(record)
        if not self._reader.pending():  # read back already (a callback read the history)
            self._log(self.trainer)

    def _log(self, trainer: pl.Trainer) -> None:
        # The per-step scalars go to the loggers in one log_metrics call: each self.log of
        # a step value costs Lightning 0.7 ms (its result collection walks the metric's
        # state to move it), 8% of a step here for four more of them. They go when the
        # values are read back, each at its own step.
        records, self._to_log = self._to_log, []
        for record in records:
            metrics = {LOGGED_AS.get(k, k): float(record[k]) for k in STEP_SCALARS if k in record}
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=int(record["step"]))

    def _take(self, trainer: pl.Trainer | None, rows: list[Row]) -> None:
        """Fill in the records with their values read back (``StepRecords``), list and
        warn of the non-finite steps, and log the logging steps."""
        shown = None
        for record, kind, values in rows:
            if kind == "scalars":
                record["loss"], record["max_logit"] = values[0], values[1]
                record["position"] = int(values[2])
                shown = values[0]
                continue
            norm, has_norm, bad_here, bad_loss, bad_norm = values
            if has_norm:
                record["grad_norm"] = norm
            if bad_loss:
                self._skip_update(record, "loss" if bad_here else "loss on another rank")
            elif bad_norm:
                self._skip_update(record, "gradient norm")
        if trainer is not None and shown is not None:
            # The latest loss read back, as a plain float: every progress bar shows
            # trainer.progress_bar_metrics, which keeps a key until the fit's end.
            trainer.progress_bar_metrics[LOGGED_AS["loss"]] = shown
        if trainer is not None and self._to_log:
            self._log(trainer)

    def _skip_update(self, record: dict[str, Any], what: str) -> None:
        step = int(record["step"])
        self._nonfinite.append(step)
        record["skipped"] = 1.0
        warnings.warn(
            f"non-finite {what} at step {step}: its update is skipped, and no "
            "checkpoint written after it will be chosen as a rollback target",
            stacklevel=2,
        )

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
        # nonfinite_steps reads the pending steps back: the file lists every skipped one.
        checkpoint[CHECKPOINT_KEY] = {
            "model": asdict(self.model_config),
            "nonfinite_steps": list(self.nonfinite_steps),
        }
        # The record every rollback reads, whoever dropped the update (SkipStep writes it too)
        record_nonfinite(checkpoint, self.nonfinite_steps)

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
            if "flush_denormal" not in checkpoint.get("hyper_parameters", {}):
                self.flush_denormal = False  # a file from before the option: not flushed
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


def _as(cls: type, value: Any) -> Any:
    if value is None:
        return cls()
    if isinstance(value, dict):
        return cls(**value)
    if isinstance(value, cls):
        return value
    raise TypeError(f"expected {cls.__name__} or dict, got {type(value).__name__}")
