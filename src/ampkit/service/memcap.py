"""Each run's memory cap: a run that needs more memory than its share fails with "out of memory"
instead of waking the machine's OOM killer (which may pick any process: another run, the server,
another user's shell). Seen: ``POST /v1/recommend {"model": "gpt2"}`` at its default batch of 16
asked 23.7 GB of a 23 GB machine, and the kernel killed processes.

The cap is ``RLIMIT_DATA`` of the run's process (its heap and private writable mappings: what
torch's CPU allocator takes), set by the run's supervisor before it starts the run
(:mod:`ampkit.service.supervise`), so every process the run starts inherits it; an allocation
over it fails in the process that asked (torch: ``RuntimeError: ... can't allocate memory``) and
the run fails with that reason (:func:`explain`). Default: 90% of this machine's memory (or of the
container's cgroup limit, when lower) divided by ``max_concurrent``; ``ampkit serve
--run_memory_gb`` sets it. GPU memory is not capped here (the CUDA allocator has its own limit).
"""

from __future__ import annotations

import contextlib
import os
from typing import Optional

__all__ = ["explain", "machine_bytes", "run_cap"]

#: the share of the machine's memory the runs may take together, by default
SHARE = 0.9
_CGROUP_LIMITS = (
    "/sys/fs/cgroup/memory.max",  # cgroup v2
    "/sys/fs/cgroup/memory/memory.limit_in_bytes",  # cgroup v1
)


def machine_bytes() -> Optional[int]:
    """This machine's memory in bytes, or the container's cgroup limit when lower; None when
    neither can be read."""
    found = []
    with contextlib.suppress(ValueError, OSError, AttributeError):
        found.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    for path in _CGROUP_LIMITS:
        try:
            with open(path, encoding="ascii") as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # "max" or a huge number: no limit
            found.append(int(text))
    return min(found) if found else None


def run_cap(run_memory_gb: Optional[float], max_concurrent: int) -> Optional[int]:
    """Each run's cap in bytes: ``run_memory_gb`` when given, else :data:`SHARE` of
    :func:`machine_bytes` over ``max_concurrent`` runs; None when the machine's memory is
    unknown."""
    if run_memory_gb is not None:
        return int(run_memory_gb * 1e9)
    total = machine_bytes()
    return None if total is None else int(total * SHARE / max(1, max_concurrent))


#: what a process says when an allocation fails
_SIGNS = ("can't allocate memory", "MemoryError", "Cannot allocate memory", "std::bad_alloc")


def explain(error: Optional[str], cap: Optional[int]) -> Optional[str]:
    """``error`` (a failed run's reason) with the cap named when it reads as an allocation that
    failed under it."""
    if not error or cap is None or not any(s in error for s in _SIGNS):
        return error
    return (
        f"out of memory: the run needed more than this server's per-run cap of {cap / 1e9:.1f} GB "
        "(ampkit serve --run_memory_gb; the default is 90% of the machine's memory over "
        f"--max_concurrent); a smaller batch_size or model fits. {error}"
    )
