"""``python -m lit_spikes.recover``: the same as ``lit-spikes recover``."""

from lit_spikes.recover.cli import main

main()
