"""A callback that kills its own process at a global step named by an environment
variable: given on the command line of every run of a requeue test, so that the run's
record (config.yaml) is the same for the uninterrupted run and the killed one; only the
killed run's first start has the variable (its requeue gets the callback back from the
record, and trains on)."""

from __future__ import annotations

import os
import signal
from typing import Any

from lightning.pytorch.callbacks import Callback

KILL_AT = "LIT_SPIKES_TEST_KILL_AT"
"""``<step>`` or ``<step>:<signal name>`` (default SIGKILL)."""


class KillAtStep(Callback):
    """Sends its own process the signal of ``$LIT_SPIKES_TEST_KILL_AT`` at the start of
    that global step; does nothing without the variable."""

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        step, _, name = os.environ.get(KILL_AT, "").partition(":")
        if step and trainer.global_step == int(step):
            os.kill(os.getpid(), getattr(signal, name or "SIGKILL"))
