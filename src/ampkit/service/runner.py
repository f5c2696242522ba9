"""Runs as processes: each run is ``python -m ampkit train --config run.toml --json ...`` in its
own process group (``start_new_session``), with its log and checkpoint directories under the run's
directory (``run.toml``: :mod:`ampkit.service.runfile`, written when the run was accepted). Its
parent is a small supervisor (:mod:`ampkit.service.supervise`, in a session of its own) that
writes how the run ended (exit code or signal) to ``exit-N.json`` in the run's directory; the
run's ``pid`` is the training process's, which leads the run's process group.

A scheduler thread ticks every ``poll_s``: it finishes runs whose process exited (the JSON
summary on stdout; status ``succeeded`` or ``failed``), kills runs past their ``max_seconds``
(``failed``, error ``timeout``), and starts queued runs up to ``max_concurrent``. Cancelling
kills the whole process group (SIGTERM, SIGKILL after 2 s). Status changes are compare-and-set
in SQLite, so a cancel and a finish cannot overwrite each other.

Restart safety: on start, a ``running`` row whose process is still alive (checked by pid *and*
its command line naming the run's directory) is re-adopted and watched by pid; when it ends, its
supervisor's exit record says how, so a re-adopted run killed by a signal fails with ``killed by
signal N (SIGNAME)`` like a run this server started. One whose process is gone is judged by what it
left: a complete JSON summary of its attempt (or a clean exit) makes it ``succeeded`` (or
``failed``, if the summary says so) with that summary; an exit status without a summary fails it,
as a running server would -- except a signal, and a run with no exit record at all: those are
``interrupted`` (resumable from their last checkpoint), the signal named in the error. When the
supervisor itself was killed, the run's process goes on and is watched by pid; if it then ends
without a summary the run fails with ``ended, exit status unknown``.

A run's process handle is kept until the database says how it ended: when that write fails (a
full disk), the next tick tries again, so a run whose process ended is never left ``running``.
Nothing raised in a tick ends the scheduler thread -- not a failed write, not a log line that
cannot be written to a full disk (:func:`_report` never raises); ``scheduler()`` says whether it
is alive, for ``/health``. A run whose row cannot be set ``running`` is stopped again (it stays
queued and is started once, later), and a run file that is cut short or changed fails its run
before anything starts (:func:`ampkit.service.runfile.check_run_file`).
A process killed by a signal fails its run with ``killed by signal N (SIGNAME)``. Runs and their
files are private: the process starts with umask 077 (files 0600, directories 0700). While a
device is over ``max_gpu_temp`` no queued run starts (:class:`ampkit.service.gpu.TempHold`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Optional

from .gpu import TempHold
from .memcap import explain
from .runfile import RUN_FILE, check_run_file, private_dir, write_run_file
from .store import Store
from .supervise import (
    exit_path,
    launch_path,
    read_record,
    record_pid,
    supervisor_command,
    write_private,
)

__all__ = ["Runner", "command_for", "read_log"]

TERMINAL = ("succeeded", "failed", "cancelled", "interrupted")
STALL_S = 300.0  # a scheduler that has not finished a tick for this long is reported not alive


def command_for(run: dict[str, Any]) -> list[str]:
    """The command line of a run, writing into ``run['run_dir']``. A training run reads everything
    about itself from its ``run.toml`` (:mod:`ampkit.service.runfile`); the command line holds only
    what is the same for every run or changes per attempt: the file, JSON output, the attempt's log
    directory, the checkpoint directory and ``--resume``."""
    spec, d = run["spec"], run["run_dir"]
    base = [sys.executable, "-m", "ampkit"]
    if run["kind"] == "recommend":
        return [
            *base,
            "tune",
            "--model",
            spec["model"],
            "--size",
            spec["size"],
            "--device",
            spec["device"],
            "--batch_size",
            str(spec["batch_size"]),
            "--steps",
            str(spec["steps"]),
            "--repeats",
            "2",
            "--warmup",
            "2",
            "--precisions",
            spec["precisions"],
            "--json",
            "--out",
            os.path.join(d, "tune.toml"),
        ]
    attempt = int(run.get("resumes") or 0)
    cmd = [
        *base,
        "train",
        "--config",
        os.path.join(d, RUN_FILE),
        "--json",
        "--log_dir",
        os.path.join(d, f"log-{attempt}"),
        "--checkpoint_dir",
        os.path.join(d, "ckpt"),
    ]
    return [*cmd, "--resume"] if attempt else cmd


def read_log(run_dir: str) -> list[str]:
    """Complete JSONL lines of every attempt's log (``log-<n>/``), in order: a line still being
    written is left out, and so is a damaged one -- not UTF-8, or not a JSON object (a write torn
    by a full disk, a bad block) --, so that one bad line never makes the run's routes fail."""
    out: list[str] = []
    attempts = (
        sorted(
            (n for n in os.listdir(run_dir) if n.startswith("log-") and n[4:].isdigit()),
            key=lambda n: int(n[4:]),
        )
        if os.path.isdir(run_dir)
        else []
    )
    for name in attempts:
        try:
            with open(os.path.join(run_dir, name, "log.jsonl"), "rb") as f:
                data = f.read()
        except OSError:
            continue
        for raw in data.split(b"\n")[:-1]:  # the last piece has no newline yet (or is empty)
            if raw.strip() and (line := _record_line(raw)) is not None:
                out.append(line)
    return out


def _record_line(raw: bytes) -> Optional[str]:
    """``raw`` as text when it is one JSON object, else None (a damaged line)."""
    try:
        line = raw.decode("utf-8")
        return line if isinstance(json.loads(line), dict) else None
    except ValueError:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None


def _alive(pid: Optional[int], run_dir: str) -> bool:
    """Is ``pid`` a live process of this run (not a recycled pid)?"""
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().decode(errors="replace")
        with open(f"/proc/{pid}/stat", "rb") as f:
            if f.read().split(b")")[-1].split()[0] == b"Z":
                return False  # a zombie has exited
    except OSError:
        return False
    return run_dir in cmdline


def _kill_group(pid: int, grace_s: float = 2.0) -> None:
    """SIGTERM the process group led by ``pid``, then SIGKILL whatever is left after ``grace_s`` (and
    wait up to 2 s more for it to go: a killed process takes a moment to exit)."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 2.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        end = time.monotonic() + wait
        while time.monotonic() < end:
            try:
                os.killpg(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.05)


class Runner:
    """Starts, watches, times out and cancels runs (module doc)."""

    def __init__(
        self,
        store: Store,
        *,
        max_concurrent: int = 1,
        poll_s: float = 0.2,
        max_gpu_temp: Optional[float] = None,
        read_temps: Optional[Callable[[], list[float]]] = None,
        memory_cap: Optional[int] = None,
    ) -> None:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent={max_concurrent} must be >= 1")
        self.store, self.max_concurrent, self.poll_s = store, max_concurrent, poll_s
        self.hold = TempHold(max_gpu_temp, read_temps)
        self.memory_cap = memory_cap  # bytes per run (service.memcap), applied by its supervisor
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._adopted: dict[str, int] = {}
        self.unrecorded: dict[
            str, dict[str, Any]
        ] = {}  # run id -> how it ended, while the database is full
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ampkit-runner", daemon=True)
        self.heartbeat: Optional[float] = None  # time.time() of the scheduler's last tick
        self.last_error: Optional[str] = None  # the last tick's error, None once a tick succeeds
        self._noted: Optional[str] = None  # an error this tick handled (and retries next tick)

    def start(self) -> None:
        self.recover()
        self.heartbeat = time.time()
        self._thread.start()

    def stop(self) -> None:
        """Stop watching (runs keep going: a restarted server re-adopts them)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def recover(self) -> None:
        for run in self.store.list(status="running", limit=1_000_000):
            ended, rc = _outcome(run)
            if not ended:
                self._adopted[run["id"]] = run["pid"]
            elif (rc is not None and rc >= 0) or _summary(
                run
            ) is not None:  # it ended while the server was down
                self._finish(run["id"], rc)
            else:
                why = (
                    f"killed by signal {-rc} ({_signame(-rc)}) while the server was stopped"
                    if rc is not None
                    else "the server stopped while this run was running"
                )
                self.store.update(
                    run["id"],
                    expect=("running",),
                    status="interrupted",
                    ended=time.time(),
                    error=f"{why}; POST /v1/runs/{run['id']}/resume continues it from its last "
                    "checkpoint",
                )

    def _loop(self) -> None:
        """Tick until stopped. Nothing raised in a tick ends the loop (a full disk, a locked
        database, a log that cannot be written): the error is reported and the next tick retries."""
        while not self._stop.is_set():
            try:
                self._noted = None
                self.tick()
                self.last_error = (
                    self._noted
                )  # an error the tick handled itself (a write it retries)
            except BaseException as e:  # noqa: BLE001 - the scheduler outlives any one tick
                self.last_error = f"{type(e).__name__}: {e}"[:500]
                _report(f"scheduler error (next tick retries): {self.last_error}")
            self.heartbeat = time.time()
            self._stop.wait(self.poll_s)

    def scheduler(self) -> dict[str, Any]:
        """The scheduler's state for ``/health``: ``alive`` (its thread runs and has ticked within
        ``STALL_S``: a tick may wait seconds for a run's process to start, never minutes), the
        seconds since its last tick, and the last tick's error (None once a tick succeeds)."""
        age = None if self.heartbeat is None else round(time.time() - self.heartbeat, 3)
        alive = self._thread.is_alive() and age is not None and age < STALL_S
        return {"alive": alive, "last_tick_s_ago": age, "error": self.last_error}

    def tick(self) -> None:
        with self._lock:
            for run_id, proc in list(self._procs.items()):
                if proc.poll() is not None:  # the supervisor has ended
                    self._settle(run_id, proc.returncode)
            for run_id in list(self._adopted):
                self._settle(run_id, None)
            now = time.time()
            for run in self.store.list(status="running", limit=1_000_000):
                limit = run["spec"].get("max_seconds")
                over = limit and run["started"] and now - run["started"] > limit
                if over and self.store.update(
                    run["id"],
                    expect=("running",),
                    status="failed",
                    ended=now,
                    error=f"timeout: still running after max_seconds={limit}",
                ):
                    self._kill(run["id"], run["pid"])
            running = len(self._procs) + len(self._adopted)
            if running < self.max_concurrent and not self.hold.held():
                queued = sorted(
                    self.store.list(status="queued", limit=1_000_000), key=lambda r: r["created"]
                )
                for run in queued[: self.max_concurrent - running]:
                    self._launch_or_fail(run)

    def _settle(self, run_id: str, supervisor_rc: Optional[int]) -> None:
        """Record the end of a watched run whose process (or supervisor) has ended. The exit record
        says how it ended; without one, the supervisor's own status (it exits the way the run did)
        when this server is its parent. A supervisor killed while the run goes on: the run is
        watched by pid from then on. Forgotten only once the database says how it ended."""
        run = self.store.get(run_id)
        ended, rc = (True, None) if run is None else _outcome(run)
        if not ended:
            if self._procs.pop(run_id, None) is not None and run is not None:
                self._adopted[run_id] = run["pid"]
            return
        if self._finish_or_retry(run_id, rc if rc is not None else supervisor_rc):
            self._procs.pop(run_id, None)
            self._adopted.pop(run_id, None)

    def _launch_or_fail(self, run: dict[str, Any]) -> None:
        """Start ``run``; a launch that raises (a spec its process cannot be started with) fails that
        run with the reason, so that the runs queued after it still start."""
        try:
            self._launch(run)
        except (
            Exception
        ) as e:  # the update may fail too (a full disk): the run stays queued, next tick retries
            self.store.update(
                run["id"],
                expect=("queued",),
                status="failed",
                ended=time.time(),
                error=f"could not start: {type(e).__name__}: {e}"[:2000]
                .encode("utf-8", "backslashreplace")
                .decode("utf-8"),
            )

    def _launch(self, run: dict[str, Any]) -> None:
        d = run["run_dir"]
        private_dir(d)
        attempt = int(run.get("resumes") or 0)
        if run["kind"] == "train" and not os.path.exists(os.path.join(d, RUN_FILE)):
            write_run_file(run["spec"], d)  # a run queued by a server from before run.toml
        if run["kind"] == "train":
            check_run_file(d)  # cut short or changed: the run fails with why, it never trains on it
        with contextlib.suppress(FileNotFoundError):
            os.unlink(exit_path(d, attempt))  # a record left by an earlier launch of this attempt
        launch = {"argv": command_for(run), "memory_bytes": self.memory_cap}
        write_private(launch_path(d, attempt), json.dumps(launch).encode())
        with (
            _private(os.path.join(d, f"stdout-{attempt}.json")) as out,
            _private(os.path.join(d, f"stderr-{attempt}.log")) as err,
        ):
            proc = subprocess.Popen(
                supervisor_command(d, attempt),
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=d,
                umask=0o077,
            )
        pid = _started_pid(proc, d, attempt)
        try:
            started = self.store.update(
                run["id"], expect=("queued",), status="running", started=time.time(), pid=pid
            )
        except (
            BaseException
        ):  # not recorded (a full disk): the run stays queued and must not run twice
            started = False
            raise
        finally:
            if started:
                self._procs[run["id"]] = proc
            else:  # cancelled between the read and now, or the row could not be written
                _kill_group(pid)
                _reap(proc)

    def _finish_or_retry(self, run_id: str, rc: Optional[int]) -> bool:
        """Record how the run ended; False (try again next tick) when the database cannot be written."""
        try:
            self._finish(run_id, rc)
            self.unrecorded.pop(run_id, None)
            return True
        except Exception as e:  # a full disk, a locked database: the run stays watched
            self._noted = (
                f"cannot record the end of run {run_id} (will retry): {type(e).__name__}: {e}"[:500]
            )
            _report(self._noted)
            return False

    def shown(self, run: dict[str, Any]) -> dict[str, Any]:
        """``run`` as an answer shows it: a run whose process ended but whose end could not be written
        yet (a full disk) shows how it ended, not ``running``."""
        ended = self.unrecorded.get(run["id"])
        return {**run, **ended} if ended and run["status"] == "running" else run

    def _finish(self, run_id: str, rc: Optional[int]) -> None:
        run = self.store.get(run_id)
        if run is None or run["status"] != "running":
            return  # cancelled or timed out: already recorded
        attempt = int(run.get("resumes") or 0)
        summary = _summary(run)
        ok = (rc == 0) if rc is not None else summary is not None and not summary.get("failure")
        error = None
        if not ok and rc is not None and rc < 0:
            error = f"killed by signal {-rc} ({_signame(-rc)})"
        elif not ok:
            tail = _tail(os.path.join(run["run_dir"], f"stderr-{attempt}.log"))
            failure = (summary or {}).get("failure")
            if rc is not None:
                error = failure or tail or f"exit status {rc}"
            else:  # no exit record: its supervisor was killed (or an older server started it without one)
                error = failure or "ended, exit status unknown" + (
                    f"; its stderr ends: {tail}" if tail else ""
                )
        error = explain(error, self.memory_cap)
        fields = {
            "status": "succeeded" if ok else "failed",
            "ended": time.time(),
            "summary": summary,
            "error": error,
        }
        self.unrecorded[run_id] = {
            **fields,
            "pid": None,
        }  # shown until the row says so (a full disk)
        self.store.update(run_id, expect=("running",), **fields)

    def _kill(self, run_id: str, pid: Optional[int]) -> None:
        proc = self._procs.pop(run_id, None)
        self._adopted.pop(run_id, None)
        if pid:
            _kill_group(pid)
        if proc is not None:
            _reap(proc)

    def cancel(self, run_id: str) -> bool:
        """Cancel a queued or running run; the process group is gone when this returns. False if it had ended."""
        with self._lock:
            run = self.store.get(run_id)
            if run is None or not self.store.update(
                run_id,
                expect=("queued", "running"),
                status="cancelled",
                ended=time.time(),
                error="cancelled by its owner",
            ):
                return False
            if run["status"] == "running":
                self._kill(run_id, run["pid"])
            return True


def _outcome(run: dict[str, Any]) -> tuple[bool, Optional[int]]:
    """``(ended, returncode)`` of a running row's current attempt: not ended while its process
    lives, or while its supervisor lives to write the exit record; the returncode from that
    record (negative: the signal that killed it), None when there is none."""
    d, attempt = run["run_dir"], int(run.get("resumes") or 0)
    if _alive(run["pid"], d):
        return False, None
    record = read_record(d, attempt)
    rc = record.get("returncode")
    if not (isinstance(rc, int) and not isinstance(rc, bool)):
        if _alive(record_pid(record, "supervisor"), d):
            return False, None
        # The supervisor writes the record, then exits: read it again now that it is gone (written
        # between the read above and that check, it was lost: "exit status unknown" for a run
        # killed by a signal).
        rc = read_record(d, attempt).get("returncode")
    return True, (rc if isinstance(rc, int) and not isinstance(rc, bool) else None)


def _started_pid(
    proc: subprocess.Popen[bytes], run_dir: str, attempt: int, timeout: float = 30.0
) -> int:
    """The pid of the run's process, once its supervisor ``proc`` has started it; raises
    ``RuntimeError`` with the reason when it could not (the supervisor has ended)."""
    deadline = time.monotonic() + timeout
    while True:
        record = read_record(run_dir, attempt)
        pid = record_pid(record, "pid")
        if pid:
            return pid
        if proc.poll() is not None:
            tail = _tail(os.path.join(run_dir, f"stderr-{attempt}.log"))
            raise RuntimeError(
                record.get("error")
                or f"its supervisor exited with status {proc.returncode} before starting it: {tail}"
            )
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise RuntimeError(f"its supervisor did not start it within {timeout:g} s")
        time.sleep(0.01)


def _report(message: str) -> None:
    """``message`` to the server's log (logger ``ampkit.service``, else stderr); never raises: the
    log may live on the disk that just filled up."""
    try:
        log = logging.getLogger("ampkit.service")
        if log.hasHandlers():
            log.error("scheduler: %s", message)
        else:
            print(f"ampkit serve: {message}", file=sys.stderr, flush=True)
    except BaseException:  # noqa: BLE001, S110 - nowhere left to report it
        pass


def _reap(proc: subprocess.Popen[bytes]) -> None:
    """Wait for a supervisor whose run has ended (it writes the record and exits at once)."""
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _summary(run: dict[str, Any]) -> Optional[dict[str, Any]]:
    """The JSON summary the run's current attempt printed, or None (none yet, or cut short)."""
    return _read_json(os.path.join(run["run_dir"], f"stdout-{int(run.get('resumes') or 0)}.json"))


def _signame(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return "unknown signal"


def _private(path: str) -> Any:
    """``path`` opened for writing (truncated), mode 0600 whatever the umask."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)
    return os.fdopen(fd, "wb")


def _read_json(path: str) -> Optional[dict[str, Any]]:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        start = text.find("{")
        return json.loads(text[start:]) if start >= 0 else None
    except (OSError, ValueError):
        return None


def _tail(path: str, n: int = 1500) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            lines = [ln for ln in f.read().splitlines() if ln.strip()]
    except OSError:
        return ""
    errors = [ln for ln in lines if "error" in ln.lower()]
    errors = [e for e in errors if not e.startswith("ampkit supervisor:")] or errors  # run's 1st
    return (errors[-1] if errors else "\n".join(lines[-5:]))[-n:]
