"""``diagnose``: the replays a spike's question calls for, in order, and the verdict
``verdict_cause`` draws from their numbers, with the evidence that explains it."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lit_spikes.callbacks.exact_resume import clipping_from_checkpoint, saved_fingerprint
from lit_spikes.callbacks.fingerprint import software_fingerprint
from lit_spikes.shared.plain import flat_config, plain_config
from lit_spikes.shared.training import CHECKPOINT_DIRNAME
from lit_spikes.tool_facts import facts_of
from lit_spikes.tools.diagnose import explain
from lit_spikes.tools.diagnose.config import DiagnoseConfig
from lit_spikes.tools.diagnose.replay import (
    LOSS_TAGS,
    CheckpointReads,
    Judge,
    Replayer,
    judge_of,
    logged_curve,
)
from lit_spikes.tools.diagnose.subject import (
    CallbacksSource,
    DataSource,
    ModelSource,
    run_config,
    subject_of,
)
from lit_spikes.tools.diagnose.verdict import (
    Replay,
    Verdict,
    cause_from_same_data,
    judged,
    verdict_cause,
)


def diagnose(
    ckpt_path: str | Path,
    spike_step: int,
    config: DiagnoseConfig | None = None,
    *,
    model: ModelSource | None = None,
    data: DataSource | None = None,
    callbacks: CallbacksSource | None = None,
    trainer_kwargs: dict[str, Any] | None = None,
    original_loss: float | None = None,
    earlier_ckpt: str | Path | None = None,
    log_root: str | Path | None = None,
    reads: CheckpointReads | None = None,
) -> Verdict:
    """Replay a spike from a checkpoint before it and say what caused it.

    Args:
        ckpt_path: a Lightning checkpoint of the run, written before ``spike_step``.
        spike_step: global step of the spike's onset.
        config: replay lengths, the other-data window, the detector (None: the run's,
            from the checkpoint's record), the loss's tag, ExactResume and the seed.
        model: the run's LightningModule: a factory (called once per replay) or a class
            path, ``{"class_path", "init_args"}`` or ``ClassPath`` (None: the run's
            ``config.yaml``'s, else the demo's, built as its ``load_from_checkpoint``
            builds it from the file: ``subject.from_file``).
        data: a factory of the run's LightningDataModule (or of None: the module's own
            dataloaders) or a class path (None: the run's ``config.yaml``'s, else the
            demo's for the demo's module); a class with a ``load_from_checkpoint`` of its
            own (the demo's) is built by it from the file.
            Replay (b) skips data positions: a ``StepLoader`` or ``PositionedData``.
        callbacks: the run's callbacks, a list (copied for each replay) or a factory
            (None: rebuilt as a ``lit-spikes fit`` resume does; ``subject``).
        trainer_kwargs: other Trainer arguments of the run, over those its
            ``config.yaml`` records (``REPLAYED_TRAINER``: precision, accumulation,
            validation interval and batches, clipping, ...) and the checkpoint's gradient
            clipping; ``gradient_clip_val`` sets another, 0 none.
        original_loss: the loss the run logged at ``spike_step`` (None: from the run's
            TensorBoard events, ``<ckpt>/../..``, under ``config.loss_tag``).
        earlier_ckpt: a checkpoint before ``ckpt_path`` for replay (c), trained with the
            remedies ``ckpt_path`` holds (a recover branch's parent's file, too).
        log_root: where the replays' TensorBoard runs go (None: a temporary directory).
        reads: the files already read (the CLI's); each file is read once.

    Raises:
        CheckpointError: a checkpoint that cannot be resumed from.
        ValueError: a spike or earlier file not after/before the checkpoint, a spike at or
            past the run's end, a bad class.
    """
    config = config or DiagnoseConfig()
    reads = reads or CheckpointReads()
    sources = Sources(model, data, callbacks, trainer_kwargs, original_loss)
    with tempfile.TemporaryDirectory(prefix="lit-spikes-diagnose-") as temp:
        root = Path(log_root) if log_root is not None else Path(temp)
        prepared = prepare(ckpt_path, spike_step, config, sources, reads, root, earlier_ckpt)
        replayer = prepared.replayer
        earlier = Path(earlier_ckpt) if earlier_ckpt is not None else None
        verdict = _replay_and_judge(replayer, Path(ckpt_path), earlier, replayer.original)
    # After replay (a)'s line, which stays the first
    notes = _notes(replayer.judge, prepared.tag, spike_step + config.horizon + 1, prepared.end)
    verdict.evidence[1:1] = notes
    verdict.columns = replayer.columns
    return verdict


@dataclass(frozen=True)
class Sources:
    """What a replay trains, where the run's own record is not taken (``diagnose``'s
    arguments of the same names)."""

    model: ModelSource | None = None
    data: DataSource | None = None
    callbacks: CallbacksSource | None = None
    trainer_kwargs: dict[str, Any] | None = None
    original_loss: float | None = None


@dataclass
class Prepared:
    """A spike's replayer, built from its checkpoint and run, and how it was built."""

    replayer: Replayer
    tag: str | None
    """The TensorBoard tag the original loss was read from (None: given, or not found)."""
    end: tuple[int, str] | None
    """The run's end and what says so (``run_end``)."""


def prepare(
    ckpt_path: str | Path,
    spike_step: int,
    config: DiagnoseConfig,
    sources: Sources,
    reads: CheckpointReads,
    log_root: Path,
    earlier_ckpt: str | Path | None = None,
) -> Prepared:
    """The files checked and a ``Replayer`` of the spike: the run's module, data,
    callbacks and Trainer settings, its judge, its end and its logged loss (``diagnose``
    and the forensics replay build theirs here).

    Raises:
        CheckpointError, ValueError: as ``diagnose``.
    """
    ckpt_path = Path(ckpt_path)
    checkpoint = reads(ckpt_path)
    _check_files(reads, ckpt_path, spike_step, earlier_ckpt)
    end = _end_after(ckpt_path, checkpoint, spike_step)
    subject = subject_of(ckpt_path, checkpoint, sources.model, sources.data, sources.callbacks)
    facts = facts_of(subject.model())  # one module, built to be read
    judge = judge_of(config.detector, checkpoint, lambda: facts)
    trainer_kwargs = _replayed_trainer(ckpt_path, checkpoint, sources.trainer_kwargs)
    tags = _loss_tags(config, judge)
    original, tag = sources.original_loss, None
    if original is None:
        original, tag = _logged_original(ckpt_path, spike_step, tags)
    replayer = Replayer(spike_step, subject, trainer_kwargs, original, config, log_root, reads)
    replayer.judge, replayer.end_step = judge, None if end is None else end[0]
    replayer.columns = facts.columns
    replayer.incomparable = _incomparable(checkpoint)
    replayer.logged = logged_curve(ckpt_path.parent.parent, tags)[1]
    return Prepared(replayer, tag, end)


def _end_after(
    ckpt_path: Path, checkpoint: dict[str, Any], spike_step: int
) -> tuple[int, str] | None:
    """The run's end (``run_end``), checked to come after ``spike_step``."""
    end = run_end(ckpt_path, checkpoint)
    if end is not None and spike_step >= end[0]:
        raise ValueError(
            f"spike_step={spike_step} is past the run's end: it trains steps up to "
            f"{end[0] - 1} ({end[1]}); give a step of the run"
        )
    return end


def _replayed_trainer(
    ckpt_path: Path, checkpoint: dict[str, Any], given: dict[str, Any] | None
) -> dict[str, Any]:
    """The Trainer arguments the replays run with: the run's recorded ones, ``given`` over
    them, and the checkpoint's gradient clipping unless ``given`` sets it."""
    trainer_kwargs = {**recorded_trainer(ckpt_path), **(given or {})}
    if "gradient_clip_val" not in trainer_kwargs:
        trainer_kwargs |= clipping_from_checkpoint(checkpoint)
    return trainer_kwargs


def _notes(
    judge: Judge, tag: str | None, replayed_to: int, end: tuple[int, str] | None
) -> list[str]:
    """The verdict's notes on how it was judged and how far the replays went."""
    notes = [f"Judged by {judge.source}."]
    if tag is not None:
        notes.append(f"The original loss is the run's TensorBoard tag {tag!r}.")
    if end is not None and end[0] < replayed_to:
        notes.append(f"Replays end at step {end[0]}, the run's end ({end[1]}), not {replayed_to}.")
    return notes


def _loss_tags(config: DiagnoseConfig, judge: Judge) -> tuple[str, ...]:
    """The TensorBoard tags the run's loss may be under: the configured one, else
    ``train/loss``, the judging detector's monitored names (the run's), then the common
    names of a training loss (``LOSS_TAGS``)."""
    if config.loss_tag is not None:
        return (config.loss_tag,)
    watched = [name for name in judge.monitors if name != "grad_norm"]
    return tuple(dict.fromkeys([LOSS_TAGS[0], *watched, *LOSS_TAGS[1:]]))


def _ledger_steps(ckpt_path: Path) -> int | None:
    """The steps of the recover run whose branch wrote ``ckpt_path`` (its ledger's
    config, ``<log_root>/ledger.json``, ``<log_root>/<branch>/checkpoints/<file>``, a
    branch's name of one or two folders); None where none is found.

    Raises:
        LedgerUnreadable: the ledger names a class whose code lit-spikes does not import
            (``import_guard``): a file the user did not name.
    """
    from lit_spikes.tools.recover.config import RecoverConfig  # the ledger's own reading
    from lit_spikes.tools.recover.ledger import LEDGER_NAME, refuse_foreign_classes

    resolved = ckpt_path.resolve()
    if resolved.parent.name != CHECKPOINT_DIRNAME:
        return None  # no branch of a recover run: its ledger is not looked for
    for root in list(resolved.parents)[2:4]:
        try:
            saved = json.loads((root / LEDGER_NAME).read_text())["config"]
        except (OSError, ValueError, TypeError, KeyError):
            continue
        refuse_foreign_classes(saved, root / LEDGER_NAME)
        try:
            return RecoverConfig.from_dict({**saved, "log_root": str(root)}).steps
        except (ValueError, TypeError, KeyError):
            continue
    return None


REPLAYED_TRAINER = (
    "precision", "accumulate_grad_batches", "gradient_clip_val", "gradient_clip_algorithm",
    "val_check_interval", "check_val_every_n_epoch", "limit_val_batches", "deterministic",
    "overfit_batches", "limit_train_batches",
)  # fmt: skip
"""The Trainer settings of the run's record a replay trains with: what decides its steps
and its validations (which may steer training: EarlyStopping, a plateau's LR)."""


def recorded_trainer(ckpt_path: Path) -> dict[str, Any]:
    """``REPLAYED_TRAINER``'s settings in the ``config.yaml`` of the checkpoint's run
    (``{}`` where there is none: a replay then validates nothing)."""
    trainer = run_config(ckpt_path).get("trainer")
    if not isinstance(trainer, dict):
        return {}
    return {k: trainer[k] for k in REPLAYED_TRAINER if trainer.get(k) is not None}


def run_end(ckpt_path: Path, checkpoint: dict[str, Any]) -> tuple[int, str] | None:
    """The global step at which the checkpoint's run ends, and what says so: its
    ``config.yaml``'s ``trainer.max_steps`` (lit-spikes fit), its recover ledger's steps, or
    an LR scheduler that counts its steps (``OneCycleLR``'s ``total_steps``, which raises
    a step later; stepped once per step); the earliest of them. None: none says."""
    ends: list[tuple[int, str]] = []
    trainer = run_config(ckpt_path).get("trainer")
    steps = trainer.get("max_steps") if isinstance(trainer, dict) else None
    if isinstance(steps, int) and not isinstance(steps, bool) and steps > 0:
        ends.append((steps, f"its config.yaml's trainer.max_steps={steps}"))
    ledger = _ledger_steps(ckpt_path)
    if ledger is not None:
        ends.append((ledger, f"its recover ledger's max_steps={ledger}"))
    k = int(checkpoint["global_step"])
    for state in checkpoint.get("lr_schedulers") or []:
        total = state.get("total_steps") if isinstance(state, dict) else None
        last = state.get("last_epoch") if isinstance(state, dict) else None
        if isinstance(total, int) and isinstance(last, int):
            ends.append((k + total - last, f"its LR scheduler's total_steps={total}"))
    return min(ends) if ends else None


def _check_files(
    reads: CheckpointReads, ckpt_path: Path, spike_step: int, earlier_ckpt: str | Path | None
) -> None:
    """The spike after the checkpoint, the earlier file before it and of the same run.

    Raises:
        ValueError: naming the file and the steps.
    """
    k = int(reads(ckpt_path)["global_step"])
    if not k < spike_step:
        raise ValueError(
            f"spike_step={spike_step} must be after the checkpoint's step {k} ({ckpt_path})"
        )
    if earlier_ckpt is not None:
        earlier_step = int(reads(earlier_ckpt)["global_step"])
        if earlier_step >= k:
            raise ValueError(
                f"earlier_ckpt={earlier_ckpt} is at step {earlier_step}, not before the "
                f"checkpoint's step {k}"
            )
        _refuse_another_run(ckpt_path, reads(ckpt_path), Path(earlier_ckpt), reads)


def _logged_original(
    ckpt_path: Path, spike_step: int, tags: tuple[str, ...]
) -> tuple[float | None, str | None]:
    """The loss the checkpoint's run logged at ``spike_step`` (its TensorBoard events,
    under the first of ``tags`` they hold), and that tag.

    Raises:
        ValueError: a step past the run's last logged one (a typo, most likely).
    """
    tag, logged = logged_curve(ckpt_path.parent.parent, tags)
    if logged and spike_step > max(logged):
        # a typo (1470 for 147) would replay a thousand steps, then find no spike
        raise ValueError(
            f"spike_step={spike_step} is past the last step the checkpoint's run logged "
            f"({max(logged)}): give a step of that run (or its loss, --spike_loss, for a "
            "step it did not log)"
        )
    value = logged.get(spike_step)
    return value, tag if value is not None else None


def _incomparable(checkpoint: dict[str, Any]) -> str | None:
    """Why a replay in this process cannot reproduce the checkpoint's run to the bit
    (None: it can)."""
    saved = saved_fingerprint(checkpoint)
    here = software_fingerprint()
    differ = [
        f"{key} {saved[key]!r} there, {value!r} here"
        for key, value in here.items()
        if key in saved and saved[key] != value
    ]
    if int(saved.get("world_size", 1)) > 1:
        differ.append(
            f"the run trained on {saved['world_size']} processes: its logged loss is rank 0's "
            "rows', a replay's the whole batch's"
        )
    return "; ".join(differ) or None


def _refuse_another_run(
    ckpt_path: Path, checkpoint: dict[str, Any], earlier: Path, reads: CheckpointReads
) -> None:
    """An earlier checkpoint of another run (another model, optimizer or seeds) cannot
    replay this one's history: its replay would differ and blame the later state.

    Raises:
        ValueError: naming the settings that differ.
    """
    mine = flat_config(plain_config(checkpoint.get("hyper_parameters", {})))
    theirs = flat_config(plain_config(reads(earlier).get("hyper_parameters", {})))
    differ = [
        f"{key}: {theirs[key]!r} there, {mine[key]!r} here"
        for key in sorted(mine.keys() & theirs.keys())  # a key newer code added is no difference
        if mine[key] != theirs[key] and key not in ("num_threads", "flush_denormal")
    ]
    if differ:
        raise ValueError(
            f"earlier_ckpt={earlier} is not of the run of {ckpt_path} ({'; '.join(differ)}): "
            "give an earlier checkpoint of the same run (or of its recover branch's parent)"
        )


def first_difference(
    records: dict[int, dict[str, float]], logged: dict[int, float], spike_step: int, steps: int = 3
) -> tuple[int, float, float] | None:
    """The first of a replay's first ``steps`` steps (before the spike) whose loss is not
    the run's logged one to the bit: (step, logged, replayed); None where they match or
    the run logged none of them."""
    for step in sorted(s for s in records if s < spike_step)[:steps]:
        if step in logged and float(records[step]["loss"]) != logged[step]:
            return step, logged[step], float(records[step]["loss"])
    return None


def _replay_and_judge(
    replayer: Replayer, ckpt_path: Path, earlier_ckpt: Path | None, original: float | None
) -> Verdict:
    """Replay (a); where it leaves the question open, (b) and (c); then the verdict."""
    spike_step, config = replayer.spike_step, replayer.config
    same, records = replayer.run("replay_same_data", ckpt_path)
    k = same.ckpt_step
    if replayer.drew_without_states:
        replayer.incomparable = "; ".join(filter(None, [replayer.incomparable, explain.NO_RNG]))
        same.bit_equal = None if same.bit_equal is False else same.bit_equal
    evidence = [explain.same_data_line(spike_step, same, original, replayer.incomparable)]
    decided = cause_from_same_data(spike_step, same)
    if decided is not None:
        differs = first_difference(records, replayer.logged, spike_step)
        if decided == "no-spike":
            evidence.append(explain.no_spike_line(spike_step, same, original))
        elif differs is not None and replayer.incomparable is None:
            evidence.append(explain.not_the_run(*differs, replayer.settings(), replayer.unlike))
        else:
            evidence.append(explain.NOT_REPRODUCED)
        return Verdict(decided, spike_step, k, str(ckpt_path), original, same, [], None, evidence)
    position = int(records[spike_step]["position"])
    first = int(records[k]["position"]) if k in records else k
    others = []
    for index, window in enumerate(other_windows(first, position, config)):
        label = "replay_other_data" + (f"_{index + 1}" if index else "")
        other, _ = replayer.run(label, ckpt_path, window)
        other.judgement = judged(same, other, config.recurrence)
        others.append(other)
    earlier: Replay | None = None
    if earlier_ckpt is not None:
        # Against the run's own full loss where one is known to the bit; else (none given,
        # or one given rounded) the same-data replay's, which matched it
        replayer.original = original if same.bit_equal else same.loss_at_spike
        replayer.incomparable = None  # (c) is held against a replay of this process
        # The run's remedies are the later file's: an earlier one may be the parent's, from
        # before a recover branch started with them (its skip set, its LR scale).
        earlier, _ = replayer.run("replay_earlier_ckpt", earlier_ckpt, remedies_of=ckpt_path)
        if replayer.drew_without_states and earlier.bit_equal is False:
            earlier.bit_equal = None  # other draws than the later file's replay: no evidence
    evidence += explain.other_data_lines(spike_step, same, others, position, config)
    if earlier is not None:
        evidence += explain.earlier_lines(spike_step, same, earlier)
    cause = verdict_cause(spike_step, same, others, earlier, config.recurrence)
    if cause in explain.READINGS:
        evidence.append(explain.READINGS[cause])
    return Verdict(cause, spike_step, k, str(ckpt_path), original, same, others, earlier, evidence)


def other_windows(first: int, position: int, config: DiagnoseConfig) -> list[tuple[int, int]]:
    """The data positions each other-data replay skips (half-open): from ``window_before``
    before the spike's ``position`` (not before the checkpoint's ``first``) to
    ``window_after`` past it, each further window a window's length longer, so that
    another stretch of data trains the spike's step in each."""
    start = max(first, position - config.window_before)
    end = position + config.window_after + 1
    length = end - start
    return [(start, end + index * length) for index in range(config.windows)]
