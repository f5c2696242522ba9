"""The command line's side of several processes: launch flags, re-launch, wrapping the model.

``ampkit train --nproc_per_node 2 ...`` re-runs itself under torchrun (``ampkit.distributed.launch``);
each worker (``WORLD_SIZE`` > 1) joins the process group, trains on its own device with the
model under DDP (default) or FSDP2 (``--parallel fsdp``); rank 0 alone prints and writes.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, Optional

import torch

from .common import flag, positive_int


def add_flags(p: argparse.ArgumentParser) -> None:
    flag(
        p,
        "nproc_per_node",
        type=positive_int,
        default=None,
        help="run on N processes per node: re-runs this command under torchrun (one per GPU; gloo on CPU)",
    )
    flag(
        p,
        "nnodes",
        default="1",
        help="with --nproc_per_node: number of nodes (or MIN:MAX) (default: 1)",
    )
    flag(p, "node_rank", type=int, default=None, help="with --nnodes > 1: this node's rank")
    flag(
        p,
        "rdzv_endpoint",
        default=None,
        help="with --nnodes > 1: HOST:PORT of the rendezvous (the first node)",
    )
    flag(
        p, "rdzv_id", default=None, help="rendezvous id shared by the job's nodes (default: ampkit)"
    )
    flag(p, "rdzv_backend", default="c10d", help="torchrun rendezvous backend (default: c10d)")
    flag(
        p,
        "parallel",
        default="ddp",
        choices=["ddp", "fsdp"],
        help="with several processes: DistributedDataParallel or FSDP2 fully_shard (default: ddp)",
    )


def maybe_relaunch(args: argparse.Namespace, argv: Sequence[str]) -> Optional[int]:
    """Under ``--nproc_per_node`` in a process torchrun did not start: run torchrun on ``argv`` (the
    command line as typed), return its status."""
    from ..distributed import launched

    if not args.nproc_per_node or launched():
        return None
    if args.checkpoint_dir and str(args.nnodes) == "1" and not (args.resume or args.overwrite):
        # what rank 0 would refuse first, refused before any worker starts (no side effect here:
        # --overwrite's removal and the directory lock stay with rank 0)
        from .rundirs import claim_checkpoint_dir

        claim_checkpoint_dir(args.checkpoint_dir, resume=False, overwrite=False)
    from ..distributed.launch import relaunch

    return relaunch(
        list(argv),
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        rdzv_endpoint=args.rdzv_endpoint,
        rdzv_id=args.rdzv_id,
        rdzv_backend=args.rdzv_backend,
    )


def wrap(
    args: argparse.Namespace, model: torch.nn.Module, precision: Any, device: torch.device
) -> torch.nn.Module:
    """The model under DDP or FSDP2 when this is one of several processes (else ``model`` itself)."""
    from ..distributed import shard, world_size, wrap_ddp

    if world_size() < 2:
        return model
    if args.parallel == "fsdp":
        return shard(model.to(device), precision)
    return wrap_ddp(model, device)
