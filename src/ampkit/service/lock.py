"""One server per data directory: an exclusive ``flock`` on ``<data_dir>/serve.lock``, held for
the server's life (the kernel drops it when the process ends, however it ends).

Two servers on one data directory would each take the other's runs for orphans (a run that
finished 60/60 steps recorded ``failed``, "killed by signal 15", by the other). The second is
refused with :class:`DataDirBusy`, naming the directory and the holder's pid (written into the
lock file). Within one process the lock is counted: an app embedded twice, or ``serve`` and its
app's lifespan, share it. Run processes do not inherit it (their descriptors are closed on exec).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading

__all__ = ["LOCK_FILE", "DataDirBusy", "hold", "release"]

LOCK_FILE = "serve.lock"
_HELD: dict[str, list[int]] = {}  # real path of the data dir -> [fd, holders in this process]
_GUARD = threading.Lock()


class DataDirBusy(OSError):
    """Another server holds the data directory."""


def hold(data_dir: str) -> str:
    """Take (or share, within this process) the data directory's lock; returns the key for
    :func:`release`. Raises :class:`DataDirBusy` when another process holds it."""
    key = os.path.realpath(data_dir)
    with _GUARD:
        if key in _HELD:
            _HELD[key][1] += 1
            return key
        path = os.path.join(key, LOCK_FILE)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _holder(fd)
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            raise DataDirBusy(
                errno.EBUSY,
                f"another ampkit server{holder} is using the data directory {key} "
                f"(it holds {path}); stop it first, or give this server another "
                "--data_dir",
            ) from None
        with contextlib.suppress(
            OSError
        ):  # the pid is for the message; the lock is what counts (a full disk)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _HELD[key] = [fd, 1]
        return key


def release(key: str) -> None:
    """Give back one hold of ``key`` (from :func:`hold`); the last one unlocks."""
    with _GUARD:
        held = _HELD.get(key)
        if held is None:
            return
        held[1] -= 1
        if held[1] <= 0:
            del _HELD[key]
            os.close(held[0])  # closing the descriptor drops the flock


def _holder(fd: int) -> str:
    try:
        pid = int(os.pread(fd, 32, 0).split()[0])
    except (OSError, ValueError, IndexError):
        return ""
    return f" (pid {pid})"
