"""The parent of each run's process: it starts the run, waits for it, and writes how it ended.

The runner starts ``python -I -S .../supervise.py LAUNCH EXIT`` (:func:`supervisor_command`) in a
session of its own; ``LAUNCH`` (``launch-N.json``, written by the runner) holds the run's command
line and the run's memory cap, ``{"argv": [...], "memory_bytes": N}`` (``RLIMIT_DATA``, set
before the start and so inherited by the run: :mod:`ampkit.service.memcap`; null: none). The
supervisor starts that command in *another* new session (the run's
process leads its own process group, as before, so the runner's ``killpg`` reaches the run and
everything it started, never the supervisor), inheriting stdin/stdout/stderr, the directory, the
umask and the environment, and writes ``EXIT`` (``exit-N.json``, 0600, replaced atomically):

* right after the start: ``{"supervisor": PID, "pid": RUN_PID, "started": T}``;
* when the run's process has ended: the same plus ``"returncode"`` -- the exit status, or minus the
  signal number that killed it (``subprocess`` convention: ``-9`` is SIGKILL) -- and ``"ended"``;
* when the command could not be started: ``{"supervisor": PID, "returncode": 127, "error": ...}``.

Why: a server restarted while a run goes on watches the run by pid, but is not its parent, so it
cannot learn a killed run's signal by waiting for it; the supervisor is the parent and keeps the
answer on disk for whichever server reads it (:mod:`ampkit.service.runner`).

The supervisor then exits the way the run did (the same code, or the same signal, core dumps off),
so a server that *is* its parent sees the run's status even when the file could not be written (a
full disk). SIGTERM, SIGINT and SIGHUP sent to the supervisor itself are forwarded to the run's
process group (the run stops gracefully, as on a cancel) and the supervisor goes on waiting.

It runs by path with ``-I -S``: it needs only the standard library, and ``-m ampkit...`` would
import the ampkit package (and with it torch) into a process that only waits.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from typing import Any, Optional

__all__ = [
    "SUPERVISOR",
    "exit_path",
    "launch_path",
    "main",
    "read_record",
    "record_pid",
    "supervisor_command",
    "write_private",
]

SUPERVISOR = os.path.abspath(__file__)
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def launch_path(run_dir: str, attempt: int) -> str:
    return os.path.join(run_dir, f"launch-{attempt}.json")


def exit_path(run_dir: str, attempt: int) -> str:
    return os.path.join(run_dir, f"exit-{attempt}.json")


def supervisor_command(run_dir: str, attempt: int) -> list[str]:
    """The command line that runs attempt ``attempt`` of the run in ``run_dir`` under a supervisor."""
    return [
        sys.executable,
        "-I",
        "-S",
        SUPERVISOR,
        launch_path(run_dir, attempt),
        exit_path(run_dir, attempt),
    ]


def read_record(run_dir: str, attempt: int) -> dict[str, Any]:
    """The attempt's exit record (module doc); ``{}`` when there is none (a run started before
    supervisors, or a supervisor killed before it wrote one)."""
    try:
        with open(exit_path(run_dir, attempt), encoding="utf-8") as f:
            record = json.load(f)
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def write_private(path: str, data: bytes) -> None:
    """Write ``path`` atomically (a reader sees the old file or the new one), mode 0600 whatever
    the umask, synced to disk."""
    tmp = f"{path}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        try:
            os.fchmod(fd, 0o600)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError:  # a full disk: no half-written temporary file left behind
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _say(message: str) -> None:
    """``message`` on stderr, unbuffered: on a full disk the write fails and nothing is left to flush
    at exit (which would change the exit status to 120)."""
    with contextlib.suppress(OSError):
        os.write(2, f"ampkit supervisor: {message}\n".encode(errors="backslashreplace"))


def _record(path: str, record: dict[str, Any]) -> bool:
    try:
        write_private(path, json.dumps(record).encode())
        return True
    except (
        OSError
    ) as e:  # a full disk: the exit status still reaches a parent server (the module doc)
        _say(f"cannot write {path}: {type(e).__name__}: {e}")
        return False


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        _say("usage: supervise.py LAUNCH_JSON EXIT_JSON")
        return 2
    launch, out = argv
    record: dict[str, Any] = {"supervisor": os.getpid()}
    try:
        with open(launch, encoding="utf-8") as f:
            spec = json.load(f)
        cmd, cap = spec["argv"], spec.get("memory_bytes")
        if cap is not None:  # the run's memory cap (ampkit.service.memcap), inherited by the run
            import resource

            resource.setrlimit(resource.RLIMIT_DATA, (int(cap), int(cap)))
            record["memory_bytes"] = int(cap)
        child = subprocess.Popen(cmd, start_new_session=True)
    except Exception as e:  # an unreadable launch file, a command that cannot start
        error = f"{type(e).__name__}: {e}"
        _say(f"cannot start the run: {error}")
        _record(out, {**record, "returncode": 127, "error": error, "ended": time.time()})
        return 127
    record.update(pid=child.pid, started=time.time())
    if not _record(
        out, record
    ):  # nobody could learn the run's pid: do not leave it running unwatched
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        return 127

    def forward(signum: int, frame: Any) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signum)

    for sig in _FORWARDED:
        signal.signal(sig, forward)
    rc = child.wait()  # retried after a forwarded signal (PEP 475)
    record.update(returncode=rc, ended=time.time())
    _record(out, record)
    return _exit_like(rc)


def _exit_like(rc: int) -> int:
    """Exit with ``rc``; for a run killed by a signal, die of the same signal (without a core dump)."""
    if rc >= 0:
        return rc
    sig = -rc
    with contextlib.suppress(Exception):
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    with contextlib.suppress(OSError, ValueError):
        signal.signal(sig, signal.SIG_DFL)
    with contextlib.suppress(OSError):
        os.kill(os.getpid(), sig)
        time.sleep(
            1
        )  # delivery is asynchronous; a signal that does not end a process falls through
    return 128 + sig


def record_pid(record: dict[str, Any], key: str) -> Optional[int]:
    """``record[key]`` when it is a pid (a positive int), else None."""
    value = record.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
