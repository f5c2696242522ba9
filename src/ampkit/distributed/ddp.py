"""DDP: one gradient all-reduce per optimizer step, and the same gradients on every rank.

While a window accumulates, every micro-step's forward but the last runs under
``DistributedDataParallel.no_sync()``; the last one's backward all-reduces the sum of the
window's gradients (DDP averages over ranks). Every rank then holds the same gradients, so the
engine's finite check, its skip decision and the loss scale agree on every rank without another
collective. The one case where they would not -- ``step(flush=True)`` right after a micro-step
that did not communicate -- is closed by all-reducing the gradients before the step.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ..step.parallel import Parallel
from .env import max_reducer

__all__ = ["DDPParallel", "wrap_ddp"]


class DDPParallel(Parallel):
    """The engine's adapter for a :class:`~torch.nn.parallel.DistributedDataParallel` model."""

    name = "ddp"

    def __init__(self, model: DistributedDataParallel) -> None:
        self._model = model
        self._group = model.process_group
        self._unsynced = False  # the window's last backward ran under no_sync

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self._group)

    def forward_context(self, last_micro: bool) -> Optional[AbstractContextManager[None]]:
        self._unsynced = not last_micro
        return None if last_micro else self._model.no_sync()

    def found_inf_reducer(self) -> Optional[Callable[[torch.Tensor], None]]:
        return max_reducer(self._group)

    def before_step(self, params: list[torch.Tensor]) -> None:
        if not self._unsynced:
            return
        self._unsynced = False
        # A flushed window whose last micro-step skipped the all-reduce: average now, as DDP would.
        n = self.world_size
        for p in params:
            if p.grad is not None:
                p.grad.div_(n)
                dist.all_reduce(p.grad, group=self._group)


def wrap_ddp(model: torch.nn.Module, device: Union[str, torch.device, None] = None, **kwargs: Any
             ) -> DistributedDataParallel:
    """``DistributedDataParallel(model)`` on this process's device (``device_ids`` set for CUDA);
    ``kwargs`` go to DDP (e.g. ``find_unused_parameters=True``)."""
    dev = torch.device(device) if device is not None else next(model.parameters()).device
    model.to(dev)
    if dev.type == "cuda":
        kwargs.setdefault("device_ids", [dev.index if dev.index is not None else torch.cuda.current_device()])
    return DistributedDataParallel(model, **kwargs)
