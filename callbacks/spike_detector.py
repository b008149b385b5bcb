"""Detect loss spikes every global step, record them, and log or stop."""

from __future__ import annotations

import copy
import math
import statistics
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from typing_extensions import override

from lit_spikes.callbacks.common import check_finite_above, check_integer, make_state_key
from lit_spikes.callbacks.spike import Episode, Spike, group_episodes
from lit_spikes.callbacks.spike_marks import SpikeMarks
from lit_spikes.callbacks.watch import (
    GRAD_NORM,
    LOSS,
    Watcher,
    monitor_names,
    not_logged,
    note_grad_norm,
    read_back,
    step_values,
)

DEFAULT_ROBUST_Z, DEFAULT_ROBUST_WINDOW, OTHER_WINDOW = 8.0, 100, 20
"""The rule of a detector given no threshold (``robust_z=8`` over 100 steps), and the
window of one given ``ratio`` or ``z_score`` alone (the demo's 20). Measured on three
kinds of modules by scripts/detector_defaults.py (docs/detector.md)."""
DEFAULT_SETTLE = 10
"""Steps without a flag that end a spike's episode: the ringing after one bad batch (its
flags a few steps apart) is one episode (docs/detector.md)."""


def robust_limit(recent: Sequence[float], k: float) -> float:
    """``median + k x spread`` of ``recent``: the spread is the median absolute deviation
    from the median, x 1.4826 (a normal noise's standard deviation); where more than half
    the values are equal (a MAD of 0), the mean absolute deviation x 1.2533 (the same
    scale); where every value is equal, inf: a window without spread makes no finite
    value an outlier (as in ``SkipStep``). Plain floats: microseconds a step."""
    median = statistics.median(recent)
    deviations = [abs(v - median) for v in recent]
    spread = 1.4826 * statistics.median(deviations)
    if spread == 0:
        spread = 1.2533 * statistics.fmean(deviations)
    return median + k * spread if spread > 0 else math.inf


def describe_spike(spike: Spike | Mapping[str, Any], action: str = "log") -> str:
    """One line for a spike: what, where, against what reference."""
    spike = Spike.of(spike)
    value, reference = spike.value, spike.reference
    times = f" ({value / reference:.2f}x)" if math.isfinite(value) and reference > 0 else ""
    return (
        f"SpikeDetector: {spike.metric} spike at step {spike.step}: {value:.4f} against "
        f"a reference of {reference:.4f}{times}" + ("; stopping" if action == "stop" else "")
    )


class SpikeDetector(Watcher):
    r"""Flags a step whose value jumps above a rolling reference; a NaN or inf of a watched
    value is always a spike.

    After ``warmup`` steps, a step is a spike when its value exceeds, of the last
    ``window`` finite values, their median + ``robust_z`` x their robust spread (the
    scaled median absolute deviation, ``robust_limit``), ``ratio`` x their mean, or their
    mean + ``z_score`` standard deviations: any of those given, or all (``mode``). Given
    none, the rule is ``robust_z=8`` over 100 steps. Every finite value enters the
    reference. Each spike (step, metric, value, reference) is kept in the callback's state,
    which survives checkpoints, and logged as ``spike/<metric>``; the onset of each
    episode (a spike and its aftermath, ``settle``) is drawn on the monitored curve's chart
    as a dot at its reference, a one-point run ``spikes/step_<k>`` (``SpikeMarks``). The
    values stay on the device and are read back every ``read_every`` steps; a step is an
    optimizer step (under accumulation, the mean of its micro-batches' losses); under DDP
    every rank judges the same gathered value. How each rule behaves, and why these
    defaults: docs/detector.md.

    Args:
        monitor: what to watch, a name or a list: ``"loss"``, the loss ``training_step``
            returns; ``"grad_norm"``, the total gradient norm before clipping, measured by
            the callback; any other name, a key of ``trainer.callback_metrics`` (what the
            module logs with ``self.log``), as ``EarlyStopping(monitor=...)`` reads it.
        window: steps in the rolling reference (None: 100 with ``robust_z``, the default
            rule, else 20).
        warmup: steps recorded before any value can be flagged (a NaN or inf of a watched
            value is flagged always; None: ``window``).
        ratio: flag values above ``ratio`` x the reference mean (None: not used).
        z_score: flag values above mean + ``z_score`` x std (None: not used).
        robust_z: flag values above median + ``robust_z`` x the MAD-based spread (None:
            not used; 8 when no threshold is given).
        mode: ``"any"`` flags when either threshold is crossed, ``"all"`` when both are.
        action: ``"log"`` records and logs; ``"stop"`` also stops training at that step.
        min_step: no flag before this global step (the demos look after warm-up).
        verbose: also say each spike on the console (Lightning's info log, rank 0), as
            ``EarlyStopping(verbose=True)`` says why it stops.
        strict: a ``callback_metrics`` name the module did not log in a training step is
            an error naming it and the step (as ``EarlyStopping(strict=True)``); False:
            that step is not judged. A key logged only in validation is thus refused (or
            never judged): each training step is judged by its own values.
        reduce: ``"mean"`` or ``"max"`` of the ranks' values under several processes.
        max_records: spikes kept in the state (the latest).
        settle: steps without a flag that end a spike's episode (``episodes``): the flags
            within ``settle`` steps of an episode's last one are its aftermath, not new
            spikes; ``onsets`` and the summary at the end of a fit count episodes.
        read_every: steps between the reads that bring the values back to judge them
            (None: 1 for ``action="stop"``, 50 for ``action="log"``).
        curves: the TensorBoard tag of a monitored name's curve, whose chart shows its
            spikes (``TinyGPTModule`` logs its loss as ``train/loss``). Unstated, the
            chart is found: for ``loss``, the name the module logs the same value under
            (``self.log("train_loss", loss)``), else a ``loss`` curve the detector logs
            itself; for a logged name, its own (``SpikeMarks``).

    Raises:
        ValueError: an argument out of range.
        RuntimeError: with ``strict``, a monitored name not logged in a training step,
            naming it, the step and the keys logged.

    Example:
        >>> detector = SpikeDetector(monitor="loss", action="stop")  # robust_z=8 over 100
        >>> trainer = pl.Trainer(callbacks=[detector])
        >>> detector.spikes[:20]  # [Spike(step=122, metric="loss", value=3.1, reference=2.1)]
        >>> detector.episodes  # [Episode(onset=Spike(step=122, ...), peak=..., end=124, flags=2)]

    At the end of a fit it says the run's spike episodes, or that there were none, in one
    line (Lightning's info log, rank 0).
    """

    def __init__(
        self,
        monitor: str | Sequence[str] = LOSS,
        window: int | None = None,
        warmup: int | None = None,
        ratio: float | None = None,
        z_score: float | None = None,
        robust_z: float | None = None,
        mode: Literal["any", "all"] = "any",
        action: Literal["log", "stop"] = "log",
        min_step: int = 0,
        verbose: bool = False,
        strict: bool = True,
        reduce: Literal["mean", "max"] = "mean",
        max_records: int = 1000,
        read_every: int | None = None,
        curves: Mapping[str, str] | None = None,
        settle: int = DEFAULT_SETTLE,
    ) -> None:
        super().__init__()
        self.monitor = monitor
        self.monitors = monitor_names(monitor, "SpikeDetector")
        if ratio is None and z_score is None and robust_z is None:
            robust_z = DEFAULT_ROBUST_Z
        if window is None:
            window = DEFAULT_ROBUST_WINDOW if robust_z is not None else OTHER_WINDOW
        window = check_integer("window", window, 2)
        warmup = check_integer("warmup", window if warmup is None else warmup, 0)
        # Kept as floats: the state key shows them, and ratio=2 and ratio=2.0 (a YAML
        # integer, a command-line float) must name the same detector in a checkpoint.
        if ratio is not None:
            ratio = check_finite_above("ratio", ratio, 1.0, " (a spike is a rise)")
        if z_score is not None:
            z_score = check_finite_above("z_score", z_score, 0.0)
        if robust_z is not None:
            robust_z = check_finite_above("robust_z", robust_z, 0.0)
        for name, value, allowed in (
            ("mode", mode, ("any", "all")),
            ("action", action, ("log", "stop")),
            ("reduce", reduce, ("mean", "max")),
        ):
            if value not in allowed:
                raise ValueError(f"{name}={value!r} must be one of {allowed}")
        self.window, self.warmup, self.ratio, self.z_score = window, warmup, ratio, z_score
        self.robust_z = robust_z
        self.mode, self.action, self.reduce = mode, action, reduce
        self.min_step = check_integer("min_step", min_step, 0)
        self.max_records = check_integer("max_records", max_records, 1)
        self.settle = check_integer("settle", settle, 1)
        self.verbose, self.strict = verbose, strict
        default_every = 1 if action == "stop" else 50
        self.read_every = check_integer("read_every", read_every or default_every, 1)
        self.curves = dict(curves or {})
        self._marks = SpikeMarks(self.monitors, self.curves)
        self.spikes: list[Spike] = []
        """The flagged steps, oldest first (the latest ``max_records``)."""
        self.num_spikes = 0
        self._recent: dict[str, deque[float]] = {m: deque(maxlen=window) for m in self.monitors}
        self._seen = 0
        self._began_at = -1
        """The global step as the current batch began."""

    @property
    @override
    def state_key(self) -> str:
        # What makes two detectors judge differently (two of them may watch one run): not
        # what they do with a flag (action, verbose), so that a resume may change that and
        # keep the window. Not min_step either: it only gates which flags count, and
        # diagnose replays a run's detector from step 0.
        return self._key()

    @property
    def older_state_keys(self) -> tuple[str, ...]:
        """The keys this detector's state was saved under before its key left out
        ``action`` (either one): a resume from such a file restores it too."""
        return tuple(self._key(action=action) for action in ("log", "stop"))

    def _key(self, **older: Any) -> str:
        # robust_z only when set: a checkpoint written before it existed names its ratio
        # detector as this one does.
        robust = {"robust_z": self.robust_z} if self.robust_z is not None else {}
        return make_state_key(
            self,
            monitor=self.monitors,
            window=self.window,
            ratio=self.ratio,
            z_score=self.z_score,
            mode=self.mode,
            warmup=self.warmup,
            **older,
            **robust,
        )

    def state_in(self, checkpoint: dict[str, Any]) -> dict[str, Any] | None:
        """This detector's state in ``checkpoint`` (under its key or an older one), or None."""
        states = checkpoint.get("callbacks") or {}
        for key in (self.state_key, *self.older_state_keys):
            if key in states:
                state: dict[str, Any] = states[key]
                return state
        return None

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        # Lightning restores the state under state_key itself, after this hook; a file of
        # an older key is restored here. A detector that finds neither would judge the
        # resumed steps on an empty window, with only Lightning's generic warning naming
        # the file's keys: this one names the detector.
        states = checkpoint.get("callbacks") or {}
        if self.state_key in states:
            return
        state = self.state_in(checkpoint)
        if state is not None:
            self.load_state_dict(copy.deepcopy(state))
            return
        saved = [str(k) for k in states if str(k).startswith(f"{type(self).__qualname__}{{")]
        if saved:
            rank_zero_warn(
                f"{self.state_key} restored nothing: the checkpoint holds no state under its "
                f"key, only {saved}. It starts with an empty window and no spikes, so the "
                "first steps are not judged. Give it the settings of the run that saved it "
                "(monitor, window, warmup, ratio, z_score, robust_z, mode: action and "
                "verbose may change)",
                category=UserWarning,
            )

    def threshold(self, metric: str) -> float | None:
        """The value above which the next step of ``metric`` is a spike (None: too early)."""
        recent = self._recent[metric]
        if self._seen < self.warmup or len(recent) < 2:
            return None
        mean = statistics.fmean(recent)  # plain floats: microseconds, no tensor work
        limits = []
        if self.ratio is not None:  # a rise of ratio x |mean| above a negative mean too
            limits.append(self.ratio * mean if mean > 0 else mean + (self.ratio - 1) * -mean)
        if self.z_score is not None:  # no spread, no outlier (as robust_limit)
            std = statistics.stdev(recent)
            limits.append(mean + self.z_score * std if std > 0 else math.inf)
        if self.robust_z is not None:
            limits.append(robust_limit(recent, self.robust_z))
        return min(limits) if self.mode == "any" else max(limits)

    def check(
        self,
        step: int,
        values: dict[str, float],
        rank_values: dict[str, list[float | None]] | None = None,
    ) -> list[Spike]:
        """Judge one step's (global) values, then add them to the reference; returns the new
        spikes. ``rank_values``, when given, is copied into each spike."""
        found: list[Spike] = []
        for metric in self.monitors:
            value = values.get(metric)
            if value is None:
                continue
            limit = self.threshold(metric)
            recent = self._recent[metric]
            # The centre the rule measures from: the median for robust_z, else the mean.
            if self.robust_z is not None and recent:
                reference = statistics.median(recent)
            else:
                reference = sum(recent) / max(1, len(recent))
            # NaN/inf of any watched value is a spike at once: NaN > limit is never true.
            non_finite = not math.isfinite(value)
            if non_finite or (limit is not None and step >= self.min_step and value > limit):
                ranks = None if rank_values is None else tuple(rank_values[metric])
                found.append(Spike(step, metric, value, reference, rank_values=ranks))
            if math.isfinite(value):
                self._recent[metric].append(value)
        self._seen += 1
        self.spikes.extend(found)
        del self.spikes[: -self.max_records]  # the latest kept
        self.num_spikes += len(found)
        return found

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Any
    ) -> None:
        if GRAD_NORM in self.monitors:
            note_grad_norm(trainer, pl_module)  # before clipping, or a skip dropping it

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._began_at = trainer.global_step
        super().on_train_batch_start(trainer, pl_module, batch, batch_idx)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *args: Any
    ) -> None:
        if trainer.global_step == self._began_at:
            return  # no optimizer step ended here (a micro-batch of an accumulation)
        step = trainer.global_step - 1  # the step just trained: the optimizer counted it
        values = step_values(trainer, step, self.monitors, outputs)
        self._check_present(trainer, values.here)
        parts = [values.reduced(self.reduce), values.present.any(0).double()]
        if trainer.world_size > 1:  # each rank's values too, to show which shard it was
            parts += [values.per_rank.flatten(), values.present.double().flatten()]
        # At the fit's first step: which logged name the loss is (the marks' chart), read
        # back with the step's values.
        rank = trainer.global_rank if trainer.world_size > 1 else 0
        loss = values.per_rank[rank, self.monitors.index(LOSS)] if LOSS in self.monitors else None
        same = self._marks.observe(trainer, pl_module, loss)
        if same is not None:
            parts.append(same)
        self._pending.append((step, torch.cat(parts)))
        if self.read_every == 1:
            read_back(trainer)  # now, for a stop at the spike's own step

    @override
    def take_rows(self, trainer: pl.Trainer | None, rows: list[tuple[int, list[float]]]) -> None:
        count, world = len(self.monitors), trainer.world_size if trainer is not None else 1
        width = 2 * count * (1 + world if world > 1 else 1)
        for step, whole in rows:
            row, same = whole[:width], whole[width:]
            if same:  # the first step's comparison (``SpikeMarks.observe``)
                self._marks.resolve(same)
            values = {m: row[i] for i, m in enumerate(self.monitors) if row[count + i]}
            per_rank: dict[str, list[float | None]] | None = None
            if world > 1:
                ranks, flags = row[2 * count : 2 * count + world * count], row[-world * count :]
                per_rank = {
                    m: [
                        ranks[r * count + i] if flags[r * count + i] else None for r in range(world)
                    ]
                    for i, m in enumerate(self.monitors)
                }
            found = self.check(step, values, per_rank)
            if trainer is not None:
                self._marks.log_curves(trainer, step, values, bool(found))
            self._report(trainer, found)

    def _report(self, trainer: pl.Trainer | None, found: list[Spike]) -> None:
        # Straight to the loggers at the spike's step: `self.log` would repeat the last
        # value on every later step.
        for spike in found:
            for logger in trainer.loggers if trainer is not None else []:
                logger.log_metrics({f"spike/{spike.metric}": spike.value}, step=spike.step)
            if trainer is not None and self._starts_episode(spike):
                self._marks.write(trainer, spike.metric, spike.step, spike.reference)
            if self.verbose:
                rank_zero_info(describe_spike(spike, self.action))
        if found and self.action == "stop" and trainer is not None:
            trainer.should_stop = True

    def _starts_episode(self, spike: Spike) -> bool:
        """Whether ``spike`` (recorded) is an episode's onset (``onsets``): TensorBoard
        marks onsets alone."""
        return spike.step in self.onsets

    def _check_present(self, trainer: pl.Trainer, here: list[bool]) -> None:
        missing = [
            m
            for m, present in zip(self.monitors, here, strict=True)
            if not present and m not in (LOSS, GRAD_NORM)
        ]
        if missing and self.strict:
            owner = f"SpikeDetector(monitor={list(self.monitors)!r})"
            raise RuntimeError(not_logged(owner, missing, trainer, trainer.global_step - 1))

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        self._marks.begin()

    @property
    def charts(self) -> dict[str, str]:
        """The TensorBoard tag of each watched name's curve, whose chart shows its marks
        (``curves``, else found at the fit's first step: ``{"loss": "train_loss"}``;
        empty before it)."""
        return {metric: chart.tag for metric, chart in self._marks.charts().items()}

    @property
    def episodes(self) -> list[Episode]:
        """The spikes kept, grouped into episodes (``settle``): each one spike and its
        aftermath."""
        return group_episodes(self.spikes, self.settle)

    @property
    def onsets(self) -> list[int]:
        """The first step of each episode (of the spikes kept)."""
        return [episode.onset.step for episode in self.episodes]

    def summary(self, steps: int) -> str:
        """One line on the run's spikes after ``steps`` steps: its episodes, or none."""
        found = self.episodes
        watched = ", ".join(self.monitors)
        if not found:
            return f"SpikeDetector({watched}): no spike in {steps} steps"
        listed = "; ".join(e.describe() for e in found)
        count = f"{len(found)} spike episode{'s' if len(found) > 1 else ''}"
        return f"SpikeDetector({watched}): {count} in {steps} steps: {listed}"

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_end(trainer, pl_module)  # the last steps judged first
        rank_zero_info(self.summary(trainer.global_step))

    @override
    def state_dict(self) -> dict[str, Any]:
        self._read_own()  # a checkpoint holds every step judged so far
        return {
            "spikes": [s.to_dict() for s in self.spikes],  # plain: a weights-only load
            "num_spikes": self.num_spikes,
            "recent": {m: list(v) for m, v in self._recent.items()},
            "seen": self._seen,
            "action": self.action,  # not in the key: a resume from the file alone keeps it
        }

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.spikes = [Spike.of(s) for s in state_dict["spikes"]][-self.max_records :]
        self.num_spikes = int(state_dict.get("num_spikes", len(self.spikes)))
        for metric, values in state_dict["recent"].items():
            if metric in self._recent:
                self._recent[metric] = deque(values, maxlen=self.window)
        self._seen = int(state_dict["seen"])
