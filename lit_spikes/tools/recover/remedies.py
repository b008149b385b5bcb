"""The ladder's rungs: Lightning callbacks named by class path with their ``init_args``
(``RecoverConfig.ladder``, a YAML list), the arguments each one is built with for a spike,
and the JSON specs the ledger records (``{"class_path", "init_args"}``: the arguments it
was built with, so a restart rebuilds the same callbacks).

A rung's callback learns of the spike through an optional classmethod::

    @classmethod
    def for_spike(cls, spike: SpikeContext, **init_args) -> dict[str, Any]: ...

which returns the keyword arguments to build it with for this spike (the rung's
``init_args`` are its options). A callback without it is built from its ``init_args`` as
given. The built-in remedies get theirs here:

- ``lit_spikes.callbacks.BatchSkipper`` (``before``, ``length``): skip the data positions
  from the spike's minus ``before`` (no earlier than the checkpoint's) for ``length``
  positions (PaLM);
- ``lit_spikes.callbacks.LRScaler`` (``factor``): the LR times ``factor`` (times the
  lineage's last scaler's) from the checkpoint's step on (OPT);
- ``lit_spikes.callbacks.SkipStep`` (``sigma``, ``window``): skip the update of outlier
  steps, its window filled with the lineage's losses (OLMo-core);
- ``lit_spikes.callbacks.ClipGradients`` (``value``): clip the gradient norm (at the
  lineage's lowest value so far).

A new rung replaces an inherited remedy of its class (``SkipStep``, clipping, a user's
callback), except the two whose state key differs by their arguments: LR scalers and skip
windows accumulate.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lightning.pytorch.callbacks import Callback

from lit_spikes.callbacks import BatchSkipper, LRScaler, SkipStep, Spike
from lit_spikes.callbacks.clip import ClipGradients
from lit_spikes.tools.factories import ClassPath


@dataclass(frozen=True)
class SpikeContext:
    """What a rung's ``for_spike`` knows of the spike it is tried for."""

    spike: Spike
    """``step``, ``metric``, ``value``, ``reference``, ``position`` (its data position)."""
    ckpt_step: int
    """Global step of the checkpoint the branch starts from (its first step)."""
    ckpt_position: int
    """Data position of that step on the lineage (skip windows start no earlier)."""
    losses: list[float] = field(default_factory=list)
    """The lineage's finite per-step losses before ``ckpt_step``, oldest first."""
    inherited: list[dict[str, Any]] = field(default_factory=list)
    """The lineage's active remedies (specs), oldest first."""

    def inherited_args(self, klass: type) -> list[dict[str, Any]]:
        """The ``init_args`` of the inherited remedies of class ``klass``."""
        return [
            dict(spec["init_args"])
            for spec in self.inherited
            if ClassPath.of(spec, "remedy").klass(Callback, "remedy") is klass
        ]


def _skip_data(context: SpikeContext, before: int, length: int) -> dict[str, Any]:
    position = context.spike.position
    start = max(
        context.ckpt_position, (context.spike.step if position is None else position) - before
    )
    return {"ranges": [[start, start + length]]}


def _scale_lr(context: SpikeContext, factor: float) -> dict[str, Any]:
    current = [args["factor"] for args in context.inherited_args(LRScaler)]
    return {"factor": (current[-1] if current else 1.0) * factor, "start_step": context.ckpt_step}


def _skip_step(context: SpikeContext, sigma: float, window: int) -> dict[str, Any]:
    return {
        "window": window,
        "sigma": sigma,
        "warmup": min(10, window),  # the window starts filled
        "start_step": context.ckpt_step,
        "initial": context.losses[-window:],
    }


def _clip(context: SpikeContext, value: float) -> dict[str, Any]:
    clips = [args["value"] for args in context.inherited_args(ClipGradients)]
    return {"value": min([value, *clips])}


@dataclass(frozen=True)
class _Builtin:
    name: str
    """Its branches' name (``spike<n>/<name>``)."""
    build: Callable[..., dict[str, Any]]
    options: dict[str, Any]
    """Its ``init_args`` in the ladder, with their defaults."""
    check: Callable[[dict[str, Any]], str | None]
    """What is wrong with the options (None: nothing)."""


def _check_skip(o: dict[str, Any]) -> str | None:
    ok = _int(o["before"]) and o["before"] >= 0 and _int(o["length"]) and o["length"] >= 1
    return None if ok else "before must be an integer >= 0 and length one >= 1"


def _check_lr(o: dict[str, Any]) -> str | None:
    return None if _number(o["factor"]) and 0 < o["factor"] < 1 else "factor must be in (0, 1)"


def _check_skip_step(o: dict[str, Any]) -> str | None:
    ok = _number(o["sigma"]) and o["sigma"] > 0 and _int(o["window"]) and o["window"] >= 2
    return None if ok else "sigma must be > 0 and window an integer >= 2"


def _check_clip(o: dict[str, Any]) -> str | None:
    return None if _number(o["value"]) and o["value"] > 0 else "value must be > 0"


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


BUILTIN: dict[type, _Builtin] = {
    BatchSkipper: _Builtin("skip_data", _skip_data, {"before": 5, "length": 30}, _check_skip),
    LRScaler: _Builtin("scale_lr", _scale_lr, {"factor": 0.5}, _check_lr),
    SkipStep: _Builtin("skip_step", _skip_step, {"sigma": 6.0, "window": 50}, _check_skip_step),
    ClipGradients: _Builtin("clip", _clip, {"value": 1.0}, _check_clip),
}
ACCUMULATE = (BatchSkipper, LRScaler)
"""Remedies a new rung of the same class adds to rather than replaces."""
DEFAULT_LADDER: tuple[dict[str, Any], ...] = (
    {"class_path": "lit_spikes.callbacks.BatchSkipper", "init_args": {"before": 5, "length": 30}},
    {"class_path": "lit_spikes.callbacks.LRScaler", "init_args": {"factor": 0.5}},
    {"class_path": "lit_spikes.callbacks.SkipStep", "init_args": {"sigma": 6.0, "window": 50}},
    {"class_path": "lit_spikes.callbacks.ClipGradients", "init_args": {"value": 1.0}},
)
"""The default ladder: skip data, scale the LR, skip steps, clip."""
_RETIRED = {
    b.name: path["class_path"] for b, path in zip(BUILTIN.values(), DEFAULT_LADDER, strict=True)
}


def _klass(rung: Mapping[str, Any]) -> type:
    return ClassPath.of(rung, "ladder").klass(Callback, "ladder")


def check_rung(value: Any) -> dict[str, Any]:
    """A rung as plain ``{"class_path", "init_args"}``: its class imported and checked to
    be a Callback, a built-in's options filled in with their defaults and checked.

    Raises:
        ValueError: a bad class path, a retired name (``scale_lr``: the class path it now
            is), or options a built-in remedy refuses (named).
    """
    if isinstance(value, str) and value in _RETIRED:
        raise ValueError(
            f"ladder: {value!r} is now named by its class: {_RETIRED[value]!r} (see "
            "configs/recover.yaml)"
        )
    rung = ClassPath.of(value, "ladder").to_dict()
    builtin = BUILTIN.get(_klass(rung))
    if builtin is not None:
        unknown = sorted(set(rung["init_args"]) - set(builtin.options))
        if unknown:
            raise ValueError(
                f"ladder: {rung['class_path']} takes the options {sorted(builtin.options)}, "
                f"not {unknown}"
            )
        rung["init_args"] = {**builtin.options, **rung["init_args"]}
        problem = builtin.check(rung["init_args"])
        if problem:
            raise ValueError(f"ladder: {rung['class_path']} {rung['init_args']}: {problem}")
    return rung


def rung_name(rung: Mapping[str, Any]) -> str:
    """The rung's branches' name: a built-in's short one, else its class's name."""
    klass = _klass(rung)
    builtin = BUILTIN.get(klass)
    return builtin.name if builtin is not None else klass.__name__


def remedy_spec(rung: Mapping[str, Any], context: SpikeContext) -> dict[str, Any]:
    """The spec (class path and the ``init_args`` it is built with) of ``rung`` for this
    spike."""
    klass = _klass(rung)
    options = dict(rung.get("init_args") or {})
    builtin = BUILTIN.get(klass)
    if builtin is not None:
        init_args = builtin.build(context, **options)
    elif callable(getattr(klass, "for_spike", None)):
        init_args = dict(klass.for_spike(context, **options))  # type: ignore[attr-defined]
    else:
        init_args = options
    return {"class_path": rung["class_path"], "init_args": init_args}


def lineage_remedies(inherited: Sequence[dict[str, Any]], spec: dict[str, Any]) -> list[Any]:
    """The remedies of a new branch: the inherited ones (less those of ``spec``'s class,
    unless it accumulates), then ``spec``."""
    klass = _klass(spec)
    keep = [r for r in inherited if klass in ACCUMULATE or _klass(r) is not klass]
    return [*keep, spec]


def remedy_callbacks(specs: Sequence[dict[str, Any]]) -> list[Callback]:
    """The callbacks of a lineage's remedies (specs)."""
    return [ClassPath.of(spec, "remedy").build(Callback, "remedy") for spec in specs]


def describe_remedy(spec: Mapping[str, Any]) -> str:
    """The remedy as a person reads it (``skip data 142-171``, ``LR x0.5 from step 100``)."""
    klass, args = _klass(spec), spec["init_args"]
    if klass is BatchSkipper:
        return ", ".join(f"skip data {a}-{b - 1}" for a, b in args["ranges"])
    if klass is LRScaler:
        return f"LR x{args['factor']:g} from step {args['start_step']}"
    if klass is SkipStep:
        return f"skip-step ({args['sigma']:g} sigma) from step {args['start_step']}"
    if klass is ClipGradients:
        return f"clip grad norm at {args['value']:g}"
    shown = ", ".join(f"{k}={v!r}" for k, v in args.items())
    return f"{klass.__name__}({shown})"
