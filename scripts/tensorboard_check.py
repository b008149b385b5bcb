"""The TensorBoard check (issue 65): a short ``lit-spikes fit`` and ``lit-spikes recover``
of a module written for the tests (tests/modules/tb_check.py), read with TensorBoard's own
reader, then served by TensorBoard and seen in headless Chromium at its default settings:
screenshots and checks of what the pages show.

    PYTHONPATH=. .venv/bin/python scripts/tensorboard_check.py [--out DIR]

(``make tensorboard-check``.) Where no Chromium is installed the browser half is skipped,
by name (Debian: ``apt install chromium``). The tests run the reader half, and the browser
half where Chromium is installed (tests/tools/test_tensorboard_check.py).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from tests.modules.tb_check import CheckFailed, browser, browser_checks, read_checks, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("runs/tensorboard_check"),
        help="where the screenshots go (default: runs/tensorboard_check)",
    )
    args = parser.parse_args()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lit-spikes-tb-") as root:
        fit_root, recover_root = train(Path(root))
        try:
            lines = read_checks(fit_root, recover_root)
            if browser() is None:
                lines.append("browser half skipped: no Chromium (apt install chromium)")
            else:
                lines += browser_checks(fit_root, recover_root, args.out)
        except CheckFailed as failed:
            print(*lines, f"FAILED: {failed}", sep="\n")
            raise SystemExit(1) from None
    print(*lines, sep="\n")
    print(f"({time.perf_counter() - start:.0f} s; screenshots in {args.out})")


if __name__ == "__main__":
    main()
