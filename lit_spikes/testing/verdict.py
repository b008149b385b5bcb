"""The first divergence between two records, decided by pure functions (no training), and
the table and message that report it."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from lit_spikes.testing.record import (
    CALLBACKS,
    DATA,
    LOOPS,
    MODULE,
    OPTIMIZER,
    PARAMETERS,
    PRECISION,
    RNG,
    SCHEDULER,
    Record,
    Snapshot,
)

COMPONENTS = (DATA, PARAMETERS, SCHEDULER, OPTIMIZER, PRECISION, CALLBACKS, LOOPS, RNG, MODULE)
"""Every component, in the order that decides between divergences at the same step: the
cause before what follows from it (a scheduler sets the optimizer's learning rate; the
step's output, under "module state", follows from all the others)."""

FIXES = {
    DATA: "the batches after the resume are not the uninterrupted run's: use StepLoader "
    "(from lit_spikes import StepLoader) or a stateful sampler or loader (state_dict / "
    "load_state_dict, e.g. torchdata's StatefulDataLoader) so that the checkpoint holds the "
    "data's position",
    PARAMETERS: "the weights after the resume are not the checkpoint's: something changes them "
    "after Lightning loads them (a re-initialisation in setup, configure_model or "
    "on_train_start); leave the loaded weights as they are",
    OPTIMIZER: "the optimizer's state after the resume is not the checkpoint's: something "
    "resets or rebuilds the optimizer after Lightning restores it (on_train_start, "
    "on_fit_start, an optimizer made outside configure_optimizers); leave it as restored",
    SCHEDULER: "the learning rate after the resume is not the uninterrupted run's: return "
    "every LR scheduler from configure_optimizers (with 'interval': 'step') instead of "
    "stepping one by hand or computing the LR from a counter the checkpoint lacks",
    PRECISION: "the precision plugin's state (the grad scaler's scale and growth tracker) is "
    "not restored: use Lightning's precision='16-mixed' rather than a GradScaler of your own, "
    "or save yours in on_save_checkpoint and restore it in on_load_checkpoint",
    CALLBACKS: "a callback's state is not restored: give it state_dict() / load_state_dict()",
    MODULE: "the step's output differs though its batch, RNG streams, learning rate and the "
    "state entering the resume step are the same: state that no checkpoint holds changes "
    "the computation (an attribute of an object the module holds), or an op is not "
    "deterministic (Trainer(deterministic=True))",
    LOOPS: "Lightning's loop counters after the resume are not the uninterrupted run's: keep "
    "the data's length, accumulate_grad_batches and max_epochs the same for both halves",
    RNG: "add ExactResume (from lit_spikes.callbacks import ExactResume) to the Trainer's "
    "callbacks: Lightning does not save the RNG streams, so the randomness after the resume "
    "(dropout, sampling, shuffling, a torch.Generator the module holds) is not the "
    "uninterrupted run's",
}

GENERATOR_FIX = (
    "{item} draws otherwise after the resume: add ExactResume (from lit_spikes.callbacks "
    "import ExactResume), which keys every generator a module holds by the step (a torch "
    "or NumPy Generator, a RandomState, a random.Random; an attribute, in a list, tuple or "
    "dict, or on a plain object the module holds); with it, make the generator in "
    "__init__ or setup, not in a step (one made later draws unkeyed until it is found)"
)
"""The fix for a generator of the module's whose stream differs (check-resume names it)."""

NOT_REPRODUCIBLE = (
    "the run is not reproducible even without a resume (the interrupted run's first half "
    "already differs from the uninterrupted run): build everything from the seed inside the "
    "factories, share no state between runs, and use deterministic ops "
    "(Trainer(deterministic=True)); then: "
)

_FIELD_COMPONENTS = {"data": DATA, "loop": LOOPS, "rng": RNG, "lr": SCHEDULER, "output": MODULE}
_FIELD_OWNERS = {
    "data": "the batch",
    "loop": "Trainer (per step)",
    "rng": "RNG streams",
    "lr": "learning rate",
    "output": "training_step's output",
}
_FIELD_ORDER = {"data": 0, "loop": 0, "rng": 0, "lr": 1, "output": 2}


@dataclass(frozen=True)
class Divergence:
    """Where two runs first differ: ``component`` (one of COMPONENTS), ``owner`` (what
    holds the state), ``item`` (the tensor or key), at global step ``step``."""

    step: int
    component: str
    owner: str
    item: str
    uninterrupted: Any
    resumed: Any
    fix: str
    when: str

    def describe(self) -> str:
        values = describe_values(self.uninterrupted, self.resumed)
        return (
            f"{self.component}: {self.owner}, {self.item} {self.when} "
            f"(uninterrupted {values[0]}, resumed {values[1]})"
        )


@dataclass
class Report:
    """The check's verdict: ``first`` is None when the resume is exact."""

    steps: int
    resume_at: int
    new_process: bool
    first: Divergence | None
    per_component: dict[str, Divergence | None] = field(default_factory=dict)

    @property
    def exact(self) -> bool:
        return self.first is None


def same(a: Any, b: Any) -> bool:
    """Bit-for-bit equality of two recorded values (``torch.equal`` for tensors)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    return type(a) is type(b) and bool(a == b)


def describe_values(a: Any, b: Any) -> tuple[str, str]:
    """Short texts for two differing values: a tensor's first differing element."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"{a.dtype}{list(a.shape)}", f"{b.dtype}{list(b.shape)}"
        index = int(torch.nonzero(a.reshape(-1) != b.reshape(-1))[0].item()) if a.numel() else 0
        at = f"element {index} of {list(a.shape)}"
        return f"{at} = {a.reshape(-1)[index].item()!r}", f"{b.reshape(-1)[index].item()!r}"
    return _short(a), _short(b)


def _short(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"tensor {value.dtype}{list(value.shape)}"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _snapshot_diffs(reference: Snapshot, resumed: Snapshot) -> Iterator[tuple[Any, ...]]:
    """(component, owner, item, uninterrupted value, resumed value) per differing leaf."""
    for component in COMPONENTS:
        ref_owners, res_owners = reference.get(component, {}), resumed.get(component, {})
        for owner in [*ref_owners, *(o for o in res_owners if o not in ref_owners)]:
            if owner not in res_owners or owner not in ref_owners:
                present = ("present", "absent") if owner in ref_owners else ("absent", "present")
                yield component, owner, "(all of it)", *present
                continue
            a, b = ref_owners[owner], res_owners[owner]
            for item in [*a, *(k for k in b if k not in a)]:
                if item not in a or item not in b or not same(a[item], b[item]):
                    yield component, owner, item, a.get(item, "absent"), b.get(item, "absent")


def _step_diffs(reference: Record, other: Record, steps: range) -> Iterator[tuple[Any, ...]]:
    """(step, order in the step, component, owner, item, a, b) per differing digest."""
    for step in steps:
        a, b = reference.steps.get(step), other.steps.get(step)
        if a is None or b is None:
            if a is not None or b is not None:
                ran = ("ran", "did not run") if a is not None else ("did not run", "ran")
                yield step, 0, LOOPS, "Trainer (per step)", f"step {step}", *ran
            continue
        for name in [*a, *(k for k in b if k not in a)]:
            kind, _, item = name.partition(".")
            if name not in a or name not in b or not same(a[name], b[name]):
                owner = _FIELD_OWNERS[kind]
                label = item or ("its tensors' digest" if kind in ("data", "output") else name)
                yield (
                    step,
                    _FIELD_ORDER[kind],
                    _FIELD_COMPONENTS[kind],
                    owner,
                    label,
                    *(
                        a.get(name, "absent"),
                        b.get(name, "absent"),
                    ),
                )


def _fix(component: str, item: str) -> str:
    if component == RNG and item.endswith(" of the module"):
        return GENERATOR_FIX.format(item=f"the module's {item.removesuffix(' of the module')}")
    return FIXES[component]


def compare(
    reference: Record,
    resumed: Record,
    *,
    steps: int,
    resume_at: int,
    first_half: Record | None = None,
    new_process: bool = False,
) -> Report:
    """The first divergence of ``resumed`` from the uninterrupted ``reference`` (and of the
    interrupted run's ``first_half`` before ``resume_at``, which no resume can explain)."""
    hints = {**reference.hints, **resumed.hints}
    found: list[tuple[tuple[int, int, int], Divergence]] = []

    def add(step: int, order: int, parts: tuple[Any, ...], when: str, prefix: str = "") -> None:
        component, owner, item, a, b = parts
        fix = prefix + hints.get(owner, _fix(component, item))
        divergence = Divergence(step, component, owner, item, a, b, fix, when)
        found.append(((step, COMPONENTS.index(component), order), divergence))

    if first_half is not None:
        for diff in _step_diffs(reference, first_half, range(resume_at)):
            when = f"at step {diff[0]}, before any resume"
            add(diff[0], diff[1], diff[2:], when, NOT_REPRODUCIBLE)
    last = max([steps, *reference.steps, *resumed.steps]) + 1
    for diff in _step_diffs(reference, resumed, range(resume_at, last)):
        add(diff[0], diff[1], diff[2:], f"at step {diff[0]}")
    if reference.at_resume is not None and resumed.at_resume is not None:
        for parts in _snapshot_diffs(reference.at_resume, resumed.at_resume):
            add(resume_at, -1, parts, f"entering step {resume_at}")
    if reference.final is not None and resumed.final is not None:
        end = reference.final_step
        for parts in _snapshot_diffs(reference.final, resumed.final):
            add(end, 3, parts, f"at the end (step {end})")
    found.sort(key=lambda pair: pair[0])
    per_component: dict[str, Divergence | None] = dict.fromkeys(COMPONENTS)
    for _, divergence in found:
        if per_component[divergence.component] is None:
            per_component[divergence.component] = divergence
    first = found[0][1] if found else None
    return Report(steps, resume_at, new_process, first, per_component)


def format_table(report: Report) -> str:
    """One line per component: same, or where it first differs."""
    width = max(len(c) for c in COMPONENTS) + 2
    lines = [f"{'component':<{width}}result"]
    for component, divergence in report.per_component.items():
        if divergence is None:
            result = "same"
        else:
            result = f"differs {divergence.when}: {divergence.owner}, {divergence.item}"
        lines.append(f"{component:<{width}}{result}")
    return "\n".join(lines)


def format_report(report: Report) -> str:
    """The verdict, the table, the first divergence and its likely fix."""
    how = "in a new process" if report.new_process else "in the same process"
    head = (
        f"resume check: {report.steps} steps uninterrupted vs. interrupted at step "
        f"{report.resume_at} and resumed from its .ckpt {how}"
    )
    if report.first is None:
        return f"{head}\n{format_table(report)}\nthe resume is exact: every component is the same"
    first = report.first
    text = (
        f"{head}\n{format_table(report)}\n"
        f"the resume is not exact; first divergence: {first.describe()}\n"
        f"likely fix: {first.fix}"
    )
    consequences = (PARAMETERS, OPTIMIZER, MODULE)
    if first.component == RNG and all(report.per_component[c] is None for c in consequences):
        text += (
            "\nnote: nothing in this run drew from the RNG streams after the resume (its "
            "weights and outputs are the same), but what does (dropout, sampling, a sampler "
            "seeded from the global RNG) would diverge"
        )
    return text
