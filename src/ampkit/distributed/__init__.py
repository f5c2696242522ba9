"""PyTorch's own distributed engine under the mixed-precision step: DDP, FSDP2, DCP, torchrun, Slurm.

* :func:`init` joins the process group torchrun describes; :func:`rank`, :func:`world_size`,
  :func:`is_main`, :func:`shutdown` (``env``).
* ``amp.setup(DistributedDataParallel(model), opt)`` and ``amp.setup(shard(model, "bf16"), opt)``
  just work: :func:`adapter_for` gives the engine a :class:`DDPParallel` or :class:`FSDPParallel`
  (``ddp``, ``fsdp``) -- ``no_sync`` / ``set_requires_gradient_sync`` while accumulating, the
  same skip decisions and scale on every rank, clipping over sharded gradients.
* Sharded checkpoints through ``torch.distributed.checkpoint`` and a single-file export (``dcp``);
  ``ampkit train --nproc_per_node N`` (``launch``) and the sbatch script (``slurm``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.nn.parallel import DistributedDataParallel

from ..step.parallel import Parallel
from . import fsdp as _fsdp
from .ddp import DDPParallel, wrap_ddp
from .env import (
    barrier,
    broadcast_object,
    init,
    is_main,
    launched,
    local_device,
    rank,
    shutdown,
    world_size,
)
from .fsdp import FSDPParallel, fsdp_modules, policy_for, shard

__all__ = [
    "DDPParallel", "FSDPParallel", "Parallel", "adapter_for", "barrier", "broadcast_object", "fsdp_modules",
    "init", "is_main", "launched", "local_device", "policy_for", "rank", "shard", "shutdown", "world_size",
    "wrap_ddp",
]


def adapter_for(model: torch.nn.Module) -> Optional[Parallel]:
    """The engine's adapter for ``model``: DDP, FSDP2, or None for a plain module."""
    if isinstance(model, DistributedDataParallel):
        return DDPParallel(model)
    return _fsdp.adapter(model)
