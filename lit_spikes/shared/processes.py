"""The process group's teardown, which every multi-process run needs."""

from __future__ import annotations

import atexit
import functools

import torch


def destroy_process_group() -> None:
    """Tear the process group down, if there is one, before the interpreter does.

    Left to the interpreter's teardown, gloo's threads were destroyed while still
    joinable: ``terminate called without an active exception``, and rank 0 exited with
    -6 after writing everything (seen in this project's DDP tests and CI).
    """
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@functools.cache
def destroy_process_group_at_exit() -> None:
    """Call ``destroy_process_group`` when the interpreter exits (registered once)."""
    atexit.register(destroy_process_group)
