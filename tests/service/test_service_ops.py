"""Operating the service (issue 23, items 3, 5-8) against a real uvicorn server on 127.0.0.1 with
real (tiny, bounded) runs: restart recovery, resume after a fallback, the body cap while reading,
connection deadlines, private files, a full disk, the request log, killed runs, the temperature
hold. Every process a test starts is ended by it; every wait is bounded."""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import stat
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")

from ampkit.service.app import ServiceConfig, create_app  # noqa: E402
from ampkit.service.server import guarded_protocol  # noqa: E402

from ..support.dist_helpers import free_port  # noqa: E402
from .server_process import end as _end  # noqa: E402
from .server_process import serve as _serve  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOKENS = {"tok-alice": "alice", "tok-bob": "bob"}
ALICE = {"Authorization": "Bearer tok-alice"}
LONG = {"model": "mlp", "steps": 1_000_000, "precision": "fp32", "checkpoint_every": 5}


class Server:
    """The app in this process under uvicorn with the service's connection deadlines."""

    def __init__(self, data_dir: str, header_timeout: float = 10.0, **config: object) -> None:
        self.port, self.data_dir = free_port(), data_dir
        self.app = create_app(ServiceConfig(data_dir=data_dir, poll_s=0.1, **config), tokens=TOKENS)
        self.server = uvicorn.Server(
            uvicorn.Config(
                self.app,
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                http=guarded_protocol(header_timeout),
                timeout_keep_alive=1,
            )
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120  # a hang guard: the start imports transformers
        while not self.server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        self.client = httpx.Client(
            base_url=f"http://127.0.0.1:{self.port}", timeout=30, headers=ALICE
        )

    def wait(self, run_id: str, statuses: tuple[str, ...], timeout: float = 120) -> dict:
        deadline = time.monotonic() + timeout
        while (run := self.client.get(f"/v1/runs/{run_id}").json())["status"] not in statuses:
            assert time.monotonic() < deadline, f"run {run_id} stuck in {run['status']}: {run}"
            time.sleep(0.2)
        return run

    def stop(self) -> None:
        for run in self.client.get("/v1/runs").json()["runs"]:
            if run["status"] in ("queued", "running"):
                self.client.delete(f"/v1/runs/{run['id']}")
        self.client.close()
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture
def server(tmp_path):
    s = Server(str(tmp_path / "svc"), header_timeout=1.0)
    yield s
    s.stop()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().split(b")")[-1].split()[0] != b"Z"
    except OSError:
        return False


def _pid_of(run_id: str) -> int | None:
    """The pid of the ``ampkit train`` process of ``run_id`` (its command line names the run's directory)."""
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/cmdline", "rb") as f:
                    words = f.read().split(b"\0")
            except OSError:
                continue
            if b"train" in words and any(f"/runs/{run_id}/".encode() in w for w in words):
                return int(name)
    return None


# --- 3. restart recovery and resume ---------------------------------------------------------------


@pytest.mark.slow
def test_a_run_that_finished_while_the_server_was_down_is_succeeded_with_its_summary(tmp_path):
    from ampkit.service.store import Store

    data = str(tmp_path / "svc")
    proc, c = _serve(data)
    try:
        rid = c.post("/v1/runs", json={"model": "mlp", "steps": 40, "precision": "fp32"}).json()[
            "id"
        ]
        deadline = time.monotonic() + 60
        while (pid := Store(data).get(rid)["pid"]) is None:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        os.kill(
            proc.pid, signal.SIGKILL
        )  # the server dies; the run (its own session) goes on and finishes
        proc.wait(timeout=10)
    finally:
        _end(proc)
        c.close()
    deadline = time.monotonic() + 120
    while _alive(pid):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert Store(data).get(rid)["status"] == "running"  # what the dead server last wrote
    proc, c = _serve(data)
    try:
        run = c.get(f"/v1/runs/{rid}").json()
        assert run["status"] == "succeeded", run
        assert (
            run["summary"]["optimizer_steps"] == 40
            and run["summary"]["final_loss"] > 0
            and run["error"] is None
        )
    finally:
        _end(proc)
        c.close()


@pytest.mark.slow
def test_fallback_then_cancel_then_resume_continues_in_bf16_and_succeeds(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    factory = "tests.service.unstable_factory:make"
    s = Server(str(tmp_path / "svc"), allowed_factories=(factory,))
    try:
        spec = {
            "model": factory,
            "precision": "fp16",
            "init_scale": 65536.0,
            "steps": 400,
            "checkpoint_every": 20,
            "amp": {"fallback": "fp16,bf16"},
        }
        r = s.client.post("/v1/runs", json=spec)
        assert r.status_code == 201, r.text
        rid = r.json()["id"]
        ckpt = os.path.join(s.data_dir, "runs", rid, "ckpt")
        deadline = time.monotonic() + 120
        while True:  # fell back, and a checkpoint after the fallback exists
            run = s.client.get(f"/v1/runs/{rid}").json()
            fell = [e["step"] for e in run.get("events", []) if e.get("kind") == "fallback"]
            steps = (
                [int(n[5:13]) for n in os.listdir(ckpt) if n.startswith("ckpt-")]
                if os.path.isdir(ckpt)
                else []
            )
            if fell and steps and max(steps) > fell[0]:
                break
            assert run["status"] in ("queued", "running") and time.monotonic() < deadline, run
            time.sleep(0.1)
        if s.client.delete(f"/v1/runs/{rid}").status_code == 409:
            pytest.skip("the run ended before it could be cancelled (a very fast machine)")
        assert s.client.post(f"/v1/runs/{rid}/resume").status_code == 202
        run = s.wait(rid, ("succeeded", "failed", "cancelled"), timeout=180)
        assert run["status"] == "succeeded", run
        assert run["summary"]["precision"] == "bf16" and run["summary"]["optimizer_steps"] == 400
        with open(os.path.join(s.data_dir, "runs", rid, "log-1", "log.jsonl")) as f:
            resumed = [json.loads(x) for x in f]
        kept = [x for x in resumed if x.get("type") == "step"]
        assert kept and all(x["precision"] == "bf16" for x in kept), kept[:3]
        assert not any(x.get("skipped") for x in kept[-10:]), kept[-3:]
    finally:
        s.stop()


# --- 5. body cap while reading, connection deadlines -------------------------------------------


@pytest.mark.slow
def test_an_8_mib_chunked_body_gets_413_before_it_is_read(server):
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    sock.sendall(
        b"POST /v1/runs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer tok-alice\r\n"
        b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    chunk, sent, answer = b"x" * 65536, 0, b""
    try:
        while sent < 8 << 20:
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
            if select.select([sock], [], [], 0.02)[0]:
                answer = sock.recv(65536)
                break
    except OSError:  # the server closed the connection after answering
        answer = answer or sock.recv(65536)
    finally:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert sent <= 4 << 20, f"the server read {sent} bytes before refusing"  # the cap is 1 MiB
    assert server.client.get("/health").status_code == 200


@pytest.mark.slow
def test_silent_and_slow_header_connections_are_closed(server):
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(20)]
    for s in socks[:10]:
        s.sendall(b"GET /health HTTP/1.1\r\nHo")  # a request head that never completes
    start = time.monotonic()
    slow = socks[10]
    closed = set()
    while len(closed) < len(socks) and time.monotonic() - start < 120:  # only catches a hang
        for i, s in enumerate(socks):
            if i in closed:
                continue
            if i == 10:
                try:
                    s.sendall(b"X")  # a byte at a time: the deadline is for the whole head
                except OSError:
                    closed.add(i)
                    continue
            if select.select([s], [], [], 0)[0]:
                try:
                    data = s.recv(1024)
                except OSError:
                    data = b""
                if data == b"":
                    closed.add(i)
        time.sleep(0.1)
    took = time.monotonic() - start
    for s in socks:
        s.close()
    assert len(closed) == len(socks), f"{len(socks) - len(closed)} still open after {took:.1f} s"
    del slow
    # a kept-alive client is still served: the deadline is per request head, reset after each answer
    assert server.client.get("/health").status_code == 200
    time.sleep(0.3)
    assert server.client.get("/health").status_code == 200


# --- 6. private files and docs ------------------------------------------------------------------


@pytest.mark.slow
def test_files_are_private_under_umask_022(tmp_path):
    old = os.umask(0o022)
    try:
        s = Server(str(tmp_path / "svc"))
        try:
            r = s.client.post(
                "/v1/runs",
                json={
                    "model": "gpt",
                    "size": "tiny",
                    "steps": 4,
                    "precision": "fp32",
                    "texts": ["one private sentence", "and another one"],
                    "max_length": 8,
                    "batch_size": 2,
                    "checkpoint_every": 2,
                    "save_model": True,
                },
            )
            assert r.status_code == 201, r.text
            run = s.wait(r.json()["id"], ("succeeded", "failed"))
            assert run["status"] == "succeeded", run
        finally:
            s.stop()
    finally:
        os.umask(old)
    data = str(tmp_path / "svc")
    seen = {"db": 0, "wal": 0, "texts": 0, "model": 0, "log": 0, "ckpt": 0}
    for root, dirs, files in os.walk(data):
        for d in dirs:
            assert stat.S_IMODE(os.stat(os.path.join(root, d)).st_mode) == 0o700, os.path.join(
                root, d
            )
        for f in files:
            path = os.path.join(root, f)
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, (path, oct(os.stat(path).st_mode))
            for key, part in (
                ("db", "ampkit.db"),
                ("wal", "-wal"),
                ("texts", "texts.json"),
                ("model", "model"),
                ("log", "log.jsonl"),
                ("ckpt", "ckpt-"),
            ):
                seen[key] += part in f or (key == "model" and "model" in root)
    assert stat.S_IMODE(os.stat(data).st_mode) == 0o700
    assert all(seen.values()), seen  # every kind of file was there to be checked


@pytest.mark.slow
def test_private_docs_need_the_token(tmp_path):
    s = Server(str(tmp_path / "svc"), private_docs=True)
    try:
        anon = httpx.Client(base_url=f"http://127.0.0.1:{s.port}")
        for path in ("/docs", "/openapi.json", "/redoc"):
            assert anon.get(path).status_code in (401, 404), path
        assert anon.get("/openapi.json").status_code == 401
        assert s.client.get("/openapi.json").json()["info"]["title"] == "ampkit"
        assert "swagger" in s.client.get("/docs").text.lower()
        assert anon.get("/health").status_code == 200
        anon.close()
    finally:
        s.stop()
    s = Server(str(tmp_path / "svc2"))
    try:  # the default: the description is public, as FastAPI serves it
        assert httpx.get(f"http://127.0.0.1:{s.port}/openapi.json").status_code == 200
    finally:
        s.stop()


# --- 7. disk full ---------------------------------------------------------------------------------


def _unshare_works() -> bool:
    try:
        return (
            subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=10).returncode
            == 0
        )
    except (OSError, subprocess.SubprocessError):
        return False


@pytest.mark.slow
def test_submit_on_a_file_size_limit_is_507_and_the_server_goes_on(tmp_path):
    """ENOSPC's unprivileged twin: RLIMIT_FSIZE (EFBIG) on the server, the texts file of a run past it."""
    launcher = (
        "import resource, signal, sys; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (400_000, 400_000)); "
        "from ampkit.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    proc, c = _serve(str(tmp_path / "svc"), launcher=launcher)
    try:
        spec = {
            "model": "gpt",
            "size": "tiny",
            "steps": 2,
            "texts": ["a long sentence " * 50] * 600,
        }
        r = c.post("/v1/runs", json=spec)
        assert r.status_code == 507, r.text
        assert "disk is full" in r.json()["detail"] and r.headers["retry-after"]
        assert c.get("/v1/runs").json()["runs"] == []  # nothing half-stored
        assert c.post("/v1/runs", json={**spec, "texts": ["short"] * 4}).status_code == 201
    finally:
        _end(proc)
        c.close()


@pytest.mark.slow
@pytest.mark.skipif(
    not _unshare_works(), reason="cannot mount a tmpfs here (no unprivileged user namespaces)"
)
def test_disk_full_tmpfs_start_refused_with_a_reason_submit_507(tmp_path):
    full, sig = str(tmp_path / "full"), str(tmp_path / "sig")
    os.makedirs(full)
    os.makedirs(sig)
    # 1. a server started on a full disk says why and exits non-zero
    fill = f"mount -t tmpfs -o size=256k tmpfs {full} && (dd if=/dev/zero of={full}/filler bs=4k 2>/dev/null; true)"
    out = subprocess.run(
        [
            "unshare",
            "-rm",
            "sh",
            "-c",
            f"{fill} && exec {sys.executable} -m ampkit serve "
            f"--port {free_port()} --data_dir {full}/svc",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "AMPKIT_TOKEN": "t"},
    )
    assert out.returncode != 0
    assert "No space left on device" in out.stderr and f"{full}/svc" in out.stderr, out.stderr[
        -2000:
    ]
    # 2. a server whose disk fills up: submit answers 507; a run that ends is not shown running
    script = (
        f"mount -t tmpfs -o size=4m tmpfs {full} && {{ {sys.executable} -m ampkit serve --port $PORT "
        f"--data_dir {full}/svc & }} && while [ ! -e {sig}/fill ]; do sleep 0.1; done; "
        f"dd if=/dev/zero of={full}/filler bs=4k 2>/dev/null; touch {sig}/filled; "
        f"while [ ! -e {sig}/free ]; do sleep 0.1; done; rm {full}/filler; touch {sig}/freed; wait"
    )
    port = free_port()
    env = {**os.environ, "AMPKIT_TOKENS": "alice:tok-alice", "PORT": str(port)}
    proc = subprocess.Popen(
        ["unshare", "-rm", "sh", "-c", script],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    c = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30, headers=ALICE)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                if c.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[
                -2000:
            ]
            time.sleep(0.2)
        rid = c.post(
            "/v1/runs", json={"model": "mlp", "steps": 1_000_000, "precision": "fp32"}
        ).json()["id"]
        deadline = time.monotonic() + 60
        while (pid := _pid_of(rid)) is None or c.get(f"/v1/runs/{rid}").json()[
            "status"
        ] != "running":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        open(os.path.join(sig, "fill"), "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(sig, "filled")):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        r = c.post(
            "/v1/runs",
            json={"model": "gpt", "size": "tiny", "steps": 2, "texts": ["some words"] * 50},
        )
        assert r.status_code == 507, r.text
        assert "disk is full" in r.json()["detail"]
        os.killpg(pid, signal.SIGKILL)  # the run ends while the disk is full
        deadline = time.monotonic() + 30
        while (now := c.get(f"/v1/runs/{rid}").json())["status"] == "running":
            assert time.monotonic() < deadline, now
            time.sleep(0.1)
        assert now["status"] == "failed" and "killed by signal 9" in now["error"], now
        open(os.path.join(sig, "free"), "w").close()
        deadline = time.monotonic() + 60
        while not os.path.exists(os.path.join(sig, "freed")):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert (
            c.post("/v1/runs", json={"model": "mlp", "steps": 2, "precision": "fp32"}).status_code
            == 201
        )
        listed = {r["id"]: r["status"] for r in c.get("/v1/runs").json()["runs"]}
        assert listed[rid] == "failed"
    finally:
        c.close()
        for name in ("fill", "free"):
            open(os.path.join(sig, name), "a").close()
        _end(proc)


# --- 8. request log, killed runs, the temperature hold ------------------------------------------


@pytest.mark.slow
def test_one_request_log_line_per_call(server):
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    log = logging.getLogger("ampkit.service")
    handler, level = Keep(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        server.client.get("/v1/runs")
        server.client.get("/v1/runs/nope")
        httpx.get(f"http://127.0.0.1:{server.port}/v1/runs")
        server.client.post("/v1/runs", content=b"x" * (2 << 20))
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    lines = [
        json.loads(r.getMessage().partition(" ")[2])
        for r in records
        if r.getMessage().startswith("request ")
    ]
    assert [(x["owner"], x["method"], x["route"], x["status"]) for x in lines] == [
        ("alice", "GET", "/v1/runs", 200),
        ("alice", "GET", "/v1/runs/{run_id}", 404),
        (None, "GET", "/v1/runs", 401),
        ("alice", "POST", "/v1/runs", 413),
    ]
    assert all(isinstance(x["ms"], float) and 0 <= x["ms"] < 30_000 for x in lines)


@pytest.mark.slow
def test_a_run_killed_from_outside_says_which_signal(server):
    rid = server.client.post("/v1/runs", json=LONG).json()["id"]
    server.wait(rid, ("running",))
    deadline = time.monotonic() + 60
    while not server.client.get(f"/v1/runs/{rid}/metrics").json()[
        "records"
    ]:  # training, past its header
        assert time.monotonic() < deadline
        time.sleep(0.1)
    os.killpg(server.app.state.store.get(rid)["pid"], signal.SIGKILL)
    run = server.wait(rid, ("failed",), timeout=30)
    assert run["error"] == "killed by signal 9 (SIGKILL)", run["error"]
    health = server.client.get("/health").json()
    import torch

    if not torch.cuda.is_available():
        assert "gpus" not in health and "held" not in health  # CPU: no GPU fields


@pytest.mark.slow
def test_queued_runs_wait_while_a_device_is_too_hot(tmp_path):
    """The hold, with a real temperature reader (a sensor file) given to the runner as a parameter."""
    from ampkit.service.gpu import TempHold
    from ampkit.service.runner import Runner
    from ampkit.service.store import Store

    sensor = tmp_path / "temp"

    def read_sensor() -> list[float]:
        return [float(x) for x in sensor.read_text().split()]

    store = Store(str(tmp_path / "svc"))
    runner = Runner(store, max_gpu_temp=80.0, read_temps=read_sensor)
    runner.hold.every_s = 0.0  # read the sensor on every tick
    spec = {
        "model": "mlp",
        "size": "tiny",
        "steps": 2,
        "precision": "fp32",
        "device": "cpu",
        "batch_size": 8,
    }
    from ampkit.service.runfile import write_run_file

    d = str(tmp_path / "svc" / "runs" / "r1")
    write_run_file(spec, d)
    store.create("r1", "alice", "train", spec, d)
    sensor.write_text("71.0 92.5")
    for _ in range(3):
        runner.tick()
    assert store.get("r1")["status"] == "queued"
    assert "92.5" in runner.hold.reason and "80" in runner.hold.reason
    sensor.write_text("71.0 78.0")
    runner.tick()
    assert runner.hold.reason is None and store.get("r1")["status"] == "running"
    deadline = time.monotonic() + 120
    while store.get("r1")["status"] == "running":
        assert time.monotonic() < deadline
        runner.tick()
        time.sleep(0.2)
    assert store.get("r1")["status"] == "succeeded", store.get("r1")
    assert TempHold(None).held() is False  # no limit: never held
