"""Demo 1: checkpoint at step 100, resume to 400 three ways, against the uninterrupted run."""

from lit_spikes.demo.main_job import main

if __name__ == "__main__":
    main(demos=(1,))
