"""Automatic spike recovery on the built-in world: `lit-spikes recover` as a script.

Trains the default (unstable) run with a spike detector; on a spike it rolls back to a
real checkpoint and tries remedies (skip data, scale the LR, skip-step, clip) until one
passes the spike, then trains on to the end. The ledger, every branch's TensorBoard run
and the stitched accepted run go to --log_root (default runs/recover). Interrupted, run
the same command again: it continues from its ledger. See lit_spikes/tools/recover/ (its
__init__ says which file holds what).

    .venv/bin/python scripts/auto_recover.py --compare   # + do-nothing and QK-norm rows
    .venv/bin/python scripts/auto_recover.py --help
"""

from lit_spikes.tools.recover import main

if __name__ == "__main__":
    main()
