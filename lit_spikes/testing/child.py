"""The resumed half of a resume check in a new process:
``python -m lit_spikes.testing.child SPEC OUT`` (SPEC: the pickled plan and checkpoint,
written by ``check._resume_in_new_process``; OUT: where its record goes)."""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

import torch

from lit_spikes.testing.check import fit_once


def main(argv: list[str]) -> int:
    spec, out = Path(argv[0]), Path(argv[1])
    plan, ckpt_path, settings = pickle.loads(spec.read_bytes())  # written by the parent
    torch.set_num_threads(settings["num_threads"])
    torch.set_flush_denormal(settings["flush_denormal"])
    record = fit_once(plan, out.parent / "resumed", capture_at=plan.resume_at, ckpt_path=ckpt_path)
    assert record is not None
    torch.save(record.to_dict(), out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
