"""A screenshot of a forensics replay's TensorBoard page: one statistic's chart with a line
per layer, as a person opening ``tensorboard --logdir <out>`` sees it (headless Chromium
at TensorBoard's defaults, the chart drawn as SVG).

    PYTHONPATH=. .venv/bin/python scripts/forensics_screenshot.py \\
        --logdir runs/forensics-demo/forensics/step150 --stat grad_norm \\
        --out docs/figures/forensics-demo/tensorboard.png

Needs Chromium (Debian: ``apt install chromium``); says so by name where there is none.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tests.modules.tb_check import browser, page, served


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--logdir", type=Path, required=True, help="forensics' --out")
    parser.add_argument("--stat", default="grad_norm", help="the statistic's chart")
    parser.add_argument("--out", type=Path, required=True, help="the screenshot (.png)")
    args = parser.parse_args()
    command = browser()
    if command is None:
        raise SystemExit("no headless browser (chromium): apt install chromium")
    runs = sorted(p.name for p in args.logdir.iterdir() if p.is_dir() and p.name[:2].isdigit())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with served(args.logdir, runs) as url:
        query = f"forceSVG=true&tagFilter=forensics/{args.stat}#timeseries"
        dom, _ = page(command, f"{url}/?{query}", args.out, tries=3)
    missing = [run for run in runs if f'/{run}"' not in dom]
    print(f"{args.out}: {len(runs)} layer runs, listed: {not missing}")


if __name__ == "__main__":
    main()
