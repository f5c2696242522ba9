"""``ampkit serve`` as a process of its own, for the tests that kill and restart the server."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from ..support.dist_helpers import free_port

ALICE = {"Authorization": "Bearer tok-alice"}


def serve(data: str, *extra: str, env: dict | None = None, launcher: str = "") -> tuple:
    """Start ``ampkit serve`` on a free port (its own session; ``launcher``: Python code that runs the
    CLI instead of ``-m ampkit``); returns (process, client) once /health answers."""
    httpx = pytest.importorskip("httpx")
    port = free_port()
    env = {**os.environ, "AMPKIT_TOKENS": "alice:tok-alice", **(env or {})}
    start = ["-c", launcher] if launcher else ["-m", "ampkit"]
    proc = subprocess.Popen(
        [sys.executable, *start, "serve", "--port", str(port), "--data_dir", data, *extra],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30, headers=ALICE)
    deadline = time.monotonic() + 90
    while True:
        try:
            if client.get("/health").status_code == 200:
                return proc, client
        except httpx.TransportError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            end(proc)
            raise AssertionError(proc.stderr.read().decode()[-2000:])
        time.sleep(0.2)


def end(proc: subprocess.Popen) -> None:
    """Stop the server's process group: SIGTERM, then SIGKILL after 15 s."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
