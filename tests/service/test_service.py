"""The REST service on a real uvicorn server (127.0.0.1, a free port) with a real HTTP client;
runs are real ``ampkit train`` processes. Every wait is bounded."""

from __future__ import annotations

import os
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from ampkit.service.app import ServiceConfig, create_app  # noqa: E402

from ..support.dist_helpers import free_port  # noqa: E402
from .server_process import end, serve  # noqa: E402

TOKENS = {"tok-alice": "alice", "tok-bob": "bob"}
ALICE = {"Authorization": "Bearer tok-alice"}
BOB = {"Authorization": "Bearer tok-bob"}


class Server:
    def __init__(self, data_dir: str, **config: object) -> None:
        self.port, self.data_dir = free_port(), data_dir
        app = create_app(ServiceConfig(data_dir=data_dir, poll_s=0.1, **config), tokens=TOKENS)
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning")
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120  # a hang guard: the start imports transformers
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        self.client = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=30)

    def stop(self) -> None:
        self.client.close()
        self.server.should_exit = True
        self.thread.join(timeout=10)

    def wait(self, run_id: str, statuses: tuple[str, ...], timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            run = self.client.get(f"/v1/runs/{run_id}", headers=ALICE).json()
            if run["status"] in statuses:
                return run
            assert time.monotonic() < deadline, f"run {run_id} stuck in {run['status']}: {run}"
            time.sleep(0.2)


@pytest.fixture
def server(tmp_path):
    s = Server(str(tmp_path / "svc"))
    yield s
    for run in s.client.get("/v1/runs", headers=ALICE).json()["runs"]:
        if run["status"] in ("queued", "running"):
            s.client.delete(f"/v1/runs/{run['id']}", headers=ALICE)
    s.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().split(b")")[-1].split()[0] != b"Z"


@pytest.mark.slow
def test_auth_and_ownership(server):
    c = server.client
    assert c.get("/health").status_code == 200
    assert c.get("/v1/runs").status_code == 401
    assert c.get("/v1/runs", headers={"Authorization": "Bearer nope"}).status_code == 401
    r = c.post("/v1/runs", json={"model": "mlp", "steps": 1, "precision": "fp32"}, headers=ALICE)
    assert r.status_code == 201
    rid = r.json()["id"]
    assert c.get(f"/v1/runs/{rid}", headers=BOB).status_code == 404  # not yours: it does not exist
    assert c.delete(f"/v1/runs/{rid}", headers=BOB).status_code == 404
    assert rid not in [x["id"] for x in c.get("/v1/runs", headers=BOB).json()["runs"]]
    server.wait(rid, ("succeeded",))


@pytest.mark.slow
def test_validation_is_4xx_with_the_cli_messages(server):
    c = server.client
    r = c.post("/v1/runs", json={"precision": "fp12"}, headers=ALICE)
    assert r.status_code == 422 and "fp12" in r.text and "bf16" in r.text and "fp16" in r.text
    assert c.post("/v1/runs", json={"model": "evil.module:f"}, headers=ALICE).status_code == 422
    assert c.post("/v1/runs", json={"steps": 0}, headers=ALICE).status_code == 422
    assert c.post("/v1/runs", json={"stepz": 5}, headers=ALICE).status_code == 422
    assert (
        c.post(
            "/v1/runs", content=b"{not json", headers={**ALICE, "content-type": "application/json"}
        ).status_code
        == 422
    )
    big = {"model": "mlp", "pad": "x" * (1 << 20)}
    assert c.post("/v1/runs", json=big, headers=ALICE).status_code == 413
    assert c.get("/v1/compare?ids=a", headers=ALICE).status_code == 422
    assert c.get("/v1/runs/nope/metrics", headers=ALICE).status_code == 404
    r = c.post("/v1/runs", json={"model": "gpt", "texts": ["ok text", "x"]}, headers=ALICE)
    assert r.status_code == 422 and "fewer than 2 bytes" in r.text


@pytest.mark.slow
def test_bf16_run_succeeds_with_paged_metrics_and_compares_with_fp32(server):
    c = server.client
    ids = [
        c.post(
            "/v1/runs",
            json={"model": "mlp", "steps": 30, "precision": p, "log_every": 5},
            headers=ALICE,
        ).json()["id"]
        for p in ("fp32", "bf16")
    ]
    runs = [server.wait(i, ("succeeded", "failed")) for i in ids]
    assert [r["status"] for r in runs] == ["succeeded", "succeeded"], runs
    assert runs[1]["summary"]["precision"] == "bf16" and runs[1]["summary"]["optimizer_steps"] == 30
    assert runs[1]["skipped_steps"] == 0
    records, after = [], 0
    while True:
        page = c.get(
            f"/v1/runs/{ids[1]}/metrics", params={"after": after, "limit": 7}, headers=ALICE
        ).json()
        records += page["records"]
        if not page["records"]:
            break
        assert page["next"] == after + len(page["records"]) and len(page["records"]) <= 7
        after = page["next"]
    steps = [r for r in records if r.get("type") == "step"]
    assert [r["step"] for r in steps] == list(range(1, 31))
    cmp = c.get("/v1/compare", params={"ids": ",".join(ids)}, headers=ALICE).json()
    assert cmp["baseline"] == ids[0]
    fp32, bf16 = cmp["runs"]
    assert fp32["loss_gap"] == 0.0 and fp32["speedup"] == 1.0
    assert abs(bf16["loss_gap"]) < 0.05 and bf16["speedup"] > 0 and bf16["skipped_steps"] == 0


@pytest.mark.slow
def test_cancel_kills_the_process_group_and_queue_holds_the_next(server):
    c = server.client
    long = {"model": "mlp", "steps": 1_000_000, "precision": "fp32"}
    first = c.post("/v1/runs", json=long, headers=ALICE).json()["id"]
    second = c.post(
        "/v1/runs", json={"model": "mlp", "steps": 2, "precision": "fp32"}, headers=ALICE
    ).json()["id"]
    server.wait(first, ("running",), timeout=30)
    time.sleep(0.5)
    assert (
        c.get(f"/v1/runs/{second}", headers=ALICE).json()["status"] == "queued"
    )  # max_concurrent=1
    run = server.server.config.app.state.store.get(first)
    pid = run["pid"]
    with open(
        f"/proc/{pid}/cmdline", "rb"
    ) as f:  # the run's settings travel in its run.toml, not as flags
        argv = f.read().decode().split("\0")[:-1]
    d = run["run_dir"]
    assert argv[argv.index("train") + 1 :] == [
        "--config",
        f"{d}/run.toml",
        "--json",
        "--log_dir",
        f"{d}/log-0",
        "--checkpoint_dir",
        f"{d}/ckpt",
    ]
    r = c.delete(f"/v1/runs/{first}", headers=ALICE)
    assert r.status_code == 200 and r.json()["status"] == "cancelled"
    deadline = time.monotonic() + 120  # catches a process the cancel left running (not a timing)
    while _alive(pid):
        assert time.monotonic() < deadline, "the run's process outlived its cancel"
        time.sleep(0.05)
    assert c.delete(f"/v1/runs/{first}", headers=ALICE).status_code == 409
    assert server.wait(second, ("succeeded",))["status"] == "succeeded"


@pytest.mark.slow
def test_timeout_fails_the_run(server):
    c = server.client
    rid = c.post(
        "/v1/runs", json={"model": "mlp", "steps": 1_000_000, "max_seconds": 3}, headers=ALICE
    ).json()["id"]
    run = server.wait(rid, ("failed", "succeeded"), timeout=60)
    assert run["status"] == "failed" and run["error"].startswith("timeout")


@pytest.mark.slow
def test_kill_9_and_restart_readopts_live_runs_and_interrupts_dead_ones(tmp_path):
    import signal
    import subprocess

    data = str(tmp_path / "svc")

    def start() -> tuple[subprocess.Popen, httpx.Client]:
        return serve(data, "--max_concurrent", "2")

    def wait(client: httpx.Client, rid: str, status: str) -> dict:
        deadline = time.monotonic() + 60
        while (run := client.get(f"/v1/runs/{rid}").json())["status"] != status:
            assert time.monotonic() < deadline, run
            time.sleep(0.2)
        return run

    proc, c = start()
    spec = {"model": "mlp", "steps": 1_000_000, "precision": "fp32", "checkpoint_every": 5}
    keep, lose = (c.post("/v1/runs", json=spec).json()["id"] for _ in range(2))
    for rid in (keep, lose):
        wait(c, rid, "running")
    ckpt = os.path.join(data, "runs", lose, "ckpt")
    deadline = time.monotonic() + 60
    while not (
        os.path.isdir(ckpt) and any(n.endswith(".pt") for n in os.listdir(ckpt))
    ):  # past a checkpoint
        assert time.monotonic() < deadline
        time.sleep(0.2)
    from ampkit.service.store import Store

    pids = {rid: Store(data).get(rid)["pid"] for rid in (keep, lose)}
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    os.killpg(pids[lose], signal.SIGKILL)  # this run dies with the server; the other survives
    while _alive(pids[lose]):
        time.sleep(0.05)
    assert _alive(pids[keep])
    proc, c = start()
    try:
        assert c.get(f"/v1/runs/{keep}").json()["status"] == "running"  # re-adopted
        lost = c.get(f"/v1/runs/{lose}").json()
        assert lost["status"] == "interrupted" and "resume" in lost["error"]
        assert c.post(f"/v1/runs/{lose}/resume").status_code == 202
        wait(c, lose, "running")
        assert c.delete(f"/v1/runs/{keep}").json()["status"] == "cancelled"
        assert c.delete(f"/v1/runs/{lose}").json()["status"] == "cancelled"
        assert not _alive(pids[keep])
        assert len(c.get("/v1/runs").json()["runs"]) == 2  # nothing lost from SQLite
    finally:
        end(proc)


@pytest.mark.slow
def test_recommend_runs_tune_as_a_job(server):
    c = server.client
    r = c.post(
        "/v1/recommend",
        json={
            "model": "mlp",
            "size": "tiny",
            "steps": 3,
            "batch_size": 8,
            "precisions": "fp32,bf16",
        },
        headers=ALICE,
    )
    assert r.status_code == 201 and r.json()["kind"] == "recommend"
    run = server.wait(r.json()["id"], ("succeeded", "failed"), timeout=180)
    assert run["status"] == "succeeded", run
    out = run["summary"]
    assert out["recommendation"]["precision"] in ("fp32", "bf16")
    assert {m["precision"] for m in out["bench"]["results"]} == {"fp32", "bf16"}
    assert all(m["step_ms"] > 0 for m in out["bench"]["results"])
    assert (
        c.post("/v1/recommend", json={"precisions": "fp32,fp12"}, headers=ALICE).status_code == 422
    )


@pytest.mark.slow
def test_bounded_load_on_the_list_route(server):
    """200 list requests from 4 clients against 30 runs: no errors (latency goes to docs/benchmarks.md)."""
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    from service_load import load, seed_runs

    store = server.server.config.app.state.store
    seed_runs(store, 30, str(server.data_dir), owner="alice")
    r = load(
        str(server.client.base_url).rstrip("/"),
        requests=200,
        clients=4,
        timeout_s=60,
        token="tok-alice",
    )
    assert r["requests"] == 200 and r["errors"] == 0, r  # (its latency: docs/benchmarks.md)


@pytest.mark.slow
def test_precision_config_reaches_the_run(server):
    """`amp` carries MixedPrecisionConfig fields to the run (the [amp] table of its run.toml): growth every 3
    finite steps from 1024 gives 8192 after 9 fp16 steps (torch's default interval would give 1024)."""
    c = server.client
    r = c.post(
        "/v1/runs",
        json={
            "model": "mlp",
            "steps": 9,
            "precision": "fp16",
            "init_scale": 1024,
            "amp": {"growth_interval": 3, "hysteresis": 2, "keep_fp32": ["net.0"]},
        },
        headers=ALICE,
    )
    assert r.status_code == 201, r.text
    run = server.wait(r.json()["id"], ("succeeded", "failed"))
    assert run["status"] == "succeeded", run
    s = run["summary"]
    assert s["skipped_steps"] == 0 and s["final_scale"] == 1024 * 2**3
    for bad, says in (
        ({"growth_intervall": 3}, "growth_intervall"),
        ({"precision": "bf16"}, "run's own field"),
        ({"growth_factor": 0.5}, "growth_factor"),
    ):
        r = c.post("/v1/runs", json={"model": "mlp", "amp": bad}, headers=ALICE)
        assert r.status_code == 422 and says in r.text, r.text


def test_serve_bad_flags_are_one_line(capsys):
    from ampkit.cli import main

    for value, says in (("8XB", "'8XB' is not understood"), ("100", "must be at least 1KiB")):
        try:  # a size that is none: argparse's exit as the flag is read; a small one: serve's
            code = main(["serve", "--max_body", value])
        except SystemExit as e:
            code = e.code
        assert code == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1
