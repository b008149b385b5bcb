"""``python -m lit_spikes.tools.diagnose``: the same as ``lit-spikes diagnose``."""

from lit_spikes.tools.diagnose.cli import main

main()
