"""Who am I, how many are we: the process group, set up from torchrun's environment and torn down cleanly.

``torchrun`` (``torch.distributed.run``) sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``; :func:`init` reads them, picks the backend (nccl for CUDA,
gloo for CPU), pins each process to its GPU, and registers :func:`shutdown` so every process
leaves through ``destroy_process_group`` (no abort at interpreter exit).
"""

from __future__ import annotations

import atexit
import datetime
import os
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

__all__ = ["barrier", "broadcast_object", "init", "is_main", "launched", "local_device", "max_reducer", "rank",
           "shutdown", "world_size"]


def launched() -> bool:
    """True when this process was started by torchrun (or Slurm via torchrun) as one of several."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        raise ValueError(f"WORLD_SIZE={os.environ['WORLD_SIZE']!r} is not an integer") from None


def rank() -> int:
    """This process's global rank (0 without a process group)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """Processes in the default group (1 without a process group)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main() -> bool:
    """True on global rank 0, the one process that prints and writes logs."""
    return rank() == 0


def local_device(device: Union[str, torch.device, None]) -> torch.device:
    """``device`` made specific to this process: ``cuda`` becomes ``cuda:LOCAL_RANK``."""
    dev = torch.device(device) if device is not None else torch.device(
        "cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return dev


def init(device: Union[str, torch.device, None] = None, *, backend: Optional[str] = None,
         timeout_s: float = 600.0) -> bool:
    """Join the process group torchrun describes; returns False (and does nothing) in a single
    process. ``backend`` defaults to nccl on CUDA, gloo otherwise. Idempotent."""
    if not launched():
        return False
    if dist.is_initialized():
        return True
    dev = local_device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    chosen = backend or ("nccl" if dev.type == "cuda" else "gloo")
    valid = ("nccl", "gloo", "mpi", "xccl", "ucc")
    if chosen not in valid:
        raise ValueError(f"backend={chosen!r} is not a torch.distributed backend; choose one of {', '.join(valid)}")
    dist.init_process_group(chosen, timeout=datetime.timedelta(seconds=timeout_s))
    atexit.register(shutdown)
    return True


def shutdown() -> None:
    """Leave the process group (after a barrier, so no rank tears down while others still talk)."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def barrier() -> None:
    """Wait for every rank (no-op in one process)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def broadcast_object(obj: Any, src: int = 0) -> Any:
    """``obj`` as rank ``src`` has it, on every rank (itself in one process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def max_reducer(group: Any = None) -> Callable[[torch.Tensor], None]:
    """``f(t)``: ``t`` becomes its maximum over the ranks of ``group``, in place (async on GPU: no host sync)."""

    def reduce(t: torch.Tensor) -> None:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)

    return reduce
