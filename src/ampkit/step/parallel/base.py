"""How the engine cooperates with a data-parallel wrapper (DDP, FSDP2) without importing one.

The engine asks a :class:`Parallel` at a few points of the step; the base class is one process
with nothing to do. The adapters for PyTorch's own wrappers are :mod:`.ddp` and :mod:`.fsdp`;
:func:`ampkit.step.parallel.adapter_for` picks one from the model at ``setup()``, as Fabric's
connector picks a strategy.

* ``forward_context(last)``: a context for the forward of a micro-step (DDP: ``no_sync()`` on
  every micro-step but the window's last, so gradients are all-reduced once per optimizer step).
* ``before_backward(last)``: FSDP2 turns gradient reduce-scatter off on non-boundary micro-steps.
* ``before_step(params)``: the window ended early (``step(flush=True)``) after a micro-step that
  did not communicate: DDP all-reduces the gradients now, so every rank steps on the same ones.
* ``use_masters(on)``: a pure precision keeps fp32 masters outside the wrapper's view (DDP then
  averages the masters' gradients itself, once per step).
* ``found_inf_reducer()``: the loss scaler applies it to every fresh ``found_inf`` (an all-reduce
  with max), so all ranks skip the same steps even when their gradients differ (a parameter
  outside the wrapper, a fault on one rank).
* ``retarget(precision)``: after a switch (fallback), FSDP2 moves its all-gather and
  reduce-scatter dtypes to the new precision's.
* ``shards_params``: the parameters are fp32 shards (FSDP2), the masters of a pure precision
  already; the engine keeps no second copy.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

__all__ = ["Parallel", "max_reducer"]


class Parallel:
    """One process: no communication to arrange (the base every adapter extends)."""

    name = "none"
    shards_params = False

    @property
    def world_size(self) -> int:
        return 1

    def forward_context(self, last_micro: bool) -> Optional[AbstractContextManager[None]]:
        """A context for the forward of a micro-step (None: nothing to enter)."""
        return None

    def before_backward(self, last_micro: bool) -> None:
        """Called by ``backward()`` once the micro-step is counted, before the backward pass."""

    def before_step(self, params: list[torch.Tensor]) -> None:
        """Called at the boundary before unscale/clip/step, with the parameters to be stepped."""

    def use_masters(self, on: bool) -> None:
        """The engine keeps fp32 master weights (a pure precision): their gradients are what steps."""

    def found_inf_reducer(self) -> Optional[Callable[[torch.Tensor], None]]:
        """A function that makes a fresh ``found_inf`` the same on every rank, in place (None: one process)."""
        return None

    def retarget(self, precision: Any) -> None:
        """The engine switched to ``precision`` (a fallback): follow it where the wrapper can."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}(world_size={self.world_size})"


def max_reducer(group: Any = None) -> Callable[[torch.Tensor], None]:
    """``f(t)``: ``t`` becomes its maximum over the ranks of ``group``, in place (async on GPU: no host sync)."""

    def reduce(t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)

    return reduce
