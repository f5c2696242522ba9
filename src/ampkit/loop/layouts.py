"""Which process layout wrote a directory's checkpoints: a run never takes the other layout's
checkpoints for "no checkpoint" (and starts fresh beside them), nor steps back past them.

A one-process run writes single-file checkpoints (``ckpt-00000500.pt``), a run of several
processes sharded ones (``ckpt-00000500/``, :mod:`ampkit.distributed.dcp`); neither reads the other
kind, so a resume that finds only (or newer) checkpoints of the other kind refuses, naming them and
how to go on.
"""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["other_layout"]


def other_layout(
    directory: str, own: list[tuple[int, str]], every: list[tuple[int, str]]
) -> Optional[str]:
    """Why a run cannot resume from ``directory`` when its newest checkpoint is of the other layout
    (``every`` minus ``own``, both ``(step, path)`` oldest first: a multi-process run's sharded
    directories to a one-process run, a one-process run's files to a multi-process one), or None."""
    from ..distributed import dcp

    other = [c for c in every if c not in own]
    if not other or (own and own[-1][0] >= other[-1][0]):
        return None
    step, newest = other[-1]
    name = os.path.basename(newest)
    if own:
        what = (
            f"the newest checkpoint in {directory!r}, {name} (step {step}), is newer than the "
            f"newest this run can read, {os.path.basename(own[-1][1])} (resuming from that one "
            "would go back); it"
        )
    else:
        what = f"the checkpoints in {directory!r} (newest: {name}, step {step})"
    if os.path.isdir(newest):
        n = dcp.writers(newest)
        procs = str(n) if n > 1 else "several"
        return (
            f"{what} {'was' if own else 'were'} written by a sharded (multi-process) run of "
            f"{procs} processes, which this one-process run does not read; nothing was loaded. "
            f"Resume with {procs} processes (--nproc_per_node {n if n > 1 else 'N'}), or turn it "
            f"into one file first: ampkit export {newest} {newest}.pt"
        )
    return (
        f"{what} {'is a' if own else 'are'} single-file checkpoint{'' if own else 's'}, written by a "
        "one-process run, which this run of several processes does not read (it reads sharded "
        "ckpt-NNNNNNNN/ directories); nothing was loaded. Resume with one process, or start "
        "this run afresh in another checkpoint directory"
    )
