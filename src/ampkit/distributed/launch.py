"""``ampkit train --nproc_per_node N``: re-run the same command under ``torch.distributed.run``.

The launcher is PyTorch's own (torchrun): this module only turns ampkit's flags into its
command line -- ``python -m torch.distributed.run --nproc_per_node N [--nnodes M --node_rank R
--rdzv_backend c10d --rdzv_endpoint HOST:PORT --rdzv_id ID | --standalone] -m ampkit <argv>`` --
with the launch flags removed from ``argv`` (so the workers do not launch again), waits for it,
and returns its exit status. One node without an endpoint uses ``--standalone`` (a free local port).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from typing import Optional

__all__ = ["LAUNCH_FLAGS", "relaunch", "strip_flags", "torchrun_command"]

#: ampkit's launch flags (each takes a value); they are torchrun's own names
LAUNCH_FLAGS = ("nproc_per_node", "nnodes", "node_rank", "rdzv_endpoint", "rdzv_id", "rdzv_backend")


def strip_flags(argv: Sequence[str], names: Sequence[str] = LAUNCH_FLAGS) -> list[str]:
    """``argv`` without ``--name VALUE`` / ``--name=VALUE`` (underscore or hyphen spelling) for ``names``."""
    spellings = {f"--{n}" for n in names} | {f"--{n.replace('_', '-')}" for n in names}
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        head = a.split("=", 1)[0]
        if head in spellings:
            skip = "=" not in a
            continue
        out.append(a)
    return out


def torchrun_command(argv: Sequence[str], *, nproc_per_node: int, nnodes: str = "1", node_rank: Optional[int] = None,
                     rdzv_endpoint: Optional[str] = None, rdzv_id: Optional[str] = None,
                     rdzv_backend: str = "c10d") -> list[str]:
    """The torchrun command line that runs ``ampkit <argv>`` on ``nproc_per_node`` processes per node."""
    if nproc_per_node < 1:
        raise ValueError(f"--nproc_per_node {nproc_per_node} must be >= 1")
    multi_node = str(nnodes) not in ("1", "1:1")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc_per_node}", f"--nnodes={nnodes}"]
    if rdzv_endpoint:
        cmd += [f"--rdzv_backend={rdzv_backend}", f"--rdzv_endpoint={rdzv_endpoint}", f"--rdzv_id={rdzv_id or 'ampkit'}"]
    elif multi_node:
        raise ValueError(f"--nnodes {nnodes} needs --rdzv_endpoint HOST:PORT (a port on the first node, "
                         "reachable from every node)")
    else:
        cmd.append("--standalone")
    if node_rank is not None:
        cmd.append(f"--node_rank={node_rank}")
    return [*cmd, "-m", "ampkit", *strip_flags(argv)]


def relaunch(argv: Sequence[str], **kwargs: object) -> int:
    """Run :func:`torchrun_command` and return its exit status (the workers' worst)."""
    return subprocess.run(torchrun_command(argv, **kwargs)).returncode  # type: ignore[arg-type]
