"""End-to-end: the main job at reduced size, with a planted spike so it always has one."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import sys
import warnings
import weakref
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.callbacks import Callback
from rich.console import Console

from lit_spikes.callbacks import RunDirectoryBusy
from lit_spikes.demo.demos import DEMO_BRANCHES, DemoSetup, PalmCost, default_workers
from lit_spikes.demo.main_job import MainJobResult, run_main_job
from tests.conftest import TINY_DATA, tb_steps
from tests.modules.demo_setup import tiny_setup

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def main_job(tmp_path_factory: pytest.TempPathFactory) -> tuple[DemoSetup, MainJobResult, str]:
    setup = tiny_setup(tmp_path_factory.mktemp("main_job") / "runs")
    console = Console(record=True, width=200)
    with warnings.catch_warnings():
        # Demo 1's other-data-seed row says so as it resumes (in a worker, or here).
        warnings.filterwarnings("ignore", "the checkpoint was trained with data seed", UserWarning)
        result = run_main_job(setup, console=console)
    return setup, result, console.export_text()


def test_main_job_at_reduced_size(main_job: tuple[DemoSetup, MainJobResult, str]) -> None:
    setup, result, text = main_job
    for heading in ("Demo 1", "Demo 2", "Demo 3", "255,000", "0.8%", "42B tokens", "5% of 780B"):
        assert heading in text, heading
    # a command that works from the repository: a venv's tensorboard is not on the PATH
    assert f"tensorboard --logdir {setup.log_root}" in text
    assert "TensorBoard: tensorboard " not in text
    assert "differ from one CPU to another" in " ".join(text.split())  # and `make study`
    assert result.demo1 is not None and result.demo2 is not None and result.ledger is not None
    # demo 1: the exact resume is exact, the ablations are not
    exact, fresh, other = result.demo1.rows[1:]
    assert exact.max_param_diff == 0.0 and result.demo1.exact_losses_equal
    assert fresh.max_param_diff > 0 and other.max_param_diff > 0
    # demo 2: the planted spike is found; the remedies branch from the checkpoint before it
    plan = result.demo2.plan
    assert plan.onset == 28 and plan.ckpt_step == 20
    assert plan.skip_before == (22, 28) and plan.skip_straddle == (26, 32)
    assert [row.start_step for row in result.demo2.rows] == [0, 20, 20, 20, 20]
    assert result.demo2.steps_at == [39]  # k+100, k+200 and the last step, clipped to the run
    assert all(len(row.losses_at) == 1 for row in result.demo2.rows)
    skip_rows = {row.remedy: row.batches_skipped for row in result.ledger}
    assert list(skip_rows.values()) == [6, 6, 0, 0]
    assert all(row.steps_recomputed == 8 for row in result.ledger)
    for demo in ("demo1", "demo2"):
        png = (setup.log_root / demo / "comparison.png").read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 10_000
    checkpoints = sorted(p.name for p in (setup.log_root / "demo1/reference/checkpoints").iterdir())
    assert checkpoints == ["step=10.ckpt", "step=20.ckpt", "step=30.ckpt", "step=40.ckpt"]
    # every run once, the reference in this process, the branches in it and its workers
    assert len(result.results) == 1 + DEMO_BRANCHES  # which bounds the default worker count
    assert result.reference.pid == os.getpid()
    assert len({run.pid for run in result.results.values()}) <= 1 + setup.workers


@pytest.mark.parametrize(("cores", "workers"), [(1, 1), (2, 1), (4, 3), (64, DEMO_BRANCHES)])
def test_default_workers_one_process_per_core_at_most_one_per_branch(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, cores: int, workers: int
) -> None:
    import lit_spikes.demo.demos

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    monkeypatch.setattr(
        lit_spikes.shared.cores, "CGROUP_ROOT", tmp_path
    )  # no quota, whatever the host's
    monkeypatch.setattr(lit_spikes.shared.cores, "PROC_SELF_CGROUP", tmp_path / "no-such-file")
    assert default_workers() == workers
    assert DemoSetup().workers == workers


V2_SERVICE = "0::/user.slice/app.service\n"
V1_JOB = "5:memory:/batch/job1\n4:cpu,cpuacct:/batch/job1\n0::/\n"


@pytest.mark.parametrize(
    ("files", "proc", "cores"),
    [
        ({}, None, 8),
        ({"cpu.max": "max 100000\n"}, None, 8),
        ({"cpu.max": "200000 100000\n"}, None, 2),
        ({"cpu.max": "150000 100000\n"}, None, 1),
        ({"cpu.max": "50000 100000\n"}, None, 1),
        ({"cpu.max": "1600000 100000\n"}, None, 8),
        ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None, 8),
        ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, None, 3),
        ({"cpu.max": "garbage"}, None, 8),
        # The process's own cgroup and every one above it: the smallest quota binds.
        ({"user.slice/app.service/cpu.max": "300000 100000\n"}, V2_SERVICE, 3),
        (
            {
                "user.slice/cpu.max": "200000 100000\n",
                "user.slice/app.service/cpu.max": "max 100000\n",
            },
            V2_SERVICE,
            2,
        ),
        (
            {
                "cpu.max": "500000 100000\n",
                "user.slice/cpu.max": "300000 100000\n",
                "user.slice/app.service/cpu.max": "600000 100000\n",
            },
            V2_SERVICE,
            3,
        ),
        ({"elsewhere.slice/cpu.max": "100000 100000\n"}, V2_SERVICE, 8),  # not ours
        (
            {
                "cpu/batch/job1/cpu.cfs_quota_us": "200000\n",
                "cpu/batch/job1/cpu.cfs_period_us": "100000\n",
            },
            V1_JOB,
            2,
        ),
        ({"user.slice/app.service/cpu.max": "300000 100000\n"}, "not a cgroup file", 8),
    ],
)
def test_usable_cores_follow_the_cpu_quota_of_the_process_cgroup_and_those_above_it(
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    files: dict[str, str],
    proc: str | None,
    cores: int,
) -> None:
    from lit_spikes.demo.demos import usable_cores

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    root, proc_cgroup = tmp_path / "cgroup", tmp_path / "proc_self_cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    if proc is not None:
        proc_cgroup.write_text(proc)
    assert usable_cores(root, proc_cgroup) == cores


def test_palm_cost_matches_the_paper_numbers() -> None:
    cost = PalmCost()
    assert cost.recomputed == 2_000
    assert cost.skipped == (4_000, 10_000)
    assert round(cost.skipped_tokens_max / 1e9) == 42
    with pytest.raises(ValueError, match="skip_min=600 <= skip_max=500"):
        PalmCost(skip_min=600)


def test_demos_still_offers_what_moved_to_demo_tables() -> None:
    """The reports' rows, tables and demo 3 live in ``lit_spikes.demo.demo_tables``;
    ``lit_spikes.demo.demos`` re-exports each of them, so callers import from either."""
    import lit_spikes.demo.demo_tables as tables
    import lit_spikes.demo.demos as demos

    assert all(hasattr(demos, name) for name in demos.__all__)
    own = {
        name
        for name, value in vars(tables).items()
        if not name.startswith("_") and getattr(value, "__module__", None) == tables.__name__
    }
    assert own and own <= set(demos.__all__)
    assert all(getattr(demos, name) is getattr(tables, name) for name in own)


TAGS = {"train/loss", "train/max_logit", "lr", "grad_norm", "data/position", "val/bpc"}


def test_tensorboard_runs_overlay_on_one_step_axis(
    main_job: tuple[DemoSetup, MainJobResult, str],
) -> None:
    setup, _, _ = main_job
    k, n = setup.ckpt_step, setup.steps
    runs = sorted(
        {p.parent for p in setup.log_root.glob("demo*/*/events.out.tfevents.*")}
        - {setup.log_root / "demo1/summary", setup.log_root / "demo2/summary"}
    )
    names = [str(r.relative_to(setup.log_root)) for r in runs]
    assert names == [
        "demo1/reference",
        "demo1/resume_exact",
        "demo1/resume_fresh_adamw",
        "demo1/resume_other_data_seed",
        "demo2/clip",
        "demo2/scale_lr",
        "demo2/skip_before",
        "demo2/skip_straddle",
    ]
    for run in runs:
        scalars = tb_steps(run)
        assert scalars.keys() >= TAGS, run
        assert not scalars.keys() & {"epoch", "hp_metric"}, run  # a flat 0, a -1: noise
        steps = scalars["train/loss"]
        assert len(steps) == len(set(steps)), f"{run}: a step logged twice"
        first = 0 if run.name == "reference" else k
        assert steps == list(range(first, n)), run
        # validation after global step s is logged at the index of its last step, s - 1;
        # the reference validates every 20 steps, the branches once, at their end
        every = setup.val_every if run.name == "reference" else n
        assert scalars["val/bpc"] == [s - 1 for s in range(every, n + 1, every)]
    assert tb_steps(setup.log_root / "demo1/reference")["spike/loss"] == [28]


def test_tensorboard_hparams_layout_and_tables(
    main_job: tuple[DemoSetup, MainJobResult, str],
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2
    from tensorboard.plugins.hparams import plugin_data_pb2

    setup, result, _ = main_job
    assert result.demo2 is not None
    for run in ("demo1/reference", "demo2/scale_lr", "demo2/clip"):
        accumulator = EventAccumulator(str(setup.log_root / run), size_guidance={"tensors": 0})
        accumulator.Reload()
        content = accumulator.PluginTagToContent("hparams")
        info = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
        hparams = info.session_start_info.hparams
        assert hparams["row"].string_value
        assert "hp/val_bpc" in accumulator.Tags()["scalars"]
    clip = EventAccumulator(str(setup.log_root / "demo2/clip"))
    clip.Reload()
    info = plugin_data_pb2.HParamsPluginData.FromString(
        clip.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    )
    assert info.session_start_info.hparams["gradient_clip_val"].number_value == 1.0
    bpc = clip.Scalars("hp/val_bpc")[-1].value
    assert bpc == pytest.approx(result.demo2.rows[-1].val_bpc, rel=1e-6)  # float32 storage

    summary = EventAccumulator(str(setup.log_root / "demo2/summary"), size_guidance={"tensors": 0})
    summary.Reload()
    config = summary.Tensors("custom_scalars__config__")[0].tensor_proto.string_val[0]
    layout = layout_pb2.Layout.FromString(config)
    charts = {c.title: list(c.multiline.tag) for cat in layout.category for c in cat.chart}
    assert charts["training loss"] == [r"^train/loss$"]
    text = summary.Tensors("demo2/table/text_summary")[0].tensor_proto.string_val[0].decode()
    assert "halve the LR (OPT)" in text and text.startswith("| remedy |")
    assert "`demo1/reference`" in text  # demo 2's first row, logged once, under demo 1


def test_the_demo_tables_render_as_tables_in_tensorboard(
    main_job: tuple[DemoSetup, MainJobResult, str],
) -> None:
    """Demo 1's header "max |param - reference|" once split its row into 6 cells of 4
    columns, and TensorBoard showed the markdown as text."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugin_util import markdown_to_safe_html

    setup, _, _ = main_job
    summary = EventAccumulator(str(setup.log_root / "demo1/summary"), size_guidance={"tensors": 0})
    summary.Reload()
    text = summary.Tensors("demo1/table/text_summary")[0].tensor_proto.string_val[0].decode()
    html = markdown_to_safe_html(text)
    assert "<th>max |param - reference|</th>" in html
    assert html.count("<tr>") == 5 and html.count("<th>") == 4 and html.count("<td>") == 16


def test_the_main_job_writes_no_figure_outside_its_log_root_unless_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """make demo rewrote the committed docs/figures/*.png; make figures asks for them."""
    import lit_spikes.demo.main_job as main_job_module

    taken: list[Path | None] = []
    monkeypatch.setattr(main_job_module, "run_main_job", lambda s, _: taken.append(s.figures_dir))
    main_job_module.main(["--log_root", str(tmp_path / "runs")])
    main_job_module.main(["--log_root", str(tmp_path / "runs"), "--figures_dir", "docs/figures"])
    assert taken == [None, Path("docs/figures")]


def test_a_data_seed_warning_points_at_the_fit_call_not_into_lightning(tmp_path: Path) -> None:
    """It showed as lightning/pytorch/trainer/call.py:199 between the main job's tables."""
    from tests import conftest
    from tests.conftest import fit

    fit(tmp_path, "a", 4, checkpoint_every=2)
    other = replace(TINY_DATA, seed=TINY_DATA.seed + 1)
    ckpt = tmp_path / "a" / "checkpoints" / "step=2.ckpt"
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        fit(tmp_path, "b", 4, data=other, ckpt_path=ckpt)
    [warning] = [w for w in seen if "data seed" in str(w.message)]
    assert "trained with data seed 3, this run uses 4" in str(warning.message)
    assert warning.filename == conftest.__file__  # where fit calls trainer.fit


def test_main_job_under_ddp_with_two_processes(tmp_path: Path) -> None:
    """`--devices 2 --strategy ddp`: every run spans 2 gloo processes, the runs go in
    sequence, Lightning re-runs the script for rank 1, and only rank 0 writes results."""
    import subprocess
    import sys

    from tests.conftest import REPO, ddp_env

    result = subprocess.run(
        [sys.executable, "-m", "tests.modules.ddp_main_job", str(tmp_path)],
        cwd=REPO,
        env=ddp_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    assert "GLOBAL_RANK: 1, MEMBER: 2/2" in result.stderr
    assert result.stdout.count("Demo 1: checkpoint at step 20") == 1  # rank 0 prints alone
    assert result.stdout.count("exact-resume-diff=0.0") == 2  # both ranks: bit-exact
    assert result.stdout.count("onset=28 ckpt=20") == 2  # both ranks: the same plan
    ledger = json.loads((tmp_path / "demo2" / "ledger.json").read_text())
    assert [row["batches_skipped"] for row in ledger] == [6, 6, 0, 0]


def test_a_main_job_into_a_busy_log_root_removes_nothing(
    tmp_path: Path, directory_holder: Any
) -> None:
    """Another main job there may be training: its runs must not be cleared away."""
    setup = tiny_setup(tmp_path / "runs")
    events = setup.log_root / "demo1" / "reference" / "events.out.tfevents.1.host.1.0"
    events.parent.mkdir(parents=True)
    events.write_bytes(b"")
    holder = directory_holder(setup.log_root)
    with pytest.raises(RunDirectoryBusy, match=rf"\(pid {holder.pid} on "):
        run_main_job(setup, console=Console(quiet=True))
    assert events.exists()


@pytest.mark.parametrize("flag", ["--log_root", "--figures_dir"])
def test_main_job_refuses_an_unwritable_output_before_it_clears_or_trains(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str
) -> None:
    """Not a traceback, nor a FileExistsError after all the training with the last run's
    results already cleared: a usage error naming the flag, and nothing touched."""
    from lit_spikes.demo.main_job import main

    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    log_root = tmp_path / "runs"
    kept = log_root / "demo2" / "ledger.json"
    kept.parent.mkdir(parents=True)
    kept.write_text("[]")
    args = {"--log_root": str(log_root), "--figures_dir": str(tmp_path / "figures")}
    args[flag] = str(a_file / "sub")
    with pytest.raises(SystemExit) as exit_info:
        main([item for pair in args.items() for item in pair])
    assert exit_info.value.code == 2
    assert f"{flag} {a_file / 'sub'} cannot be created ({a_file} is not a directory)" in (
        capsys.readouterr().err
    )
    assert kept.exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--strategy", "bogus"], "--strategy='bogus' must be auto or ddp"),
        (["--devices", "2", "--strategy", "ddp_spawn"], "--strategy='ddp_spawn' must be auto"),
        (["--devices", "3", "--strategy", "ddp"], "--devices=3: the demos' batch of 16 rows"),
        (["--devices", "2", "--workers", "2"], "--workers=2 with --devices=2: the runs then go"),
    ],
)
def test_main_job_refuses_a_strategy_or_device_count_before_it_clears_or_trains(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    """A bogus strategy failed in Lightning after the last results were cleared; a spawned
    DDP trained the reference and then failed on a temporary file; 3 processes failed on
    a batch size the main job has no flag for."""
    from lit_spikes.demo.main_job import main

    log_root = tmp_path / "runs"
    kept = log_root / "demo2" / "ledger.json"
    kept.parent.mkdir(parents=True)
    kept.write_text("[]")
    argv = ["--log_root", str(log_root), "--figures_dir", str(tmp_path / "figures"), *extra]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert kept.exists() and sorted(log_root.rglob("*")) == [kept.parent, kept]


def test_one_demo_run_again_keeps_the_other_demos_runs(tmp_path: Path) -> None:
    """Demo 1 alone (scripts/demo_checkpoints.py) retrains the reference, but demo 2's runs
    and the ledger demo 3 reads stay."""
    from lit_spikes.demo.main_job import clear_previous

    setup = tiny_setup(tmp_path / "runs")
    for demo in ("demo1", "demo2"):
        (setup.log_root / demo / "reference").mkdir(parents=True)
    clear_previous(setup, demos=(1,))
    assert not (setup.log_root / "demo1").exists()
    assert (setup.log_root / "demo2" / "reference").exists()
    clear_previous(setup, demos=(3,))
    assert not (setup.log_root / "demo2").exists()


def test_a_signal_stops_the_main_job_with_no_tables_from_cut_short_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C at step 15 of the reference: it checkpoints and stops; the job must stop too
    (it once went on, and failed for want of a spike the short run never reached), and
    its workers must not train their branches to the end first."""
    import signal
    import time

    from lightning.pytorch.callbacks import Callback

    from lit_spikes.demo.branches import BranchInterrupted

    class CtrlCAtStep15(Callback):
        def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
            if trainer.global_step == 15:
                os.kill(os.getpid(), signal.SIGINT)

    real_reference = DemoSetup.reference

    def reference(self: DemoSetup, **changes: Any) -> Any:
        branch = real_reference(self, **changes)
        return replace(branch, callbacks=[*branch.callbacks, CtrlCAtStep15()])

    monkeypatch.setattr(DemoSetup, "reference", reference)
    setup = tiny_setup(tmp_path / "runs")
    start = time.perf_counter()
    with pytest.raises(BranchInterrupted, match="SIGINT stopped run demo1/reference after step 16"):
        run_main_job(setup, console=Console(quiet=True))
    assert time.perf_counter() - start < 60
    assert (setup.log_root / "demo1" / "reference" / "checkpoints" / "step=16.ckpt").is_file()


class SignalsTheMainJobOnce(Callback):
    """For demo 2's branches: at ``step``, the first branch there (in this process or in
    a worker) sends ``signum`` to the main job's process, the others nothing (a marker
    file created exclusively): one signal stops the job. ``dropped``: only a branch
    trained in the main process sends it, from inside a weakref callback, where the
    handler's raise is printed and dropped (as CI once saw a Ctrl-C lost)."""

    def __init__(self, pid: int, step: int, signum: int, marker: Path, dropped: bool) -> None:
        self.pid, self.step, self.signum, self.marker = pid, step, signum, marker
        self.dropped = dropped

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step != self.step or (self.dropped and os.getpid() != self.pid):
            return
        try:
            os.close(os.open(self.marker, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
        if not self.dropped:
            os.kill(self.pid, self.signum)
            return
        gone = Callback()  # any object a weak reference can watch
        pid, signum = self.pid, self.signum
        watch = weakref.ref(gone, lambda _: (os.kill(pid, signum), sum(range(10_000))))
        dropped: list[BaseException | None] = []
        hook, sys.unraisablehook = sys.unraisablehook, lambda u: dropped.append(u.exc_value)
        try:
            del gone  # the callback runs, and the handler in it, here
        finally:
            sys.unraisablehook = hook
        assert watch() is None and [type(e).__name__ for e in dropped] == ["MainJobInterrupted"]


# Demo 1's other-data-seed row says so as it resumes, when it trains in this process.
@pytest.mark.filterwarnings("ignore:the checkpoint was trained with data seed:UserWarning")
@pytest.mark.parametrize(
    ("signum", "dropped"),
    [(signal.SIGTERM, False), (signal.SIGINT, False), (signal.SIGINT, True)],
    ids=["SIGTERM", "SIGINT", "SIGINT-dropped"],
)
def test_a_signal_during_a_branch_stops_the_main_job_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signum: signal.Signals, dropped: bool
) -> None:
    """A branch trained in this process has no PreemptionCheckpoint: Lightning's SIGTERM
    ended the job with status 0 (SystemExit(None)), its Ctrl-C with 1; and a signal
    while this process only waited for its workers killed it, leaving them orphaned.
    A Ctrl-C whose raise a weakref callback dropped let the job train on to its end."""
    import lit_spikes.demo.main_job as main_job_module
    from lit_spikes.demo.main_job import MainJobInterrupted

    real = main_job_module.demo2_branches
    marker = tmp_path / "signalled"

    def with_signal(setup: DemoSetup, plan: Any) -> Any:
        stop = SignalsTheMainJobOnce(os.getpid(), 30, signum, marker, dropped)
        return [replace(b, callbacks=[*b.callbacks, stop]) for b in real(setup, plan)]

    monkeypatch.setattr(main_job_module, "demo2_branches", with_signal)
    # A suite started in the background (SIGINT ignored, as a shell does for `&`) would
    # leave the job nothing to stop on: Ctrl-C's own handler, as in a terminal.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        handlers = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))
        with pytest.raises(MainJobInterrupted) as stopped:
            run_main_job(tiny_setup(tmp_path / "runs", workers=1), console=Console(quiet=True))
        assert stopped.value.signum == signum and marker.exists()
        assert str(stopped.value) == f"{signum.name} stopped it"
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
        # no worker left behind: the interpreter's exit would wait for it forever
        assert multiprocessing.active_children() == []
    finally:
        signal.signal(signal.SIGINT, previous)


def test_without_a_spike_demo_1_is_still_shown_before_demo_2_fails(tmp_path: Path) -> None:
    """Where the CPU's kernels leave the reference without a spike, demo 1 (which needs
    none) was thrown away with its workers; now its table and figure come first."""
    from lit_spikes.demo.demos import NoSpikeAfterWarmup

    setup = tiny_setup(tmp_path / "runs", workers=1)
    setup = replace(setup, data=replace(setup.data, poison=()), figures_dir=tmp_path / "figs")
    console = Console(record=True, width=200)
    with pytest.raises(NoSpikeAfterWarmup, match="no loss spike after warm-up"):
        run_main_job(setup, console=console)
    text = console.export_text()
    assert "Demo 1: checkpoint at step 20" in text and "Demo 2" not in text
    assert (tmp_path / "figs" / "demo1.png").is_file()
    assert not (tmp_path / "figs" / "demo2.png").exists()


def test_previous_results_that_cannot_be_removed_stop_the_main_job(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files another user wrote stayed, silently, and mixed into the new run's curves."""
    from lit_spikes.demo.main_job import clear_previous

    setup = tiny_setup(tmp_path / "runs")
    stuck = setup.log_root / "demo1" / "reference" / "checkpoints" / "step=20.ckpt"
    stuck.parent.mkdir(parents=True)
    stuck.write_text("not ours to delete")
    (stuck.parent / "step=10.ckpt").write_text("ours")
    real_unlink = os.unlink

    def unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        if str(path).endswith("step=20.ckpt"):
            raise PermissionError(1, "Operation not permitted", str(path))
        real_unlink(path, *args, **kwargs)

    monkeypatch.setattr(os, "unlink", unlink)
    with pytest.raises(PermissionError, match=r"could not remove 1 file\(s\) .*step=20\.ckpt"):
        clear_previous(setup)
    assert not (stuck.parent / "step=10.ckpt").exists()
    clear_previous(tiny_setup(tmp_path / "nothing_there"))  # nothing to clear: no error


def test_more_workers_than_branches_are_capped_and_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--workers 20 started 20 processes for 7 branches, 13 of them idle."""
    import lit_spikes.demo.main_job as main_job_module

    taken: list[int] = []
    record = lambda setup, _: taken.append(setup.workers)  # noqa: E731
    monkeypatch.setattr(main_job_module, "run_main_job", record)
    argv = ["--log_root", str(tmp_path / "runs"), "--figures_dir", str(tmp_path / "f")]
    main_job_module.main([*argv, "--workers", "20"])
    assert taken == [DEMO_BRANCHES]
    assert f"--workers=20: the demos have {DEMO_BRANCHES} branches" in capsys.readouterr().err


def test_a_second_signal_does_what_it_did_before_the_main_job() -> None:
    """Lightning's teardown puts back the handler it found (the job's): a second Ctrl-C
    must not raise MainJobInterrupted again, into the cleanup of the first."""
    from lit_spikes.demo.main_job import MainJobInterrupted, _signals_stop_the_job

    seen: list[int] = []
    original = signal.signal(signal.SIGINT, lambda signum, frame: seen.append(signum))
    try:
        # The first raise caught (or dropped) in the job, the job still ends as stopped.
        with pytest.raises(MainJobInterrupted), _signals_stop_the_job((signal.SIGINT,)):
            with pytest.raises(MainJobInterrupted):
                signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)  # to the handler from before the job
        assert seen == [signal.SIGINT]
        signal.raise_signal(signal.SIGINT)  # and it is that handler again afterwards
        assert seen == [signal.SIGINT, signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, original)
