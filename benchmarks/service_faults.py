"""The service through faults (issue 34): one line per case, for docs/benchmarks.md "Service faults".

    python benchmarks/service_faults.py [--cases cut,empty_db,disk_full,two_servers,n_layer,bool_lr,mode]

``disk_full`` mounts a small tmpfs (needs root) holding the data directory and the server's stderr,
fills it while a run is running, then frees it: is the scheduler alive, is the run that failed
recorded, does the run queued behind it start? Run it with ``PYTHONPATH=<old checkout>/src`` for
the "before" column (the ``ampkit`` processes it starts inherit it).
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

TOKENS = {"tok": "alice"}
AUTH = {"Authorization": "Bearer tok"}
ENV = {**os.environ, "AMPKIT_TOKENS": "alice:tok"}


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(what: Callable[[], Any], timeout: float) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = what()
        if got:
            return got
        time.sleep(0.2)
    return None


def _serve(data: str, stderr: Any = subprocess.PIPE) -> tuple[subprocess.Popen, Any]:
    import httpx

    port = _port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ampkit", "serve", "--port", str(port), "--data_dir", data],
        env=ENV,
        stdout=subprocess.DEVNULL,
        stderr=stderr,
        start_new_session=True,
    )
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=30)

    def up() -> bool:
        try:
            return client.get("/health").status_code in (200, 503)
        except httpx.TransportError:
            return proc.poll() is not None

    _wait(up, 90)
    return proc, client


def _end(proc: subprocess.Popen) -> None:
    import signal

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def cut_run_file(tmp: str) -> str:
    from ampkit.service.runfile import write_run_file
    from ampkit.service.schemas import RunSpec

    spec = RunSpec(
        model="mlp", steps=40, batch_size=4, log_every=1, precision="fp32", checkpoint_every=1000
    )
    path = write_run_file(spec.model_dump(), os.path.join(tmp, "run"))
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines(keepends=True)
    with open(path, "w", encoding="utf-8") as f:  # cut at the line boundary before `steps = 40`
        f.writelines(lines[: next(i for i, ln in enumerate(lines) if ln.startswith("steps"))])
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ampkit",
            "train",
            "--config",
            path,
            "--json",
            "--log_dir",
            os.path.join(tmp, "log"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if out.returncode == 0:
        summary = json.loads(out.stdout[out.stdout.find("{") :])
        return f"asked 40 steps; trained {summary.get('optimizer_steps')} (exit 0)"
    return f"exit {out.returncode}: {out.stderr.strip().splitlines()[-1][:200]}"


def empty_db(tmp: str) -> str:
    from ampkit.service.store import Store

    data = os.path.join(tmp, "svc")
    os.makedirs(data)
    open(os.path.join(data, "ampkit.db"), "wb").close()
    try:
        store = Store(data)
    except OSError as e:
        return f"refused: {str(e)[:160]}..."
    return f"opened as a new database ({len(store.list())} runs); file now {os.path.getsize(store.path)} bytes"


def disk_full(tmp: str) -> str:
    if os.geteuid() != 0:
        return "skipped (needs root for a tmpfs)"
    mnt = os.path.join(tmp, "full")
    os.makedirs(mnt)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", mnt], check=True)
    try:
        data = os.path.join(mnt, "svc")
        with open(os.path.join(mnt, "serve.log"), "wb") as log:
            proc, c = _serve(data, stderr=log)
        try:
            a = c.post(
                "/v1/runs",
                json={
                    "model": "mlp",
                    "steps": 1_000_000,
                    "precision": "fp32",
                    "log_every": 1,
                    "checkpoint_every": 1,
                },
            ).json()["id"]
            b = c.post("/v1/runs", json={"model": "mlp", "steps": 2, "precision": "fp32"}).json()[
                "id"
            ]

            def pid_of_a() -> int:
                with sqlite3.connect(os.path.join(data, "ampkit.db")) as db:
                    return db.execute("SELECT pid FROM runs WHERE id = ?", (a,)).fetchone()[0]

            pid = _wait(pid_of_a, 120)
            _wait(lambda: os.path.isdir(os.path.join(data, "runs", a, "ckpt")), 60)
            filler = os.path.join(mnt, "filler")
            with open(filler, "wb") as f:  # fill the disk
                try:
                    while True:
                        f.write(b"\0" * 65536)
                        f.flush()
                except OSError:
                    pass
            _wait(lambda: not _running(pid), 120)
            time.sleep(20)  # ~100 scheduler ticks while the disk is full (each retry logs a line)
            during = c.get("/health")
            os.unlink(filler)  # an operator frees space
            done = _wait(
                lambda: c.get(f"/v1/runs/{b}").json()["status"] in ("succeeded", "failed"), 90
            )
            health = c.get("/health")
            with sqlite3.connect(os.path.join(data, "ampkit.db")) as db:
                rows = dict(db.execute("SELECT id, status FROM runs").fetchall())
            sched = health.json().get("scheduler", "(not reported)")
            return (
                f"health during {during.status_code} scheduler={during.json().get('scheduler', '(not reported)')}; "
                f"after freeing: run a (failed while full) {rows[a]}, "
                f"queued run b {rows[b]}{'' if done else ' (not started in 90 s)'}; health "
                f"{health.status_code} scheduler={sched}"
            )
        finally:
            c.close()
            _end(proc)
    finally:
        subprocess.run(["umount", "-l", mnt], check=False)


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def two_servers(tmp: str) -> str:
    data = os.path.join(tmp, "svc")
    first, c1 = _serve(data)
    try:
        second, c2 = _serve(data)
        try:
            if second.poll() is None:
                return f"both started (second answers /health {c2.get('/health').status_code})"
            err = second.stderr.read().decode().strip().splitlines()[-1]
            return f"second refused, exit {second.returncode}: {err[:200]}"
        finally:
            c2.close()
            _end(second)
    finally:
        c1.close()
        _end(first)


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS")) * 1024


def n_layer(tmp: str) -> str:
    from fastapi.testclient import TestClient

    from ampkit.service.app import ServiceConfig, create_app

    c = TestClient(create_app(ServiceConfig(data_dir=os.path.join(tmp, "svc")), tokens=TOKENS))
    c.post(
        "/v1/runs", json={"model": "gpt2", "model_overrides": {"n_layer": 2}}, headers=AUTH
    )  # imports transformers
    rss, t = _rss(), time.perf_counter()
    r = c.post(
        "/v1/runs", json={"model": "gpt2", "model_overrides": {"n_layer": 8000}}, headers=AUTH
    )
    return (
        f"{r.status_code} in {time.perf_counter() - t:.2f} s, RSS {(_rss() - rss) / 2**20:+.0f} MiB: "
        f"{r.json()['detail'][:90]}"
    )


def bool_lr(tmp: str) -> str:
    from fastapi.testclient import TestClient

    from ampkit.service.app import ServiceConfig, create_app

    c = TestClient(create_app(ServiceConfig(data_dir=os.path.join(tmp, "svc")), tokens=TOKENS))
    out = []
    for body in ({"lr": True}, {"max_seconds": True}):
        r = c.post("/v1/runs", json={"model": "mlp", **body}, headers=AUTH)
        key = next(iter(body))
        out.append(
            f"{key}: true -> {r.status_code}"
            + (f" ({key}={r.json()['spec'][key]})" if r.status_code == 201 else "")
        )
    return "; ".join(out)


def mode(tmp: str) -> str:
    from ampkit.service.server import preflight

    old = os.umask(0o022)
    try:
        preflight(os.path.join(tmp, "svc"))
    finally:
        os.umask(old)
    return f"new data dir mode {oct(os.stat(os.path.join(tmp, 'svc')).st_mode & 0o777)} (umask 022)"


CASES = {
    "cut_run_file": cut_run_file,
    "empty_db": empty_db,
    "disk_full": disk_full,
    "two_servers": two_servers,
    "n_layer": n_layer,
    "bool_lr": bool_lr,
    "mode": mode,
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default=",".join(CASES))
    args = p.parse_args()
    import ampkit

    print(f"# ampkit from {os.path.dirname(ampkit.__file__)}")
    for name in args.cases.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                print(f"{name}: {CASES[name](tmp)}", flush=True)
            except Exception as e:  # noqa: BLE001 - a case that breaks is a result too
                print(f"{name}: error {type(e).__name__}: {e}", flush=True)


if __name__ == "__main__":
    main()
