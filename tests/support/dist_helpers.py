"""Run a function on N real processes joined by a gloo process group (CPU), and collect results.

``run_ranks(fn, *args)`` spawns ``world`` processes (``torch.multiprocessing``, start method
``spawn``), each with torchrun's environment variables, a gloo group, one intra-op thread; ``fn``
must be a module-level function ``fn(rank, world, *args)``; its return value comes back per rank.
"""

from __future__ import annotations

import os
import socket
import tempfile
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(
    rank: int,
    world: int,
    port: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    out: str,
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        result = fn(rank, world, *args, **kwargs)
        torch.save(result, os.path.join(out, f"rank{rank}.pt"))
        # No rank tears its group down while another still talks to it: without this barrier gloo
        # sometimes aborts a process at exit ("terminate called without an active exception"), as
        # ampkit.distributed.shutdown() avoids for `ampkit train --nproc_per_node`.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], *args: Any, world: int = 2, **kwargs: Any) -> list[Any]:
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(_entry, args=(world, free_port(), fn, args, kwargs, out), nprocs=world, join=True)
        return [
            torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(world)
        ]
