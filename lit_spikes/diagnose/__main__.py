"""``python -m lit_spikes.diagnose``: the same as ``lit-spikes diagnose``."""

from lit_spikes.diagnose.cli import main

main()
