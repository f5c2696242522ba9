"""Bounded load on the service: ``clients`` threads send ``requests`` GET /v1/runs in all, on a
real uvicorn server (127.0.0.1) whose store holds ``runs`` finished runs. Prints latency
percentiles, throughput and errors.

    python benchmarks/service_load.py --requests 200 --clients 4 --runs 50
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
import uuid

import httpx
import uvicorn

from ampkit.service.app import ServiceConfig, create_app

TOKENS = {"tok-load": "load"}


def start(data_dir: str, port: int) -> tuple[uvicorn.Server, threading.Thread]:
    app = create_app(ServiceConfig(data_dir=data_dir), tokens=TOKENS)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the server did not start in 20 s")
        time.sleep(0.05)
    return server, thread


def seed_runs(app_store, n: int, data_dir: str, owner: str = "load") -> None:
    for i in range(n):
        rid = uuid.uuid4().hex[:12]
        app_store.create(
            rid,
            owner,
            "train",
            {"model": "mlp", "precision": "bf16", "steps": 10 + i},
            os.path.join(data_dir, "runs", rid),
        )
        app_store.update(
            rid,
            status="succeeded",
            summary={
                "precision": "bf16",
                "final_loss": 1.0,
                "ms_per_step": 1.0,
                "skipped_steps": 0,
            },
        )


def load(
    base_url: str, requests: int, clients: int, timeout_s: float = 60.0, token: str = "tok-load"
) -> dict:
    """``requests`` GET /v1/runs from ``clients`` threads; latencies (ms), errors, wall time."""
    latencies: list[float] = []
    errors: list[str] = []
    lock = threading.Lock()
    per = [requests // clients + (1 if i < requests % clients else 0) for i in range(clients)]
    deadline = time.monotonic() + timeout_s

    def worker(n: int) -> None:
        with httpx.Client(
            base_url=base_url, timeout=10, headers={"Authorization": f"Bearer {token}"}
        ) as c:
            for _ in range(n):
                if time.monotonic() > deadline:
                    with lock:
                        errors.append("deadline")
                    return
                t0 = time.perf_counter()
                try:
                    r = c.get("/v1/runs", params={"limit": 100})
                    ok = r.status_code == 200 and isinstance(r.json().get("runs"), list)
                    err = None if ok else f"status {r.status_code}"
                except httpx.HTTPError as e:
                    err = f"{type(e).__name__}: {e}"
                ms = (time.perf_counter() - t0) * 1000
                with lock:
                    latencies.append(ms)
                    if err:
                        errors.append(err)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(n,)) for n in per]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 5)
    wall = time.perf_counter() - t0
    q = statistics.quantiles(latencies, n=100) if len(latencies) >= 2 else [float("nan")] * 99
    return {
        "requests": len(latencies),
        "clients": clients,
        "errors": len(errors),
        "error_samples": errors[:3],
        "p50_ms": q[49],
        "p95_ms": q[94],
        "p99_ms": q[98],
        "max_ms": max(latencies, default=float("nan")),
        "wall_s": wall,
        "req_per_s": len(latencies) / wall if wall else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--runs", type=int, default=50, help="finished runs in the store (each listed)")
    ap.add_argument("--port", type=int, default=0)
    args = ap.parse_args()
    import socket

    port = args.port
    if not port:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        server, thread = start(d, port)
        try:
            seed_runs(server.config.app.state.store, args.runs, d)
            r = load(f"http://127.0.0.1:{port}", args.requests, args.clients)
        finally:
            server.should_exit = True
            thread.join(10)
    print(f"# GET /v1/runs (limit 100, {args.runs} runs in the store), {r['clients']} clients")
    print("| requests | errors | p50 ms | p95 ms | p99 ms | max ms | req/s |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print(
        f"| {r['requests']} | {r['errors']} | {r['p50_ms']:.1f} | {r['p95_ms']:.1f} | "
        f"{r['p99_ms']:.1f} | {r['max_ms']:.1f} | "
        f"{r['req_per_s']:.0f} |"
    )


if __name__ == "__main__":
    main()
