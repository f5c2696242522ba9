"""Wrapping a model in DDP on this process's device.

The engine's DDP cooperation (``no_sync`` while accumulating, the masters' all-reduce for pure
precisions, the same skip decisions on every rank) is its adapter,
:class:`ampkit.step.parallel.ddp.DDPParallel`, picked from the model at ``amp.setup``.
"""

from __future__ import annotations

from typing import Any, Union

import torch
from torch.nn.parallel import DistributedDataParallel

__all__ = ["wrap_ddp"]


def wrap_ddp(
    model: torch.nn.Module, device: Union[str, torch.device, None] = None, **kwargs: Any
) -> DistributedDataParallel:
    """``DistributedDataParallel(model)`` on this process's device (``device_ids`` set for CUDA);
    ``kwargs`` go to DDP (e.g. ``find_unused_parameters=True``)."""
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    model.to(dev)
    if dev.type == "cuda":
        kwargs.setdefault(
            "device_ids", [dev.index if dev.index is not None else torch.cuda.current_device()]
        )
    return DistributedDataParallel(model, **kwargs)
