"""Demo 2: find the reference run's spike, then try PaLM's, OPT's and clipping remedies
from the checkpoint before it (and write demo 2's cost ledger for demo 3)."""

from lit_spikes.demo.main_job import main

if __name__ == "__main__":
    main(demos=(2,))
