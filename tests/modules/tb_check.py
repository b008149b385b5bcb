"""The TensorBoard check (issue 65): a short ``lit-spikes fit`` and ``lit-spikes recover``
of a module written for the tests (``ChartedConv``: logs ``train_loss`` and ``val_loss``,
batch 35 poisoned, the detector on its default monitor, the returned loss), then what a
person sees of them, checked twice:

- **the reader half** (``read_checks``): TensorBoard's own ``EventAccumulator`` reads the
  runs: the mark of the spike is a one-point run on the ``train_loss`` chart at the level
  the curve rose from (the spike's reference), inside the 5-95% range TensorBoard's
  default scaling keeps; recover's runs all log the same tags;
- **the browser half** (``browser_checks``): TensorBoard served and opened in headless
  Chromium at its default settings (Time Series, smoothing 0.6, outliers ignored), a
  screenshot per page and the page's DOM read: the chart named, the marks' run on it.

``scripts/tensorboard_check.py`` runs both (``make tensorboard-check``); the tests run the
reader half, and the browser half where Chromium is installed.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lit_spikes.callbacks.spike_marks import MARKS_RUN, mark_run
from lit_spikes.tools.cli import main

POISON, STEPS = 35, 60
MODEL, DATA = (
    "tests.modules.tb_modules.ChartedConv",
    "tests.modules.spiky_modules.ValidatedRegressionData",
)
COMMON = ["--data.init_args.poison", f"[{POISON}]"]
DETECTOR = ["--detector.ratio", "3", "--detector.window", "10"]
SHARED = ("train_loss", "lr", "grad_norm", "val_loss")
"""The tags every run of recover's loop logs."""
RECOVER_RUNS = ("base", "spike1/skip_data", "compare/do_nothing", "accepted")
BROWSERS = ("chromium", "chromium-browser", "google-chrome")
PAGE = "forceSVG=true&tagFilter=train_loss#timeseries"
"""The Time Series page at its defaults, its charts drawn as SVG (headless Chromium has no
WebGL for them) and filtered to the user's loss."""


class CheckFailed(AssertionError):
    """What the page or the files show is not what the check expects."""


def train(root: Path) -> tuple[Path, Path]:
    """The fit run (``root/fit/user_run``) and recover's log root (``root/recover``)."""
    # The run in a folder of its own, as under lightning_logs/: TensorBoard served on the
    # run itself names it "." (some of whose pages came back empty in the browser).
    fit_root, recover_root = root / "fit" / "user_run", root / "recover"
    quiet = ["--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false"]
    fit = ["fit", "--model", MODEL, "--data", DATA, *COMMON]
    fit += ["--trainer.callbacks+=lit_spikes.callbacks.SpikeDetector"]
    fit += ["--trainer.callbacks.ratio", "3", "--trainer.callbacks.window", "10"]
    fit += ["--trainer.max_steps", str(STEPS), "--trainer.val_check_interval", "20", *quiet]
    main([*fit, "--trainer.default_root_dir", str(fit_root)])
    recover = ["recover", "--model", MODEL, "--data", DATA, *COMMON, *DETECTOR]
    recover += ["--max_steps", str(STEPS), "--checkpoint_every", "10", "--val_every", "20"]
    recover += ["--rollback_distance", "5", "--accept_margin", "5", "--compare", "true"]
    main([*recover, "--log_root", str(recover_root)])
    return fit_root, recover_root


def scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()
    return {t: [(e.step, e.value) for e in events.Scalars(t)] for t in events.Tags()["scalars"]}


def _expect(ok: bool, what: str) -> str:
    if not ok:
        raise CheckFailed(what)
    return f"ok: {what}"


def read_checks(fit_root: Path, recover_root: Path) -> list[str]:
    """The reader half: one line per check passed; ``CheckFailed`` at the first that is not."""
    run = scalars(fit_root)
    marks = sorted(p.name for p in (fit_root / MARKS_RUN).iterdir())
    lines = [_expect(marks == [Path(mark_run(POISON)).name], f"fit: one mark run, {marks}")]
    mark = scalars(fit_root / mark_run(POISON))
    curve = dict(run["train_loss"])
    window = [curve[k] for k in range(POISON - 10, POISON)]  # the detector's ratio rule
    level = float(np.float32(statistics.fmean(window)))
    lines.append(
        _expect(
            mark == {"train_loss": [(POISON, level)]},
            f"fit: the mark is one point on the user's train_loss chart at the spike's "
            f"reference {level:.4f} (the mean of the 10 steps before): {mark}",
        )
    )
    low, high = np.quantile(list(curve.values()), [0.05, 0.95])
    lines.append(
        _expect(
            low <= level <= high,
            f"fit: the mark {level:.4f} lies in the 5-95% range TensorBoard's default scaling "
            f"keeps ({low:.4f}-{high:.4f}); the spike {curve[POISON]:.1f} does not",
        )
    )
    lines.append(_expect("loss" not in run, "fit: no 'loss' chart besides the user's"))
    for name in RECOVER_RUNS:
        tags = set(scalars(recover_root / name))
        lines.append(_expect(set(SHARED) <= tags, f"recover {name}: logs {', '.join(SHARED)}"))
    for name in ("base", "compare/do_nothing"):
        mark = scalars(recover_root / name / mark_run(POISON))
        lines.append(_expect(list(mark) == ["train_loss"], f"recover {name}: marked on train_loss"))
    return lines


def browser() -> str | None:
    """The headless browser's command, or None where none is installed."""
    return next((found for name in BROWSERS if (found := shutil.which(name))), None)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _runs_listed(url: str, runs: Sequence[str]) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            listed = json.loads(answer.read() or b"[]")
    except (OSError, ValueError):
        return False
    return bool(listed) and all(run in listed for run in runs)


@contextlib.contextmanager
def served(logdir: Path, runs: Sequence[str] = ()) -> Iterator[str]:
    """TensorBoard serving ``logdir`` on a free local port, until the block ends, once it
    lists ``runs``."""
    port = _free_port()
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(logdir)]
    command += ["--port", str(port), "--host", "127.0.0.1"]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(240):  # its first load of the runs
            if _runs_listed(f"{url}/data/runs", runs):
                break
            time.sleep(0.5)
        time.sleep(2)  # their scalars, read after the run list
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def page(command: str, url: str, screenshot: Path, tries: int = 5) -> tuple[str, int]:
    """The page at ``url`` after its scripts ran (its DOM), and its screenshot once its
    chart is drawn (headless Chromium sometimes captures the card before its data came:
    tried again, up to ``tries`` times), and the tries the screenshot took. The charts
    drawn as SVG (``forceSVG``): headless Chromium has no WebGL to draw them with."""
    flags = [command, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars"]
    flags += ["--window-size=1000,640"]
    taken = 0
    while taken < tries:
        budget = f"--virtual-time-budget={60000 + 30000 * taken}"
        run = [*flags, budget, f"--screenshot={screenshot}", url]
        with tempfile.TemporaryDirectory(prefix="lit-spikes-chromium-") as profile:
            # A profile of its own: Chromium's default one is shared with any browser
            # still closing, and a page opened in it came back empty.
            subprocess.run([*run, f"--user-data-dir={profile}"], capture_output=True, timeout=180)
        taken += 1
        if screenshot.is_file() and drawn(screenshot):
            break
        time.sleep(3)
    dom = ""
    for attempt in range(tries):  # the run list drawn
        budget = f"--virtual-time-budget={60000 + 30000 * attempt}"
        run = [*flags, budget, "--dump-dom", url]
        with tempfile.TemporaryDirectory(prefix="lit-spikes-chromium-") as profile:
            run.append(f"--user-data-dir={profile}")
            dom = subprocess.run(run, capture_output=True, timeout=180, text=True).stdout
        if "defaultExperimentId/" in dom:
            break
    return dom, taken


FIRST_COLOUR, MARK_COLOUR = (0x42, 0x50, 0x66), (0x12, 0xB5, 0xCB)
"""TensorBoard's colours of a logdir's first and second runs (its palette's slate and
cyan): the fit page's run itself and its marks run."""
CHART = (280, 200, 740, 470)
"""The plot area of the one chart on the page, ``(left, top, right, bottom)`` in pixels at
the screenshots' size (1000 x 640): right of the run list and the chart's legend dots,
left of the settings panel, between the card's title and its legend table (the toolbar's
icons above are of the first run's slate too)."""


def in_chart(dot: tuple[int, int]) -> bool:
    left, top, right, bottom = CHART
    return left < dot[0] < right and top < dot[1] < bottom


def drawn(screenshot: Path) -> bool:
    """Whether the first run's curve is drawn in the chart of ``screenshot``."""
    return any(in_chart(dot) for dot in dots(screenshot, FIRST_COLOUR))


def dots(screenshot: Path, colour: tuple[int, int, int]) -> list[tuple[int, int]]:
    """The centres ``(x, y)`` of the blobs of ``colour`` in ``screenshot``."""
    from PIL import Image

    pixels = np.asarray(Image.open(screenshot).convert("RGB")).astype(int)
    mask = np.abs(pixels - np.array(colour)).sum(axis=2) < 60
    centres, seen = [], np.zeros_like(mask)
    for y, x in zip(*np.nonzero(mask), strict=True):
        if seen[y, x]:
            continue
        blob, todo = [], [(y, x)]
        seen[y, x] = True
        while todo:
            cy, cx = todo.pop()
            blob.append((cy, cx))
            for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                inside = 0 <= ny < mask.shape[0] and 0 <= nx < mask.shape[1]
                if inside and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    todo.append((ny, nx))
        ys, xs = zip(*blob, strict=True)
        centres.append((round(float(np.mean(xs))), round(float(np.mean(ys)))))
    return centres


def browser_checks(fit_root: Path, recover_root: Path, out: Path) -> list[str]:
    """The browser half: screenshots ``out/fit.png`` and ``out/recover.png`` of the
    ``train_loss`` chart at TensorBoard's defaults, and checks of what each shows: the
    runs listed (the page's DOM), and on the fit page the mark's dot drawn in the chart,
    right of the run list and the chart's legend (the screenshot's pixels)."""
    command = browser()
    if command is None:
        raise FileNotFoundError(
            f"no headless browser ({', '.join(BROWSERS)}): apt install chromium"
        )
    out.mkdir(parents=True, exist_ok=True)
    lines = []
    for name, logdir, runs in (
        ("fit", fit_root.parent, [fit_root.name, f"{fit_root.name}/{mark_run(POISON)}"]),
        ("recover", recover_root, [*RECOVER_RUNS, f"base/{mark_run(POISON)}"]),
    ):
        shot = out / f"{name}.png"
        server = 0
        while server < 3:  # a server whose page stays empty is started anew (seen)
            server += 1
            with served(logdir, runs) as url:
                dom, taken = page(command, f"{url}/?{PAGE}", shot, tries=2)
            if shot.is_file() and drawn(shot):
                break
        where = f"server {server}, try {taken}"
        lines.append(_expect(shot.is_file(), f"{name}: screenshot {shot} ({where})"))
        for run in runs:
            lines.append(_expect(f'/{run}"' in dom, f"{name}: run {run} listed"))
    for name in ("fit", "recover"):
        lines.append(_expect(drawn(out / f"{name}.png"), f"{name}: the train_loss chart drawn"))
    marks = [x for x, y in dots(out / "fit.png", MARK_COLOUR) if in_chart((x, y))]
    lines.append(_expect(len(marks) == 1, f"fit: the mark's dot drawn in the chart, at x={marks}"))
    return lines
