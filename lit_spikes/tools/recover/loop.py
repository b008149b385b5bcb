"""The recovery loop itself: plan the next branch from the ledger, train it, conclude it,
until the run is done. Its whole state is the ledger, rewritten after every event, so a
loop started again with the same arguments goes on where the last one stopped."""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from rich.console import Console
from rich.markup import escape

from lit_spikes.callbacks import PreemptionCheckpoint, SpikeDetector
from lit_spikes.callbacks.common import trainer_callbacks
from lit_spikes.callbacks.run_lock import RunDirectoryLock
from lit_spikes.loader import positioned
from lit_spikes.shared.plain import plain_config
from lit_spikes.shared.training import checkpoint_path, quiet_branches
from lit_spikes.tools.judgement import Judgement
from lit_spikes.tools.recover.branch import (
    Builders,
    branch_run,
    own_newest_checkpoint,
    spike_context,
    summarize,
    with_given,
)
from lit_spikes.tools.recover.config import FACTORY, RecoverConfig
from lit_spikes.tools.recover.gate import RiseCheck, SpikeGate
from lit_spikes.tools.recover.history import (
    HISTORY_NAME,
    HistoryLog,
    StepClock,
    lineage_records,
    read_history,
    records_before,
    write_history,
)
from lit_spikes.tools.recover.judging import flag_judgement, ratio_of, rise_check, spike_rise
from lit_spikes.tools.recover.ledger import (
    LEDGER_NAME,
    BranchRecord,
    Intervention,
    Ledger,
    LedgerMismatch,
    read_ledger,
    refuse_foreign_classes,
    write_ledger,
)
from lit_spikes.tools.recover.log_root import clear_log_root, refuse_foreign_files
from lit_spikes.tools.recover.outcome import (
    conclude,
    validated,
)
from lit_spikes.tools.recover.ranks import Ranks, RankZeroStopped, round_trips
from lit_spikes.tools.recover.remedies import (
    describe_remedy,
    lineage_remedies,
    remedy_spec,
    rung_name,
)
from lit_spikes.tools.recover.report import print_ledger
from lit_spikes.tools.recover.rollback import choose_rollback, newest_on_lineage

_T = TypeVar("_T")


class RecoverInterrupted(Exception):
    """A signal stopped a branch (its checkpoint is written); the ledger says where."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum


@dataclass
class RecoverResult:
    """What ``recover`` returns: the ledger, the stitched lineage and the final weights."""

    ledger: Ledger
    lineage: list[dict[str, Any]]
    """Per-step records of the accepted lineage, each step once (and validations)."""
    final_ckpt: Path
    """Checkpoint of the finished run (last step of the lineage's last branch)."""
    val: float | None = None
    """The last value of the module's validation metric (``ToolFacts.val_metric``)."""


class RecoveryLoop:
    """The loop behind ``recover``; its state is the ledger, rewritten after every event.

    Under DDP every rank runs the loop and trains every branch, and rank 0 alone plans,
    reads and writes files (ledger, histories, TensorBoard's stitched run): after each of
    its turns the other ranks take its ledger (``_on_leader``). The branches' own
    decisions (a spike stopping one, SkipStep, preemption) are agreed by the callbacks.

    Args:
        config: what to train and how to react.
        console: where events and tables go (None: a quiet console).
        progress_bar: Lightning's progress bar in each branch.
        extra_callbacks: called with each branch record before it runs, returns callbacks
            to add (a seam for tests that break a run on purpose).
        fresh: discard an existing ledger and runs under the log root.
        model: a factory of the LightningModule (or a class path) instead of
            ``config.model``; called once per branch.
        data: the same for the LightningDataModule.
    """

    def __init__(
        self,
        config: RecoverConfig,
        console: Console | None = None,
        progress_bar: bool = False,
        extra_callbacks: Callable[[BranchRecord], Sequence[Callback]] | None = None,
        fresh: bool = False,
        model: Any = None,
        data: Any = None,
    ) -> None:
        config, model, data = with_given(config, model, data)
        self.builders = Builders.of(config, model, data)
        self.facts = config.facts if FACTORY not in config.model else self.builders.facts()
        """What the module states of its run (``lit_spikes.ToolFacts``)."""
        self.config, self.progress_bar = config, progress_bar
        self.ranks = Ranks(config)
        self.console = console or Console(quiet=True)
        if not self.ranks.leader:
            self.console = Console(quiet=True)
        self.extra_callbacks = extra_callbacks
        self.root = config.log_root
        self.path = self.root / LEDGER_NAME
        self.ledger = Ledger(config=config.to_dict())
        self._clock = time.perf_counter()
        # The whole log root, before its ledger is read or anything in it removed: a second
        # recover started into it would restart (delete) branches this one is training.
        self.root_lock = RunDirectoryLock(self.root)
        try:
            self._on_leader(lambda: self._open(fresh))
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release the log root and leave the process group (when done or failed)."""
        self.root_lock.release()
        self.ranks.close()

    def _open(self, fresh: bool) -> None:
        self.root_lock.acquire()
        if fresh:
            clear_log_root(self.root)
        resumed = self.path.is_file()
        if resumed:
            self.ledger = read_ledger(self.root)
            self._check_same_config()
        else:
            refuse_foreign_files(self.root)
        self.ledger.sessions += 1
        self.event("resume" if resumed else "start", sessions=self.ledger.sessions)

    def _on_leader(self, work: Callable[[], _T]) -> _T:
        """Run ``work`` on rank 0 only; then every rank holds rank 0's ledger and
        ``work``'s result, or raises its error (one process: just ``work()``)."""
        result: _T | None = None
        error: BaseException | None = None
        if self.ranks.leader:
            try:
                result = work()
            except BaseException as caught:  # every rank must hear of it, or they would hang
                error = caught
        if self.ranks.fabric is not None:
            message = None if error is None else f"{type(error).__name__}: {error}"
            payload = (self.ledger, result, message)
            if not round_trips(payload):
                payload = (self.ledger, None, message or "rank 0's result cannot be sent")
            self.ledger, result, message = self.ranks.from_leader(payload)
            if message is not None and not self.ranks.leader:
                raise RankZeroStopped(f"rank 0 stopped the loop: {message}")
        if error is not None:
            raise error
        return result  # type: ignore[return-value]

    # -- ledger

    def _check_same_config(self) -> None:
        saved = dict(self.ledger.config)
        saved.pop("log_root", None)
        # Its class paths are located before from_dict imports any (a handed-over root)
        refuse_foreign_classes(saved, self.path)
        # A ledger of an older lit-spikes lacks newer fields: they hold their defaults.
        # Unknown or refused fields: compared as written, and named below.
        with suppress(ValueError, TypeError):
            saved = RecoverConfig.from_dict({**saved, "log_root": str(self.root)}).identity()
        now = self.config.identity()
        differ = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        if differ:
            detail = "; ".join(f"{k}: ledger {saved.get(k)!r}, now {now.get(k)!r}" for k in differ)
            raise LedgerMismatch(
                f"{self.path} was written with other arguments ({detail}): restart with the "
                "same arguments to continue it, or pass --fresh (fresh=True) to start over"
            )

    def save(self) -> None:
        if not self.ranks.leader:
            return
        now = time.perf_counter()
        self.ledger.wall_s += now - self._clock
        self._clock = now
        write_ledger(self.path, self.ledger)

    def event(self, kind: str, save: bool = True, **detail: Any) -> None:
        """Record an event and (unless ``save=False``: a decision that the next saved
        event completes, so an interruption between them leaves no half of it) write
        the ledger."""
        stamp = datetime.now(UTC).isoformat(timespec="seconds")
        self.ledger.events.append({"time": stamp, "event": kind, **plain_config(detail)})
        if save:
            self.save()
        text = ", ".join(f"{k}={v}" for k, v in detail.items())
        self.console.print(f"[bold]{kind}[/bold] {escape(text)}")

    # -- driving

    def run(self) -> RecoverResult:
        while self.ledger.status != "done":
            active = [b for b in self.ledger.branches if b.status in ("pending", "running")]
            if active:
                self.run_branch(active[0])
            else:
                self._on_leader(self._plan_or_finish)
        return self._on_leader(self.result)  # it reads the histories: rank 0's files

    def _plan_or_finish(self) -> None:
        if not self.plan_next():
            self.finish()

    def plan_next(self) -> bool:
        """Add the next branch the ledger calls for; False when only finishing is left."""
        main = self.ledger.main_branches()
        if not main:
            self.add_branch(
                BranchRecord(name="base", kind="base", start_step=0, ckpt_path=None, parent=None)
            )
            return True
        last = main[-1]
        if last.status == "spiked":
            if last.kind == "remedy" and last.accepted_at is None:
                self.reject(last)
            else:
                self.intervene(last)
            return True
        assert last.status == "finished"
        return self.plan_comparison()

    def add_branch(self, record: BranchRecord) -> None:
        self.ledger.branches.append(record)
        self.event(
            "branch_planned",
            branch=record.name,
            start_step=record.start_step,
            remedies=[describe_remedy(r) for r in record.remedies],
        )

    def intervene(self, spiked: BranchRecord) -> None:
        """A spike on the lineage: roll back and try the first remedy, or give up."""
        assert spiked.spike is not None
        spike = spiked.spike.replace(branch=spiked.name)
        if len(self.ledger.interventions) >= self.config.max_interventions:
            self.give_up(spiked, None, f"max_interventions={self.config.max_interventions} used")
            return
        if self.ledger.remedy_count() >= self.config.max_branches:
            self.give_up(spiked, None, f"max_branches={self.config.max_branches} used")
            return
        distance, every = self.config.rollback_distance, self.config.checkpoint_every
        step, path, owner, refused = choose_rollback(
            self.ledger, self.root, spiked, spike.step, distance, every
        )
        intervention = Intervention(
            index=len(self.ledger.interventions),
            spike=spike,
            ckpt_step=step,
            ckpt_path=path,
            owner=owner,
            refused=refused,
        )
        records = lineage_records(self.ledger, self.root, spiked.name)
        window = self.config.detector.build(self.facts).window
        intervention.rise_metric, intervention.spike_rise = spike_rise(records, spike, window)
        self.ledger.interventions.append(intervention)
        self.event(
            "spike",
            save=False,
            intervention=intervention.index + 1,
            step=spike.step,
            metric=spike.metric,
            value=round(spike.value, 4),
            branch=spiked.name,
            rollback_to=step,
        )
        self.try_remedy(intervention, self.config.rungs[0])

    def reject(self, branch: BranchRecord) -> None:
        assert branch.intervention is not None and branch.spike is not None
        intervention = self.ledger.interventions[branch.intervention]
        why = f"spike at step {branch.spike.step} ({branch.spike.metric} {branch.spike.value:.3f})"
        judged = branch.judgement  # set where no flag stopped it: its rise did
        if judged is not None:
            why = f"no flag, but it {judged.describe()}"
        else:
            judged = flag_judgement(self.ledger, self.root, self.config, self.facts, branch)
            why += f", rising {judged.ratio:.2f} of the spike's height" if judged else ""
        intervention.outcomes[branch.name] = f"rejected: {why}"
        self.event("rejected", save=False, branch=branch.name, reason=why, **ratio_of(judged))
        tried = len(intervention.tried)
        if tried >= len(self.config.ladder):
            self.give_up_intervention(intervention, "every remedy of the ladder spiked")
        elif self.ledger.remedy_count() >= self.config.max_branches:
            self.give_up_intervention(intervention, f"max_branches={self.config.max_branches} used")
        else:
            self.try_remedy(intervention, self.config.rungs[tried])

    def give_up_intervention(self, intervention: Intervention, reason: str) -> None:
        intervention.status, intervention.reason = "gave_up", reason
        spiked = self.ledger.branch(intervention.spike.branch or "")
        self.give_up(spiked, intervention, reason)

    def _newest_on_lineage(self, branch: BranchRecord) -> tuple[int, str | None, str | None]:
        config = self.config
        return newest_on_lineage(
            self.ledger, self.root, branch, config.steps, config.checkpoint_every
        )

    def give_up(self, spiked: BranchRecord, intervention: Intervention | None, reason: str) -> None:
        """Train the lineage on to the end as it was, spikes recorded, never stopped."""
        step, path, owner = self._newest_on_lineage(spiked)
        index = intervention.index + 1 if intervention else len(self.ledger.interventions) + 1
        self.event("gave_up", save=False, branch=spiked.name, reason=reason, continue_from=step)
        self.add_branch(
            BranchRecord(
                name=f"spike{index}/continue",
                kind="continue",
                start_step=step,
                ckpt_path=path,
                parent=owner,
                remedies=list(spiked.remedies),
                gate="log",
                note=f"gave up on the spike at step {spiked.spike.step} ({reason})"
                if spiked.spike
                else reason,
            )
        )

    def try_remedy(self, intervention: Intervention, rung: dict[str, Any]) -> None:
        spiked = self.ledger.branch(intervention.spike.branch or "")
        records = lineage_records(self.ledger, self.root, spiked.name)
        spec = remedy_spec(rung, spike_context(intervention, spiked, records))
        remedy = rung_name(rung)
        name = f"spike{intervention.index + 1}/{remedy}"
        intervention.tried.append(name)
        self.add_branch(
            BranchRecord(
                name=name,
                kind="remedy",
                start_step=intervention.ckpt_step,
                ckpt_path=intervention.ckpt_path,
                parent=intervention.owner,
                remedies=lineage_remedies(spiked.remedies, spec),
                remedy=remedy,
                intervention=intervention.index,
                accept_after=min(
                    intervention.spike.step + self.config.accept_margin,
                    self.config.steps - 1,
                ),
            )
        )

    # -- one branch

    def run_branch(self, record: BranchRecord) -> None:
        """Train one branch until it ends or its gate stops it at a spike."""
        ckpt, start, check = self._on_leader(lambda: self._prepare(record))
        record = self.ledger.branch(record.name)  # rank 0's record, on every rank
        run_dir = self.root / record.name
        detector = self.config.detector.build(self.facts)
        step_clock = StepClock()
        columns = [column.key for column in self.facts.columns]
        history_log = HistoryLog(run_dir / HISTORY_NAME, step_clock, self.ranks.leader, columns)
        gate = SpikeGate(
            detector, record.gate, record.accept_after,
            lambda step: self.accept(record, step, gate.judgement),
            step_clock, record.start_step, check, history_log,
        )  # fmt: skip
        gate.accepted = gate.accepted or record.accepted_at is not None
        extra = list(self.extra_callbacks(record)) if self.extra_callbacks else []
        # The history before the gate: the gate judges the step's record it appended
        callbacks = [detector, step_clock, history_log, gate, *extra]
        resume_step = start if ckpt else None
        module, datamodule, spec = branch_run(
            self.builders, record, callbacks, resume_step, self.progress_bar
        )
        clock = time.perf_counter()
        try:
            with quiet_branches():
                trainer = spec.trainer()
                trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt)
        finally:
            history_log.close()
            record.wall_s += time.perf_counter() - clock
        self._after_fit(record, detector, trainer, gate)

    def _after_fit(
        self, record: BranchRecord, detector: SpikeDetector, trainer: pl.Trainer, gate: SpikeGate
    ) -> None:
        """A branch's fit ended: a signal's stop, its final checkpoint, its conclusion."""
        preemption = next(
            cb for cb in trainer_callbacks(trainer) if isinstance(cb, PreemptionCheckpoint)
        )  # RunSpec adds one for a run with checkpoints, as every branch is
        if preemption.saved_path is not None:  # every rank saved and stopped at one step
            self._stop_on_signal(record, preemption)
        if gate.stop_spike is None and trainer.global_step >= self.config.steps:
            final = checkpoint_path(self.root / record.name, self.config.steps)
            if self._on_leader(lambda: not final.is_file()):
                trainer.save_checkpoint(final)  # every rank: a collective under DDP
        self._on_leader(lambda: self._conclude(record, detector, trainer, gate))
        if preemption.ended_by_signal:  # in the branch's last step (every rank agreed)
            self._stop_on_signal(record, preemption)  # concluded, then stop

    def _stop_on_signal(self, record: BranchRecord, preemption: PreemptionCheckpoint) -> None:
        """Record the interruption and stop the loop with rank 0's signal on every rank."""
        saved, received = preemption.saved_path, int(preemption.received or signal.SIGINT)

        def interrupted() -> int:
            self.event("interrupted", branch=record.name, checkpoint=saved)
            return received

        raise RecoverInterrupted(self._on_leader(interrupted))

    def _prepare(self, record: BranchRecord) -> tuple[str | None, int, RiseCheck | None]:
        """Rank 0's part of a branch's start: where it starts (its checkpoint and step:
        an interrupted branch continues from its own newest file), its history file cut
        back to that step, and what its gate holds its rise against (``rise_check``)."""
        run_dir = self.root / record.name
        history_path = run_dir / HISTORY_NAME
        ckpt: str | None = record.ckpt_path
        start = record.start_step
        previous = [r for r in read_history(history_path) if "step" in r]
        if record.status == "running":  # interrupted: continue from its own newest file
            record.restarts += 1
            own = own_newest_checkpoint(run_dir, record, self.config.steps)
            if own is not None:
                ckpt, start = own
        if start == record.start_step:  # a first start, or nothing of its own to resume
            record.steps_repeated += len(previous)
            shutil.rmtree(run_dir, ignore_errors=True)
        else:
            kept = records_before(history_path, start)
            record.steps_repeated += len(previous) - sum("step" in r for r in kept)
            write_history(history_path, kept)
        record.status = "running"
        self.event(
            "branch_start" if start == record.start_step else "branch_resume",
            branch=record.name,
            from_step=start,
        )
        return ckpt, start, rise_check(self.ledger, self.root, self.config, self.facts, record)

    def _conclude(
        self, record: BranchRecord, detector: SpikeDetector, trainer: pl.Trainer, gate: SpikeGate
    ) -> None:
        """Rank 0's part of a branch's end: its counts, and spiked or finished."""
        config = self.config
        summarize(record, self.root, detector, trainer_callbacks(trainer), positioned(trainer))
        record.judgement = gate.judgement or record.judgement
        if gate.stop_spike is not None:
            record.status, record.spike = "spiked", gate.stop_spike
            self.event(
                "branch_spiked",
                branch=record.name,
                step=gate.stop_spike.step,
                value=round(gate.stop_spike.value, 4),
            )
            return
        if trainer.global_step < config.steps:
            raise RuntimeError(
                f"branch {record.name} stopped at step {trainer.global_step} of "
                f"{config.steps} without a spike or a signal"
            )
        record.status = "finished"
        if record.accepted_at is None and record.accept_after is not None:
            self.accept(record, config.steps - 1)
        history = read_history(self.root / record.name / HISTORY_NAME)
        self.event("branch_finished", branch=record.name, **validated(history, self.facts))

    def accept(self, record: BranchRecord, step: int, judgement: Judgement | None = None) -> None:
        record.accepted_at, record.judgement = step, judgement or record.judgement
        if record.intervention is not None:
            intervention = self.ledger.interventions[record.intervention]
            intervention.status, intervention.accepted = "accepted", record.name
            intervention.outcomes[record.name] = (
                f"accepted: no spike from step {record.start_step} through step {step}"
            )
            if record.judgement is not None:
                intervention.outcomes[record.name] += f"; it {record.judgement.describe()}"
        self.event("accepted", branch=record.name, at_step=step, **ratio_of(record.judgement))

    # -- comparison rows and the end

    def plan_comparison(self) -> bool:
        rows = self.config.compare_rows
        names = {b.name for b in self.ledger.branches}
        base = self.ledger.branch("base")
        if "do_nothing" in rows and base.status == "spiked" and "compare/do_nothing" not in names:
            step, path, owner = self._newest_on_lineage(base)
            self.add_branch(
                BranchRecord(
                    name="compare/do_nothing",
                    kind="compare",
                    start_step=step,
                    ckpt_path=path,
                    parent=owner,
                    gate="log",
                )
            )
            return True
        for name in (row for row in rows if row != "do_nothing"):
            if f"compare/{name}" in names:
                continue
            self.add_branch(  # the module's variant, from scratch
                BranchRecord(
                    name=f"compare/{name}",
                    kind="compare",
                    start_step=0,
                    ckpt_path=None,
                    parent=None,
                    gate="log",
                    model_changes=dict(self.facts.variant(name).init_args),
                )
            )
            return True
        return False

    def final_head(self) -> BranchRecord:
        return self.ledger.main_branches()[-1]

    def finish(self) -> None:
        head = self.final_head()
        records = lineage_records(self.ledger, self.root, head.name)  # read once, used thrice
        final = checkpoint_path(self.root / head.name, self.config.steps)
        conclude(self.ledger, self.root, records, final, self.facts)
        self.ledger.status = "done"
        lineage = self.ledger.totals.lineage if self.ledger.totals else []
        self.event("done", **validated(records, self.facts), lineage=lineage)

    def result(self) -> RecoverResult:
        totals = self.ledger.totals
        assert totals is not None
        return RecoverResult(
            ledger=self.ledger,
            lineage=lineage_records(self.ledger, self.root, self.final_head().name),
            final_ckpt=Path(totals.final_ckpt),
            val=None if totals.val is None else totals.val[1],
        )


def recover(
    config: RecoverConfig,
    console: Console | None = None,
    progress_bar: bool = False,
    extra_callbacks: Callable[[BranchRecord], Sequence[Callback]] | None = None,
    fresh: bool = False,
    model: Any = None,
    data: Any = None,
) -> RecoverResult:
    """Run (or continue, from its ledger) the recovery loop; see the package docstring.

    ``model`` and ``data``: factories (called once per branch) or class paths of the
    LightningModule and LightningDataModule to train, instead of ``config.model`` and
    ``config.data``. A factory is recorded in the ledger by its name: a restart must give
    one of that name again (and the caller's word that it builds the same).

    Raises:
        ValueError: a ledger under ``config.log_root`` written with other arguments.
    """
    loop = RecoveryLoop(config, console, progress_bar, extra_callbacks, fresh, model, data)
    try:
        result = loop.run()
    finally:
        loop.close()
    if console is not None:
        print_ledger(result.ledger, loop.console)  # quiet on every rank but 0
    return result
