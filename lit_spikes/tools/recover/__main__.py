"""``python -m lit_spikes.tools.recover``: the same as ``lit-spikes recover``."""

from lit_spikes.tools.recover.cli import main

main()
