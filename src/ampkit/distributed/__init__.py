"""Launching and sharding with PyTorch's own distributed engine: DDP, FSDP2, DCP, torchrun, Slurm.

* :func:`init` joins the process group torchrun describes; :func:`rank`, :func:`world_size`,
  :func:`is_main`, :func:`shutdown` (``env``).
* :func:`wrap_ddp` and :func:`shard` (FSDP2 ``fully_shard`` with the precision's
  :func:`fsdp_policy`; ``policy_for`` is its earlier name). ``amp.setup(model, opt)`` then just
  works: the engine picks its own DDP /
  FSDP2 adapter from the model (:func:`ampkit.step.parallel.adapter_for`).
* Sharded checkpoints through ``torch.distributed.checkpoint`` and a single-file export (``dcp``);
  ``ampkit train --nproc_per_node N`` (``launch``) and the sbatch script (``slurm``).
"""

from __future__ import annotations

from .ddp import wrap_ddp
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
from .fsdp import fsdp_modules, fsdp_policy, policy_for, shard

__all__ = [
    "barrier",
    "broadcast_object",
    "fsdp_modules",
    "fsdp_policy",
    "init",
    "is_main",
    "launched",
    "local_device",
    "policy_for",
    "rank",
    "shard",
    "shutdown",
    "world_size",
    "wrap_ddp",
]
