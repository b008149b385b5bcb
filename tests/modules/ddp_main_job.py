"""``python -m tests.modules.ddp_main_job ROOT``: the reduced-size main job under DDP with 2
processes. Lightning starts this same command again for rank 1 (tests/demo/test_demos.py)."""

import sys
from pathlib import Path

from lit_spikes.demo.main_job import run_main_job
from tests.modules.demo_setup import tiny_setup

if __name__ == "__main__":
    setup = tiny_setup(Path(sys.argv[1]))
    setup.trainer_kwargs = {"devices": 2, "strategy": "ddp"}
    result = run_main_job(setup)
    if result.demo1 is not None:
        print(f"exact-resume-diff={result.demo1.rows[1].max_param_diff}")
        print(f"exact-losses-equal={result.demo1.exact_losses_equal}")
    if result.demo2 is not None:
        print(f"onset={result.demo2.plan.onset} ckpt={result.demo2.plan.ckpt_step}")
