"""Each run's memory cap: a run that needs more memory than its share fails with "out of memory"
instead of waking the machine's OOM killer (which may pick any process: another run, the server,
another user's shell). Seen: ``POST /v1/recommend {"model": "gpt2"}`` at its default batch of 16
asked 23.7 GB of a 23 GB machine, and the kernel killed processes.

The cap is ``RLIMIT_DATA`` of the run's process (its heap and private writable mappings: what
torch's CPU allocator takes), set by the run's supervisor before it starts the run
(:mod:`ampkit.service.supervise`), so every process the run starts inherits it; an allocation
over it fails in the process that asked (torch: ``RuntimeError: ... can't allocate memory``) and
the run fails with that reason (:func:`explain`). Default: 90% of this machine's memory (or of the
lowest cgroup limit above the server -- its container's, its Slurm job's -- when lower) divided by
``max_concurrent``; ``ampkit serve
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


#: this process's cgroups (``hierarchy:controllers:path`` lines) and where the hierarchies are mounted
_PROC_CGROUP = "/proc/self/cgroup"
_CGROUP_ROOT = "/sys/fs/cgroup"


def _own_limits() -> list[str]:
    """The memory limit files of this process's own cgroup and of each of its ancestors (a cgroup
    below the mount's root: a Slurm job, a systemd slice, a container without a cgroup
    namespace), cgroup v2 and v1."""
    try:
        with open(_PROC_CGROUP, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        hierarchy, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if hierarchy == "0" and not controllers:
            root, name = _CGROUP_ROOT, "memory.max"
        elif "memory" in controllers.split(","):
            root, name = os.path.join(_CGROUP_ROOT, "memory"), "memory.limit_in_bytes"
        else:
            continue
        parts = [p for p in path.split("/") if p and p != ".."]
        out += [os.path.join(root, *parts[:k], name) for k in range(len(parts), 0, -1)]
    return out


def machine_bytes() -> Optional[int]:
    """This machine's memory in bytes, or the lowest cgroup limit above this process (its
    container's, its job's) when lower; None when neither can be read."""
    found = []
    with contextlib.suppress(ValueError, OSError, AttributeError):
        found.append(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    for path in (*_CGROUP_LIMITS, *_own_limits()):
        try:
            with open(path, encoding="ascii") as f:
                text = f.read().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # "max" or a huge number: no limit
            found.append(int(text))
    return min(found) if found else None


#: the default cap's floor (unless the machine has less): the cap counts writable address space,
#: 8 MiB per thread stack included, so a many-core box with a small share would fail every run
FLOOR = 2_000_000_000


def run_cap(run_memory_gb: Optional[float], max_concurrent: int) -> Optional[int]:
    """Each run's cap in bytes: ``run_memory_gb`` when given, else :data:`SHARE` of
    :func:`machine_bytes` over ``max_concurrent`` runs, at least :data:`FLOOR` (or the share of
    the whole machine, when that is less); None when the machine's memory is unknown."""
    if run_memory_gb is not None:
        return int(run_memory_gb * 1e9)
    total = machine_bytes()
    if total is None:
        return None
    return int(max(total * SHARE / max(1, max_concurrent), min(FLOOR, total * SHARE)))


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
