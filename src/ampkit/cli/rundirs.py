"""A run's directories, checked before training starts: one clear line instead of a traceback.

``--log_dir`` and ``--checkpoint_dir`` must be directories this process can create and write;
each is locked for the run (a second run on the same directory is refused); a checkpoint
directory that already holds another run's checkpoints is refused unless ``--resume`` continues
that run or ``--overwrite`` replaces it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Optional

from ..distributed import is_main
from ..loop.checkpoint import DirLock, list_checkpoints

__all__ = ["RUNS", "RunDir", "RunDirError", "check_writable", "claim_checkpoint_dir", "prepare_dir"]


class RunDirError(ValueError):
    """A run directory that cannot be used; the message names the flag and the reason."""


def prepare_dir(path: str, flag: str) -> DirLock:
    """Create ``path`` if needed, prove it writable (a synced probe file) and lock it for this run."""
    check_writable(path, flag)
    return DirLock(path, what=flag).acquire()


def check_writable(path: str, flag: str) -> None:
    """Create ``path`` if needed and prove it writable (a synced probe file); no lock."""
    if os.path.exists(path) and not os.path.isdir(path):
        raise RunDirError(f"{flag} {path!r} is a file, not a directory; choose a directory")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise RunDirError(f"{flag} {path!r} cannot be created: {e.strerror or e}") from None
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".ampkit-probe-") as f:
            f.write(b"ampkit")
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise RunDirError(f"{flag} {path!r} is not writable: {e.strerror or e}") from None


def claim_checkpoint_dir(path: str, *, resume: bool, overwrite: bool) -> None:
    """Refuse to start a new run over another run's checkpoints (or remove them with ``overwrite``)."""
    existing = list_checkpoints(path)  # single-file (ckpt-N.pt) and sharded (ckpt-N/) alike
    if not existing or resume:
        return
    if not overwrite:
        names = ", ".join(os.path.basename(p) for _, p in existing[-3:])
        raise RunDirError(
            f"--checkpoint_dir {path!r} already holds {len(existing)} checkpoint(s) of another run "
            f"({names}); pass --resume to continue that run, --overwrite to replace it, or choose "
            "another directory"
        )
    for _, p in existing:
        if os.path.isdir(p):
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)


RUNS = "runs"  # where runs go without --log_dir


@dataclass
class RunDir:
    """The run's log directory: ``--log_dir``, or ``runs/<stamp>-<precision>`` once the precision
    that runs is known (after ``auto``'s measurement and a resume), then created and locked."""

    given: Optional[str]
    stamp: str
    locks: list[Any]

    def settle(self, precision: str) -> str:
        """The directory for ``precision`` as the header spells it, with a ladder rung
        (``bf16-pure:stochastic+bf16``): its colon is written ``+`` in the name
        (``runs/<stamp>-bf16-pure+stochastic+bf16``), a colon being no file name character on
        Windows and ``host:path`` to scp and rsync; a plain rung is the precision alone."""
        if self.given is not None:
            return self.given
        path = os.path.join(RUNS, f"{self.stamp}-{precision.replace(':', '+')}")
        if is_main():
            self.locks.append(prepare_dir(path, "--log_dir"))
        return path
