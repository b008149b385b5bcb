"""`make demo`: demos 1, 2 and 3 on the built-in world (see lit_spikes/demo/main_job.py)."""

from lit_spikes.demo.main_job import main

if __name__ == "__main__":
    main()
