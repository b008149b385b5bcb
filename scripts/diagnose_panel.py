"""The diagnose panel (issue 64): spikes planted in two modules written for the tests
(tests/modules/panel.py), each trained by ``lit-spikes fit`` and diagnosed by
``lit-spikes diagnose``; prints each verdict against the cause planted, and k of n right.

    PYTHONPATH=. .venv/bin/python scripts/diagnose_panel.py [--quick] [CASE ...]

(``make diagnose-panel``.) The tests run its quick form (tests/tools/diagnose/test_panel.py).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from tests.modules.panel import CASES, QUICK, run_panel, table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cases", nargs="*", help=f"cases to run (default: all of {len(CASES)})")
    parser.add_argument("--quick", action="store_true", help=f"the tests' cases: {QUICK}")
    args = parser.parse_args()
    names = list(QUICK) if args.quick else args.cases
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lit-spikes-panel-") as root:
        outcomes = run_panel(Path(root), names)
    print(table(outcomes))
    print(f"({time.perf_counter() - start:.0f} s)")
    raise SystemExit(0 if all(o.right for o in outcomes) else 1)


if __name__ == "__main__":
    main()
