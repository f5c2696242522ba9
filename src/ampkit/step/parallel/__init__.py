"""How the engine cooperates with a data-parallel wrapper: :func:`adapter_for` picks the adapter
from the model (:mod:`.base` one process, :mod:`.ddp` DDP, :mod:`.fsdp` FSDP2)."""

from __future__ import annotations

import sys

import torch
from torch.nn.parallel import DistributedDataParallel  # loaded with torch itself: the check is free

from .base import Parallel

__all__ = ["adapter_for"]


def adapter_for(model: torch.nn.Module) -> Parallel:
    """The engine's adapter for ``model``: DDP, FSDP2, or the one-process :class:`~.base.Parallel`.

    FSDP2 is looked for only once ``torch.distributed.fsdp`` has been imported (``fully_shard``
    cannot have been applied otherwise), so ``import ampkit`` never pays for importing it.
    """
    if isinstance(model, DistributedDataParallel):
        from .ddp import DDPParallel

        return DDPParallel(model)
    if "torch.distributed.fsdp" in sys.modules:
        from .fsdp import FSDPParallel

        adapter = FSDPParallel.of(model)
        if adapter is not None:
            return adapter
    return Parallel()
