"""Demo 3: what PaLM's spike remedy cost, and the same ledger for our demo 2.

The PaLM inputs default to the paper's round numbers (section 5.1, table 1); demo 2's
ledger is read from ``<log_root>/demo2/ledger.json`` when demo 2 (or `make demo`) ran.
"""

import sys
from pathlib import Path

from lit_spikes.demo.demos import PalmCost, print_demo3
from lit_spikes.demo.main_job import read_ledger
from lit_spikes.tools import command_parser, parse_config


def main() -> None:
    parser = command_parser("demo 3", __doc__.splitlines()[0], PalmCost)
    parser.add_argument("--log_root", type=Path, default=Path("runs"), help="demo 2's log root")
    cost, parsed = parse_config(parser, PalmCost, sys.argv[1:])
    print_demo3(cost, read_ledger(Path(parsed.log_root)))


if __name__ == "__main__":
    main()
