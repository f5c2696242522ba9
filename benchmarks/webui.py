"""The web UI with big records: the runs page with 1,000 runs, and a run of 100,000 steps (its page
and its plot data, ``/ui/runs/{id}/data``). Server time and bytes sent, through the real app
(``create_app`` + httpx's ASGI transport: the app's middleware, routing and rendering, no socket).

The records are written directly: 1,000 succeeded runs in a temporary store (each with a summary
as ``ampkit train --json`` writes it, 100 losses), and one run whose log holds 100,000 step
records (a loss scale that halves on 1 in 500 steps, a fallback and a stop event).

    python benchmarks/webui.py [--runs 1000] [--steps 100000] [--repeats 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time

import httpx

from ampkit.service.app import ServiceConfig, create_app

TOKEN = "bench-token"


def _summary(i: int, steps: int) -> dict:
    return {
        "precision": "bf16",
        "device": "cpu",
        "optimizer_steps": steps,
        "skipped_steps": 0,
        "final_loss": 1.0 + 1 / (i + 1),
        "first_loss": 5.0,
        "ms_per_step": 12.5,
        "samples_per_s": 1200.0,
        "tokens_per_s": 150000.0,
        "final_scale": None,
        "losses": [5.0 - k * 0.04 for k in range(100)],
        "peak_mem_bytes": 500_000_000,
        "run_id": f"{i:012x}",
    }


def _long_log(run_dir: str, steps: int) -> None:
    os.makedirs(os.path.join(run_dir, "log-0"))
    scale = 65536.0
    with open(os.path.join(run_dir, "log-0", "log.jsonl"), "w", encoding="utf-8") as f:
        for s in range(1, steps + 1):
            skipped = s % 500 == 0
            scale = scale / 2 if skipped else scale
            f.write(
                json.dumps(
                    {
                        "schema_version": 1,
                        "type": "step",
                        "step": s,
                        "time": 1.8e9 + s * 0.01,
                        "loss": None if skipped else 5.0 / (1 + s / 1000) + (s % 7) * 0.01,
                        "precision": "fp16" if s < steps // 2 else "bf16",
                        "scale": scale,
                        "skipped": skipped,
                        "grad_norm": 1.0,
                        "lr": 1e-3,
                        "step_time_ms": 10 + s % 3,
                        "peak_mem_bytes": 400_000_000 + s,
                        "run_id": "bench0000000",
                        "tokens_per_s": 150000.0 + s % 100,
                    }
                )
                + "\n"
            )
            if s == steps // 2:
                f.write(
                    json.dumps(
                        {
                            "schema_version": 1,
                            "type": "event",
                            "kind": "fallback",
                            "step": s,
                            "time": 1.8e9,
                            "from": "fp16",
                            "to": "bf16",
                            "reason": "bench",
                        }
                    )
                    + "\n"
                )
        f.write(
            json.dumps(
                {
                    "schema_version": 1,
                    "type": "event",
                    "kind": "stop",
                    "step": steps,
                    "time": 1.8e9,
                    "signal": "SIGTERM",
                }
            )
            + "\n"
        )


async def _time(client: httpx.AsyncClient, url: str, repeats: int) -> tuple[float, float, int, int]:
    """(first ms, median ms of the repeats after it, bytes, status)."""
    times, size, status = [], 0, 0
    for _ in range(repeats + 1):
        t = time.perf_counter()
        r = await client.get(url)
        times.append((time.perf_counter() - t) * 1000)
        size, status = len(r.content), r.status_code
    return times[0], statistics.median(times[1:]), size, status


async def main_async(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        app = create_app(ServiceConfig(data_dir=tmp), tokens={TOKEN: "bench"})
        store = app.state.store
        spec = {"model": "gpt", "size": "small", "precision": "bf16", "steps": 100, "device": "cpu"}
        for i in range(args.runs):
            rid = f"{i:012x}"
            store.create(rid, "bench", "train", spec, os.path.join(tmp, "runs", rid))
            store.update(
                rid,
                status="succeeded",
                started=1.8e9 + i,
                ended=1.8e9 + i + 60,
                summary=_summary(i, 100),
            )
        long_id = "feedfeedfeed"
        run_dir = os.path.join(tmp, "runs", long_id)
        store.create(long_id, "bench", "train", {**spec, "steps": args.steps}, run_dir)
        store.update(
            long_id,
            status="succeeded",
            started=1.8e9,
            ended=1.8e9 + 3600,
            summary=_summary(0, args.steps),
        )
        _long_log(run_dir, args.steps)
        log_bytes = os.path.getsize(os.path.join(run_dir, "log-0", "log.jsonl"))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            r = await client.post(
                "/ui/signin", data={"token": TOKEN}, headers={"Origin": "http://127.0.0.1"}
            )
            assert r.status_code == 303, r.text
            print(
                f"# ampkit web UI, {args.runs} runs + one run of {args.steps:,} steps "
                f"(log {log_bytes / 2**20:.1f} MiB); ASGI app in process, {args.repeats} repeats"
            )
            print()
            print("| page | first (ms) | median after (ms) | bytes sent |")
            print("| --- | ---: | ---: | ---: |")
            for name, url in [
                (f"runs page, {args.runs} runs", "/ui/runs"),
                (f"run page, {args.steps:,} steps (HTML)", f"/ui/runs/{long_id}"),
                (f"its plot data, {args.steps:,} steps", f"/ui/runs/{long_id}/data"),
                (
                    f"API metrics page, {args.steps:,} steps (for scale)",
                    f"/v1/runs/{long_id}/metrics?limit=1000",
                ),
            ]:
                headers = {"Authorization": f"Bearer {TOKEN}"} if url.startswith("/v1") else None
                if headers:
                    client.headers.update(headers)
                first, median, size, status = await _time(client, url, args.repeats)
                assert status == 200, (url, status)
                print(f"| {name} | {first:.0f} | {median:.0f} | {size:,} |")
            data = json.loads((await client.get(f"/ui/runs/{long_id}/data")).content)
            points = {k: len(v["x"]) for k, v in data["series"].items()}
            print()
            print(f"points per series: {points}; skipped-step markers {len(data['skipped'])}")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--runs", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--repeats", type=int, default=5)
    asyncio.run(main_async(ap.parse_args()))


if __name__ == "__main__":
    main()
