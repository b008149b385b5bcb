"""The loop's processes: one, or several under DDP that every branch's Trainer shares,
and how rank 0's decisions reach the others."""

from __future__ import annotations

import pickle
from typing import Any, TypeVar

from lit_spikes.shared.processes import destroy_process_group
from lit_spikes.tools.recover.config import RecoverConfig

_T = TypeVar("_T")


def round_trips(value: Any) -> bool:
    """Whether ``value`` survives pickling there and back (to reach the other ranks)."""
    try:
        pickle.loads(pickle.dumps(value))
    except Exception:
        return False
    return True


class RankZeroStopped(RuntimeError):
    """Raised on the other ranks when rank 0 stopped the loop (an error or a signal):
    rank 0 reports it; the command exits 0 on the other ranks."""


class Ranks:
    """The loop's processes. One: rank 0 of 1. Several (``config.world_size > 1``): they
    are started here, before the loop reads or writes a file, through Lightning Fabric's
    launcher (it runs this same command again for the other local ranks, as the Trainer's
    DDP strategy does; under ``torchrun`` or SLURM they exist already), and joined in one
    process group that every branch's Trainer then reuses."""

    def __init__(self, config: RecoverConfig) -> None:
        self.fabric: Any = None
        if config.world_size > 1:
            from lightning.fabric import Fabric

            self.fabric = Fabric(
                accelerator="cpu",
                devices=config.devices,
                num_nodes=config.num_nodes,
                strategy="ddp",
            )
            self.fabric.launch()

    @property
    def leader(self) -> bool:
        return self.fabric is None or self.fabric.global_rank == 0

    def from_leader(self, value: _T) -> _T:
        """Rank 0's ``value``, on every rank."""
        if self.fabric is None:
            return value
        shared: _T = self.fabric.broadcast(value, src=0)
        return shared

    def close(self) -> None:
        """Tear the process group down now, not at exit (``destroy_process_group``)."""
        if self.fabric is not None:
            destroy_process_group()
