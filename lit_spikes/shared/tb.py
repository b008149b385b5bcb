"""TensorBoard for the runs: Lightning's ``TensorBoardLogger`` without the constant
``epoch`` tag, with the final validation bits/char as the HPARAMS view's metric, and
extras that make the demo runs comparable at a glance: a custom-scalars layout that puts
each tag of all rows on one chart, and each demo's table as text."""

from __future__ import annotations

import numbers
from argparse import Namespace
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from tensorboard.compat.proto.summary_pb2 import Summary
from torch.utils.tensorboard import SummaryWriter
from typing_extensions import override


def hparam_tag(val_metric: str) -> str:
    """The HPARAMS view's tag of a validation metric's final value: ``hp/<metric>``, its
    slashes as underscores (``val/bpc`` -> ``hp/val_bpc``)."""
    return "hp/" + val_metric.replace("/", "_")


class RunLogger(TensorBoardLogger):
    """``TensorBoardLogger`` for this project's runs: the same events, less two tags.

    - No ``epoch`` scalar: Lightning adds ``epoch`` to every ``log_metrics`` call of
      ``self.log`` values (``_LoggerConnector.log_metrics``), and a run here is one epoch
      of an endless stream, so it is a flat 0 in every run. A metric logged as ``epoch``
      is dropped too.
    - The scalars of one ``log_metrics`` call go out as one event: TensorBoard reads the
      same tags, steps and values, and a step's five scalars cost one event's build and
      (pure Python) checksum instead of five: 11% of a step under two busy cores here.
    - No ``hp_metric = -1`` (``default_hp_metric`` is off). With ``hparams_metric`` (the
      module's validation metric, ``ToolFacts.val_metric``), a run that ends successfully
      and logged it records its hyperparameters with its last value as ``hp/<metric>``
      (``hparam_tag``), at that step, as the demos' rows do (``write_hparams``).

    Args:
        *args: ``TensorBoardLogger``'s (``save_dir``, ``name``, ...).
        hparams_metric: the validation metric whose final value is recorded with the
            hyperparameters at the end (None: none; the demos' branch runner records
            each row's own).
        prefix: put at the start of every metric's tag, joined by ``LOGGER_JOIN_CHAR``
            (``"-"``), as ``TensorBoardLogger``'s ``prefix`` does; applied here (Lightning
            gets ``""``), so that the one-event path prefixes the tags too.
        **kwargs: ``TensorBoardLogger``'s.

    Example:
        >>> trainer = pl.Trainer(logger=RunLogger("runs", name="mine", version=""))
    """

    def __init__(
        self, *args: Any, hparams_metric: str | None = None, prefix: str = "", **kwargs: Any
    ) -> None:
        kwargs.setdefault("default_hp_metric", False)
        kwargs["prefix"] = ""  # applied in log_metrics (Lightning keeps its own private)
        super().__init__(*args, **kwargs)
        self.hparams_metric = hparams_metric
        self.prefix = prefix
        self._final_val: tuple[float, int] | None = None

    @override
    @rank_zero_only
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        metrics = {key: value for key, value in metrics.items() if key != "epoch"}
        metric = self.hparams_metric
        if metric is not None and metric in metrics and step is not None:
            self._final_val = (float(metrics[metric]), step)
        if self.prefix:
            metrics = {f"{self.prefix}{self.LOGGER_JOIN_CHAR}{k}": v for k, v in metrics.items()}
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, numbers.Real)}
        # One event, as add_scalar writes each of them; a writer closed by a finalize (a
        # requeue signal's save) has none until add_scalar makes it anew: that way then.
        writer = self.experiment.file_writer
        if scalars and writer is not None:
            values = [Summary.Value(tag=k, simple_value=v) for k, v in scalars.items()]
            writer.add_summary(Summary(value=values), step)
            metrics = {k: v for k, v in metrics.items() if k not in scalars}
        if metrics:
            super().log_metrics(metrics, step)

    @override
    @rank_zero_only
    def finalize(self, status: str) -> None:
        super().finalize(status)
        final, self._final_val = self._final_val, None  # Lightning may finalize twice
        if status == "success" and self.hparams_metric is not None and final is not None:
            params = self.hparams
            flat = flat_hparams(vars(params) if isinstance(params, Namespace) else params)
            write_hparams(Path(self.log_dir), flat, *final, tag=hparam_tag(self.hparams_metric))


def flat_hparams(
    params: Mapping[str, Any], prefix: str = ""
) -> dict[str, float | int | str | bool]:
    """Nested hyperparameters as the flat scalars TensorBoard's HPARAMS view takes:
    ``{"gpt": {"n_layer": 4}}`` becomes ``{"gpt/n_layer": 4}``; anything that is no
    number, string or bool is written as its text."""
    flat: dict[str, float | int | str | bool] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat |= flat_hparams(value, f"{name}/")
        elif isinstance(value, bool | int | float | str):
            flat[name] = value
        else:
            flat[name] = str(value)
    return flat


def write_hparams(
    run_dir: Path,
    params: Mapping[str, float | int | str | bool],
    value: float,
    step: int,
    tag: str,
) -> None:
    """Record a finished run's settings with its final validation ``value`` under ``tag``
    (``hparam_tag`` of the metric), so the HPARAMS view lists the rows of a comparison
    side by side."""
    run_dir = Path(run_dir)
    before = set(run_dir.glob("events.out.tfevents.*"))
    with SummaryWriter(log_dir=str(run_dir)) as writer:
        writer.add_hparams(dict(params), {tag: value}, run_name=".", global_step=step)
    # TensorBoard reads a run's event files in name order, and a run resumed into this
    # directory starts its own file with a purge of the later steps it repeats: read
    # after that, the final metric would be dropped. Files written in the same second
    # differ only in a counter, which sorts as text ("...9" after "...10"): the hparams
    # file takes the newest name with a suffix, so that it is read last.
    if before:
        newest = max(path.name for path in before)
        written = sorted(set(run_dir.glob("events.out.tfevents.*")) - before)
        for index, path in enumerate(written):
            if path.name < newest:
                path.rename(run_dir / f"{newest}.hparams{index}")


def write_summary(
    demo_dir: Path, tables: Mapping[str, str], layout: Mapping[str, Any] | None = None
) -> Path:
    """Write a custom-scalars ``layout`` (TensorBoard's: section -> chart -> ``["Multiline",
    [tag regexes]]``) and ``tables`` (markdown) as text into ``<demo_dir>/summary``;
    returns that directory."""
    summary = demo_dir / "summary"
    with SummaryWriter(log_dir=str(summary)) as writer:
        if layout:
            writer.add_custom_scalars(dict(layout))
        for tag, markdown in tables.items():
            writer.add_text(tag, markdown, global_step=0)
    return summary
