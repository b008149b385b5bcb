"""Demo 3: what PaLM's spike remedy cost, and the same ledger for our demo 2.

The PaLM inputs default to the paper's round numbers (section 5.1, table 1); demo 2's
ledger is read from ``<log-root>/demo2/ledger.json`` when demo 2 (or `make demo`) ran.
"""

import argparse
from pathlib import Path

from lit_spikes.demos import PalmCost, print_demo3
from lit_spikes.main_job import read_ledger


def main() -> None:
    defaults = PalmCost()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spikes", type=int, default=defaults.spikes)
    parser.add_argument("--rollback-steps", type=int, default=defaults.rollback_steps)
    parser.add_argument("--skip-min", type=int, default=defaults.skip_min)
    parser.add_argument("--skip-max", type=int, default=defaults.skip_max)
    parser.add_argument("--total-steps", type=int, default=defaults.total_steps)
    parser.add_argument("--final-batch-tokens", type=int, default=defaults.final_batch_tokens)
    parser.add_argument("--total-tokens", type=float, default=defaults.total_tokens)
    parser.add_argument("--log-root", type=Path, default=Path("runs"))
    args = parser.parse_args()
    try:
        cost = PalmCost(
            args.spikes,
            args.rollback_steps,
            args.skip_min,
            args.skip_max,
            args.total_steps,
            args.final_batch_tokens,
            args.total_tokens,
        )
    except ValueError as error:
        parser.error(str(error))
    print_demo3(cost, read_ledger(args.log_root))


if __name__ == "__main__":
    main()
