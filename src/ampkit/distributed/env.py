"""Who am I, how many are we: the process group, set up from torchrun's environment and torn down cleanly.

``torchrun`` (``torch.distributed.run``) sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``; :func:`init` reads them, picks the backend (nccl for CUDA,
gloo for CPU), pins each process to its GPU, and registers :func:`shutdown` so every process
leaves through ``destroy_process_group`` (no abort at interpreter exit).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import datetime
import os
import signal
import sys
from typing import Any, NoReturn, Optional, Union

import torch
import torch.distributed as dist

__all__ = [
    "STATUS_DIR_ENV",
    "abandon",
    "barrier",
    "broadcast_object",
    "die_with_parent",
    "exit_worker",
    "init",
    "is_main",
    "launched",
    "leave",
    "local_device",
    "rank",
    "shutdown",
    "world_size",
]

#: set by ``ampkit train --nproc_per_node`` (:mod:`ampkit.distributed.launch`): a directory where
#: each worker leaves its exit status (``rank<r>``), so the launcher can return the status of the
#: rank that failed first (torchrun itself only says 1).
STATUS_DIR_ENV = "AMPKIT_STATUS_DIR"


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
    dev = (
        torch.device(device)
        if device is not None
        else torch.device("cuda" if torch.cuda.is_available() else "cpu")
    )
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return dev


def init(
    device: Union[str, torch.device, None] = None,
    *,
    backend: Optional[str] = None,
    timeout_s: float = 600.0,
) -> bool:
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
        raise ValueError(
            f"backend={chosen!r} is not a torch.distributed backend; choose one of {', '.join(valid)}"
        )
    die_with_parent(signal.SIGKILL)  # torchrun gone (even by SIGKILL): no orphan keeps training
    dist.init_process_group(chosen, timeout=datetime.timedelta(seconds=timeout_s))
    atexit.register(shutdown)
    return True


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``sig`` to this process when its parent exits (Linux
    ``PR_SET_PDEATHSIG``; elsewhere nothing). If the parent is already gone, exit now."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(sig), 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent == 1 or os.getppid() != parent:  # the parent died before the request took effect
        os._exit(128 + int(sig))


def leave(code: int, *, together: bool) -> None:
    """End this worker's part in the job: record ``code`` for the launcher, then leave the process
    group -- after a barrier when every rank is known to be leaving at the same point
    (``together``: success, or a stop all ranks agreed on), at once otherwise, so a rank that
    failed alone never waits in a barrier its peers will not reach (they see the closed
    connection and fail too, instead of hanging until the process-group timeout)."""
    status_dir = os.environ.get(STATUS_DIR_ENV)
    if status_dir and launched():
        try:
            with open(os.path.join(status_dir, f"rank{os.environ.get('RANK', rank())}"), "w") as f:
                f.write(str(int(code)))
        except OSError:
            pass
    if together:
        shutdown()
    else:
        abandon()


def abandon() -> None:
    """Leave the process group without waiting for the other ranks."""
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(
            Exception
        ):  # tearing down after a failure; the failure is what matters
            dist.destroy_process_group()


def shutdown() -> None:
    """Leave the process group (after a barrier, so no rank tears down while others still talk)."""
    if dist.is_available() and dist.is_initialized():
        try:
            dist.barrier()
        finally:
            dist.destroy_process_group()


def exit_worker(code: int) -> NoReturn:
    """End a worker process that has left its process group: run the ``atexit`` callbacks, flush
    the standard streams, then ``os._exit(code)`` -- skipping only the interpreter's teardown.

    Why: a gloo worker thread can still be releasing the last collective's work (whose tensors
    have Python objects) when the interpreter finalizes; the decref then asks for the GIL, the
    finalizing interpreter ends that thread with ``pthread_exit``, the forced unwind meets a
    ``noexcept`` frame and the process dies of ``std::terminate`` (SIGABRT, "terminate called
    without an active exception") after a run that succeeded -- about 1 launch in 25 on a 2-core
    machine (core dump: ``ProcessGroupGloo::runLoop`` -> ``~AsyncBarrierWork`` ->
    ``gil_scoped_acquire`` -> ``PyThread_exit_thread``; pytorch/pytorch#179291 describes it)."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(int(code))


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
