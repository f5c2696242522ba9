"""Costly work off the request threads: one worker *process* (its own interpreter, so a minute of
fake-tensor estimates holds no lock the server needs, not even the GIL), fed one job at a time,
killed and replaced when a job runs past ``timeout_s``. Finished answers are cached by the
request's key: an identical request is answered from the cache.

``jobs().submit(who, key, "module:function", args)`` returns the job (a dict); ``wait(job, s)``
blocks the calling thread (sleeping, not computing) for at most ``s`` seconds. A job's status:
``queued``, ``running``, ``succeeded`` (``result``), ``invalid`` (the function raised ValueError:
the request was bad, ``error`` says why) or ``failed`` (``error``).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import multiprocessing
import os
import queue
import threading
import time
import uuid
from collections import OrderedDict
from typing import Any, Optional

__all__ = ["Jobs", "jobs"]

_DONE = ("succeeded", "invalid", "failed")
STARTUP_S = 300  # how long the worker process may take to start (import torch) before its job fails


def _serve(conn: Any) -> None:  # the worker process's loop
    import torch

    torch.set_num_threads(1)
    conn.send("ready")
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        target, args = msg
        module, _, name = target.partition(":")
        try:
            out: tuple[str, Any] = (
                "succeeded",
                getattr(importlib.import_module(module), name)(*args),
            )
        except ValueError as e:
            out = ("invalid", str(e))
        except Exception as e:  # noqa: BLE001 - reported to the client as the job's error
            out = ("failed", f"{type(e).__name__}: {e}")
        conn.send(out)


class Jobs:
    """The job table, the answer cache and the worker (started on the first job)."""

    def __init__(self, timeout_s: float = 900.0, keep: int = 512) -> None:
        self.timeout_s, self.keep = timeout_s, keep
        self._q: queue.Queue[str] = queue.Queue()
        self._jobs: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._cache: OrderedDict[Any, tuple[str, Any]] = OrderedDict()
        self._lock = threading.Lock()
        self._done = threading.Condition(self._lock)
        self._thread: Optional[threading.Thread] = None
        self._proc: Any = None
        self._conn: Any = None
        self._closed = False

    def cached(self, key: Any) -> Optional[tuple[str, Any]]:
        """``(status, result or error)`` of a finished identical request (succeeded or invalid)."""
        with self._lock:
            return self._cache.get(key)

    def in_flight(self, who: str) -> int:
        with self._lock:
            return sum(
                1 for j in self._jobs.values() if j["owner"] == who and j["status"] not in _DONE
            )

    def submit(self, who: str, key: Any, target: str, args: tuple[Any, ...]) -> dict[str, Any]:
        """``who``'s job for ``key``: an unfinished one of theirs for the same key, else a new one."""
        with self._lock:
            for j in self._jobs.values():
                if j["owner"] == who and j["key"] == key and j["status"] not in _DONE:
                    return j
            job = {
                "id": uuid.uuid4().hex[:12],
                "owner": who,
                "key": key,
                "target": target,
                "args": args,
                "status": "queued",
                "result": None,
                "error": None,
                "created": time.time(),
                "started": None,
                "finished": None,
            }
            self._jobs[job["id"]] = job
            while len(self._jobs) > self.keep:  # forget the oldest finished jobs
                old = next((k for k, j in self._jobs.items() if j["status"] in _DONE), None)
                if old is None:
                    break
                del self._jobs[old]
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="ampkit-jobs", daemon=True)
                self._thread.start()
        self._q.put(job["id"])
        return job

    def pending(self, who: str, key: Any) -> bool:
        """Whether ``who`` has an unfinished job for ``key``."""
        with self._lock:
            return any(
                j["owner"] == who and j["key"] == key and j["status"] not in _DONE
                for j in self._jobs.values()
            )

    def get(self, job_id: str, who: str) -> Optional[dict[str, Any]]:
        """``who``'s job ``job_id`` (None for another owner's, as if it did not exist)."""
        with self._lock:
            j = self._jobs.get(job_id)
            return j if j is not None and j["owner"] == who else None

    def wait(self, job: dict[str, Any], seconds: float) -> dict[str, Any]:
        end = time.monotonic() + seconds
        with self._done:
            while job["status"] not in _DONE and (left := end - time.monotonic()) > 0:
                self._done.wait(left)
        return job

    def _finish(self, job: dict[str, Any], status: str, value: Any) -> None:
        with self._done:
            job["status"], job["finished"] = status, time.time()
            job["result" if status == "succeeded" else "error"] = value
            if status in ("succeeded", "invalid"):
                self._cache[job["key"]] = (status, value)
                while len(self._cache) > self.keep:
                    self._cache.popitem(last=False)
            self._done.notify_all()

    def _loop(self) -> None:
        """Run jobs until the process ends; nothing raised here ends the loop (a dead loop would
        leave every later job queued, and every ``memory_savings_gb`` null)."""
        while True:
            try:
                self._step(self._q.get())
            except BaseException as e:  # noqa: BLE001 - the loop outlives any one job
                with contextlib.suppress(BaseException):
                    logging.getLogger("ampkit.service").error(
                        "job loop error: %s: %s", type(e).__name__, e
                    )

    def _step(self, job_id: str) -> None:
        if job_id == "\0reopen":
            self._reopen()
            return
        job = self._jobs.get(job_id)
        if job is None or job["status"] in _DONE:
            return
        hit = self.cached(job["key"]) or (
            ("failed", "the server is shutting down") if self._closed else None
        )
        if hit is not None:
            self._finish(job, *hit)
            return
        with self._lock:
            job["status"], job["started"] = "running", time.time()
        try:
            self._finish(job, *self._run(job["target"], job["args"]))
        except BaseException as e:  # noqa: BLE001 - the worker died, timed out or never started: this job
            try:  # fails, the next gets a new worker
                self._stop_worker()
            finally:
                self._finish(job, "failed", str(e) or type(e).__name__)

    def _run(self, target: str, args: tuple[Any, ...]) -> tuple[str, Any]:
        if self._proc is None or not self._proc.is_alive():
            ctx = multiprocessing.get_context("spawn")
            self._conn, child = ctx.Pipe()
            env_threads = os.environ.get("OMP_NUM_THREADS")
            os.environ.setdefault("OMP_NUM_THREADS", "1")
            try:
                self._proc = ctx.Process(
                    target=_serve, args=(child,), daemon=True, name="ampkit-planner"
                )
                self._proc.start()
            finally:
                if env_threads is None:
                    os.environ.pop("OMP_NUM_THREADS", None)
            child.close()
            # starting (importing torch) is not the job's time: a loaded machine takes a while
            if not self._conn.poll(STARTUP_S) or self._conn.recv() != "ready":
                raise RuntimeError(f"the worker process did not start within {STARTUP_S} s")
        self._conn.send((target, args))
        if not self._conn.poll(self.timeout_s):
            raise TimeoutError(
                f"the job ran past this server's limit of {self.timeout_s:g} s and was stopped"
            )
        return self._conn.recv()

    def _stop_worker(self) -> None:
        proc, self._proc, self._conn = self._proc, None, None
        if (
            proc is not None and proc.pid is not None
        ):  # a worker that never started has nothing to kill
            proc.kill()
            proc.join(5)

    def close(self) -> None:
        """Stop the worker process and fail the jobs still waiting (a server's shutdown; its exit
        ends the worker anyway: it is a daemon process). Jobs submitted later run on a new worker."""
        with self._lock:
            self._closed = True
            self._stop_worker()
        self._q.put("")  # wake the loop: it fails what is queued, then takes new jobs again
        self._q.put("\0reopen")

    def _reopen(self) -> None:
        self._closed = False


_JOBS: Optional[Jobs] = None
_GUARD = threading.Lock()


def jobs() -> Jobs:
    """This process's job table (made on first use)."""
    global _JOBS
    with _GUARD:
        if _JOBS is None:
            _JOBS = Jobs(timeout_s=float(os.environ.get("AMPKIT_JOB_TIMEOUT_S", "900")))
        return _JOBS
