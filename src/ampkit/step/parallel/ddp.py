"""DDP: one gradient all-reduce per optimizer step, and the same gradients on every rank.

While a window accumulates, every micro-step's forward but the last runs under
``DistributedDataParallel.no_sync()``; the last one's backward all-reduces the sum of the
window's gradients (DDP averages over ranks). Every rank then holds the same gradients, so the
engine's finite check, its skip decision and the loss scale agree on every rank without another
collective. The one case where they would not -- ``step(flush=True)`` right after a micro-step
that did not communicate -- is closed by all-reducing the gradients before the step.

Pure precisions (``bf16-pure``, ``fp16-pure``) cast the parameters to the half dtype after DDP
has laid out its fp32 gradient buckets, and step fp32 master weights DDP never sees. There
every micro-step runs under ``no_sync()`` and the adapter averages the masters' fp32 gradients
itself at the boundary (one flat all-reduce): one communication per optimizer step, in fp32.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Callable, Optional

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.nn.parallel import DistributedDataParallel

from .base import Parallel, max_reducer

__all__ = ["DDPParallel"]


class DDPParallel(Parallel):
    """The engine's adapter for a :class:`~torch.nn.parallel.DistributedDataParallel` model."""

    name = "ddp"

    def __init__(self, model: DistributedDataParallel) -> None:
        self._model = model
        self._group = model.process_group
        self._unsynced = False  # the window's last backward ran under no_sync
        self._manual = False  # pure precisions: the fp32 masters' gradients are averaged here

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self._group)

    def use_masters(self, on: bool) -> None:
        self._manual = on

    def forward_context(self, last_micro: bool) -> Optional[AbstractContextManager[None]]:
        self._unsynced = self._manual or not last_micro
        return None if last_micro and not self._manual else self._model.no_sync()

    def found_inf_reducer(self) -> Optional[Callable[[torch.Tensor], None]]:
        return max_reducer(self._group)

    def before_step(self, params: list[torch.Tensor]) -> None:
        if not self._unsynced:
            return
        self._unsynced = False
        # The masters' gradients (pure precisions), or a flushed window whose last micro-step
        # skipped DDP's all-reduce: average them now, in one flat all-reduce per dtype.
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            if p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = _flatten_dense_tensors(grads).div_(self.world_size)
            dist.all_reduce(flat, group=self._group)
            torch._foreach_copy_(grads, list(_unflatten_dense_tensors(flat, grads)))
