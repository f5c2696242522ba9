"""The service through faults (issue 34, sections 3-5): damaged files are detected and never used
(a cut ``run.toml``, an empty ``ampkit.db``), the scheduler outlives any error (a full disk whose
log cannot be written either), one server per data directory, size limits without building the
model, booleans are not numbers, a private data directory, and ``memory_savings_gb`` for every
finished run. Every wait is bounded; no test asserts a duration."""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import stat
import subprocess
import sys
import time
import typing

import pytest

pytest.importorskip("fastapi")

from ampkit.service import runner as runner_mod  # noqa: E402
from ampkit.service.runfile import RUN_FILE, TEXTS_FILE, write_run_file  # noqa: E402
from ampkit.service.runner import Runner  # noqa: E402
from ampkit.service.schemas import (  # noqa: E402
    DatasetConfig,
    MixedPrecisionBody,
    OptimizeBody,
    OptimizedBody,
    RecommendSpec,
    RunSpec,
    SetupBody,
    TrainBody,
    TrainingConfig,
)
from ampkit.service.store import Store  # noqa: E402
from ampkit.step.config import ConfigError  # noqa: E402

TOKENS = {"tok-alice": "alice"}
ALICE = {"Authorization": "Bearer tok-alice"}


def _wait(what: typing.Callable[[], object], timeout: float = 120, why: str = "") -> object:
    """``what()`` once it is truthy; fails after ``timeout`` s (a hang, not a duration)."""
    deadline = time.monotonic() + timeout
    while not (got := what()):
        assert time.monotonic() < deadline, why or "timed out"
        time.sleep(0.05)
    return got


def _queue(store: Store, run_id: str, spec: dict, data_dir: str) -> dict:
    run_dir = os.path.join(data_dir, "runs", run_id)
    spec = RunSpec(**spec).model_dump()
    write_run_file(spec, run_dir)
    return store.create(run_id, "alice", "train", spec, run_dir)


# --- section 3: damaged files are detected, never used ---------------------------------------------


def _cut_at_line(path: str, key: str) -> None:
    """Keep the lines of ``path`` up to (not including) the one that starts with ``key``: TOML still."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines(keepends=True)
    keep = lines[: next(i for i, ln in enumerate(lines) if ln.startswith(key))]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(keep)


def test_a_cut_run_file_and_an_empty_database_are_each_reported_and_never_used(tmp_path):
    import tomllib

    from ampkit.cli.config_file import read_config_file
    from ampkit.service.runfile import check_run_file
    from tests.service.test_service_runfile import _subparser

    # a run file cut at a line boundary is still TOML (4 steps of 40): `ampkit train --config` refuses it
    path = write_run_file(
        RunSpec(model="mlp", steps=40, batch_size=4, log_every=1).model_dump(),
        str(tmp_path / "run"),
    )
    sub = _subparser("train")
    assert read_config_file(sub, path).train["steps"] == 40  # whole: read as before
    _cut_at_line(path, "steps")
    with open(path, "rb") as f:
        tomllib.load(f)  # still valid TOML
    with pytest.raises(ConfigError, match="run file .*run.toml.* is damaged: .*cut short"):
        read_config_file(sub, path)
    with pytest.raises(ValueError, match="damaged"):
        check_run_file(str(tmp_path / "run"))

    # an empty database is refused, named, with the way back; the file is left as it was
    data = tmp_path / "svc"
    data.mkdir()
    (data / "ampkit.db").write_bytes(b"")
    with pytest.raises(OSError) as e:  # DamagedStore
        Store(str(data))
    msg = str(e.value)
    assert (
        str(data / "ampkit.db") in msg and "empty" in msg and "backup" in msg and "move it" in msg
    ), msg
    assert (data / "ampkit.db").stat().st_size == 0
    (data / "ampkit.db").write_bytes(b"not a database at all" * 100)
    with pytest.raises(OSError, match="not an SQLite database"):
        Store(str(data))


def test_a_users_own_config_needs_no_seal_and_a_changed_run_file_is_refused(tmp_path):
    from ampkit.step.config import read_toml

    own = tmp_path / "own.toml"
    own.write_text("[train]\nsteps = 4\n")
    assert read_toml(str(own)) == {"train": {"steps": 4}}
    path = write_run_file(RunSpec(model="mlp", steps=40).model_dump(), str(tmp_path / "run"))
    assert read_toml(path)["train"]["steps"] == 40
    with open(path, encoding="utf-8") as f:
        text = f.read()
    with open(path, "w", encoding="utf-8") as f:
        f.write(text.replace("steps = 40", "steps = 4"))
    with pytest.raises(ConfigError, match="digest does not match"):
        read_toml(path)


def test_a_new_store_is_whole_and_reopens(tmp_path):
    store = Store(str(tmp_path / "svc"))
    store.create("r0", "alice", "train", {"model": "mlp"}, str(tmp_path / "r0"))
    assert Store(str(tmp_path / "svc")).get("r0")["owner"] == "alice"
    assert sorted(os.listdir(tmp_path / "svc")) == [
        "ampkit.db",
        "ampkit.db-shm",
        "ampkit.db-wal",
        "runs",
    ]


def test_the_runner_refuses_a_cut_run_file(tmp_path):
    store = Store(str(tmp_path))
    run = _queue(store, "r0", {"model": "mlp", "steps": 40}, str(tmp_path))
    _cut_at_line(os.path.join(run["run_dir"], RUN_FILE), "steps")
    Runner(store).tick()
    got = store.get("r0")
    assert got["status"] == "failed" and "damaged" in got["error"] and got["pid"] is None, got


# --- section 4: the service keeps serving through faults ---------------------------------------------


class _FullDisk:
    """A writer on a full disk: every write raises ENOSPC."""

    def write(self, *a: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    def flush(self) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")


class _FullLog(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.slow
def test_a_disk_full_episode_does_not_end_the_scheduler(tmp_path, monkeypatch):
    """While the disk is full the database cannot be written and neither can the log: the run that
    failed meanwhile is recorded failed once there is room, and the run queued behind it starts."""
    store = Store(str(tmp_path))
    bad = _queue(
        store,
        "a",
        {
            "model": "gpt",
            "texts": ["hello there", "general kenobi"],
            "max_length": 8,
            "steps": 2,
            "precision": "fp32",
        },
        str(tmp_path),
    )
    os.unlink(os.path.join(bad["run_dir"], TEXTS_FILE))  # its process fails at start (no data file)
    time.sleep(0.01)
    _queue(store, "b", {"model": "mlp", "steps": 1, "precision": "fp32"}, str(tmp_path))
    full = {"on": False}
    update = store.update

    def update_unless_full(*a: object, **k: object) -> bool:
        if full["on"]:
            raise sqlite3.OperationalError("database or disk is full")
        return update(*a, **k)

    monkeypatch.setattr(store, "update", update_unless_full)
    runner = Runner(store, max_concurrent=1, poll_s=0.05)
    log = logging.getLogger("ampkit.service")
    handler = _FullLog()
    log.addHandler(handler)
    try:
        runner.start()
        pid = _wait(lambda: store.get("a")["pid"], why=f"run a never started: {store.get('a')}")
        full["on"] = True
        monkeypatch.setattr(sys, "stderr", _FullDisk())
        _wait(lambda: not runner_mod._alive(pid, bad["run_dir"]), why="run a's process did not end")
        _wait(lambda: runner.unrecorded.get("a"), why="the runner never saw run a end")
        time.sleep(
            1.0
        )  # ~20 ticks with the disk full (not a duration check: the assertions hold at any speed)
        assert runner._thread.is_alive(), "the scheduler thread ended"
        assert runner.scheduler()["alive"] and runner.scheduler()["error"], runner.scheduler()
        assert store.get("a")["status"] == "running"  # not written yet: the disk is full
        full["on"] = False
        monkeypatch.setattr(sys, "stderr", sys.__stderr__)
        _wait(
            lambda: store.get("b")["status"] in ("succeeded", "failed"),
            why=f"run b never ran after the episode: {store.get('b')}",
        )
        a, b = store.get("a"), store.get("b")
        assert a["status"] == "failed" and TEXTS_FILE in (a["error"] or ""), a
        assert b["status"] == "succeeded", b
        assert runner.scheduler()["alive"] and runner.scheduler()["error"] is None, (
            runner.scheduler()
        )
    finally:
        log.removeHandler(handler)
        runner.stop()


def test_health_says_whether_the_scheduler_is_alive(tmp_path):
    from fastapi.testclient import TestClient

    from ampkit.service.app import ServiceConfig, create_app

    app = create_app(ServiceConfig(data_dir=str(tmp_path / "svc"), poll_s=0.05), tokens=TOKENS)
    with TestClient(app) as c:
        r = c.get("/health")
        assert r.status_code == 200 and r.json()["scheduler"]["alive"] is True, r.json()
        app.state.runner.stop()  # the scheduler thread ends (as one killed by an error would)
        r = c.get("/health")
        assert r.status_code == 503, r.text
        assert r.json()["status"] == "degraded" and r.json()["scheduler"]["alive"] is False, (
            r.json()
        )


def _start_serve(data: str) -> subprocess.Popen:
    from tests.support.dist_helpers import free_port

    env = {**os.environ, "AMPKIT_TOKENS": "alice:tok-alice"}
    return subprocess.Popen(
        [sys.executable, "-m", "ampkit", "serve", "--port", str(free_port()), "--data_dir", data],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )


@pytest.mark.slow
def test_a_second_server_on_one_data_dir_is_refused(tmp_path):
    pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    from tests.service.server_process import end, serve

    data = str(tmp_path / "svc")
    first, client = serve(data)
    try:
        second = _start_serve(data)
        try:
            _, err = second.communicate(timeout=120)
        finally:
            end(second)
        err = err.decode()
        assert second.returncode == 2, err[-2000:]
        assert (
            os.path.realpath(data) in err
            and f"pid {first.pid}" in err
            and "another ampkit server" in err
        ), err
        assert client.get("/health").status_code == 200  # the first keeps serving
    finally:
        client.close()
        end(first)
    third, client = serve(data)  # the lock went with the first server
    client.close()
    end(third)


def test_the_lock_is_shared_within_a_process_and_refused_across(tmp_path):
    from ampkit.service import lock

    key = lock.hold(str(tmp_path))
    again = lock.hold(str(tmp_path))  # an embedded app and serve() in one process share it
    code = (
        "import sys; from ampkit.service import lock\n"
        "try:\n    lock.hold(sys.argv[1])\nexcept lock.DataDirBusy as e:\n    print(e); sys.exit(3)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 3 and f"pid {os.getpid()}" in out.stdout, (out.stdout, out.stderr)
    lock.release(again)
    lock.release(key)
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, (out.stdout, out.stderr)


@pytest.mark.slow
def test_serve_refuses_an_empty_database(tmp_path):
    pytest.importorskip("uvicorn")
    data = tmp_path / "svc"
    data.mkdir()
    (data / "ampkit.db").write_bytes(b"")
    proc = _start_serve(str(data))
    try:
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert (
        proc.returncode == 2 and str(data / "ampkit.db") in err.decode() and "empty" in err.decode()
    ), err
    assert (data / "ampkit.db").stat().st_size == 0


def test_a_deep_config_is_sized_without_building_its_blocks(tmp_path, monkeypatch):
    """n_layer=8000: the parameter count comes from 1-, 2- and 3-block copies, not 8000 blocks."""
    pytest.importorskip("transformers")
    from fastapi.testclient import TestClient
    from transformers.models.gpt2 import modeling_gpt2

    from ampkit.service import deps
    from ampkit.service.app import ServiceConfig, create_app

    built = []
    init = modeling_gpt2.GPT2Block.__init__

    def counted(self, *a, **k):
        built.append(1)
        init(self, *a, **k)

    monkeypatch.setattr(modeling_gpt2.GPT2Block, "__init__", counted)
    deps.hf_parameters.cache_clear()
    n = deps.hf_parameters("gpt2", (("n_layer", 8000),))
    d, v, pos = (
        768,
        50257,
        1024,
    )  # GPT-2's own arithmetic: embeddings, 8000 blocks, the final norm (head tied)
    assert n == v * d + pos * d + 8000 * (12 * d * d + 13 * d) + 2 * d
    assert len(built) <= 6, f"{len(built)} GPT-2 blocks built to count the parameters"
    app = create_app(ServiceConfig(data_dir=str(tmp_path / "svc")), tokens=TOKENS)
    r = TestClient(app).post(
        "/v1/runs", json={"model": "gpt2", "model_overrides": {"n_layer": 8000}}, headers=ALICE
    )
    assert r.status_code == 422 and "over this server's limit" in r.text, r.text
    assert len(built) <= 6


FIRST_REQUEST = """
import sys
from fastapi.testclient import TestClient
from ampkit.service.app import ServiceConfig, create_app

app = create_app(ServiceConfig(data_dir=sys.argv[1]), tokens={"tok": "alice"})
with TestClient(app) as client:  # the lifespan has run: the server is up, as after `ampkit serve`
    before = set(sys.modules)
    r = client.post(
        "/v1/runs", json={"model": "gpt2", "model_overrides": {"n_layer": 8000}},
        headers={"Authorization": "Bearer tok"},
    )
    assert r.status_code == 422 and "over this server's limit" in r.text, r.text
    print(sorted(m for m in set(sys.modules) - before if m.startswith("transformers")))
"""


@pytest.mark.slow  # a fresh process: what the first request of a new server imports
def test_the_first_size_check_of_a_new_server_imports_nothing(tmp_path):
    """The first 8000-layer request of a fresh `ampkit serve` took 2.3 s and +135 MB (loaded EPYC):
    it imported transformers' modeling code (torch._dynamo underneath), 1.5-2 s, inside the
    request. The server imports it while it starts, so the request itself imports nothing."""
    pytest.importorskip("transformers")
    out = subprocess.run(
        [sys.executable, "-c", FIRST_REQUEST, str(tmp_path / "svc")],
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard only
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-3000:]


# every request model, with the least body it takes
BODIES = {
    RunSpec: {},
    RecommendSpec: {},
    MixedPrecisionBody: {},
    SetupBody: {},
    DatasetConfig: {"texts": ["ab"]},
    TrainingConfig: {},
    TrainBody: {"dataset_config": {"texts": ["ab"]}},
    OptimizedBody: {"dataset_config": {"texts": ["ab"]}},
    OptimizeBody: {"gpu_memory_gb": 8},
}


def _numbers(annotation: object) -> bool:
    return annotation in (float, int) or any(_numbers(a) for a in typing.get_args(annotation))


@pytest.mark.parametrize("model", list(BODIES), ids=lambda m: m.__name__)
def test_booleans_are_not_numbers_in_any_request_model(model):
    import json

    from pydantic import ValidationError

    fields = [name for name, f in model.model_fields.items() if _numbers(f.annotation)]
    assert fields or model is DatasetConfig
    for name in fields:
        for value in (True, False):
            with pytest.raises(ValidationError, match=name):
                model.model_validate_json(json.dumps({**BODIES[model], name: value}))
    if "lr" in fields:  # a whole number is still a number
        assert model.model_validate_json('{"lr": 1}').lr == 1.0


def test_bool_lr_and_max_seconds_are_422(tmp_path):
    from fastapi.testclient import TestClient

    from ampkit.service.app import ServiceConfig, create_app

    c = TestClient(create_app(ServiceConfig(data_dir=str(tmp_path / "svc")), tokens=TOKENS))
    for body in ({"lr": True}, {"max_seconds": True}, {"weight_decay": False}):
        r = c.post("/v1/runs", json={"model": "mlp", **body}, headers=ALICE)
        assert r.status_code == 422 and next(iter(body)) in r.text, r.text
    r = c.post(
        "/finetuning/mixed-precision",
        headers=ALICE,
        json={"dataset_config": {"texts": ["ab"]}, "training_config": {"learning_rate": True}},
    )
    assert r.status_code == 422 and "learning_rate" in r.text, r.text


def test_a_new_data_dir_is_private(tmp_path):
    from ampkit.service.server import preflight

    old = os.umask(0o022)
    try:
        preflight(str(tmp_path / "svc"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "svc").st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o750, 0o705])
def test_an_open_data_dir_is_named_with_its_fix_and_left_as_it_is(tmp_path, mode):
    """An existing data dir that others can read or write: one warning naming it, its mode and the
    ``chmod 700`` fix; its mode is not changed behind the operator's back (issue 34 §4)."""
    import warnings

    from ampkit.service.server import preflight

    svc = tmp_path / "svc"
    svc.mkdir()
    os.chmod(svc, mode)
    with pytest.warns(UserWarning) as caught:
        preflight(str(svc))
    assert len(caught) == 1
    text = str(caught[0].message)
    assert str(svc) in text and f"{mode:o}" in text and f"chmod 700 {svc}" in text
    assert "\n" not in text
    assert stat.S_IMODE(os.stat(svc).st_mode) == mode
    os.chmod(svc, 0o700)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        preflight(str(svc))  # private: nothing to say


# --- section 5: memory_savings_gb for every finished run ------------------------------------------


@pytest.mark.slow
def test_a_worker_that_cannot_start_does_not_stop_the_next_job(monkeypatch):
    """A job whose worker process cannot be started fails; the jobs after it still run. (It used
    to end the job thread: every later estimate waited out its time, and every finished run's
    ``memory_savings_gb`` was null.)"""
    import multiprocessing.process

    from ampkit.service.jobs import Jobs

    start = multiprocessing.process.BaseProcess.start
    calls = []

    def flaky(self):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("cannot start a process now")
        return start(self)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", flaky)
    jobs = Jobs(timeout_s=300)
    try:
        first = jobs.wait(jobs.submit("x", "k1", "os.path:join", ("a", "b")), 120)
        assert first["status"] == "failed" and "cannot start" in first["error"], first
        second = jobs.wait(jobs.submit("x", "k2", "os.path:join", ("a", "b")), 300)
        assert second["status"] == "succeeded" and second["result"] == os.path.join("a", "b"), (
            second
        )
    finally:
        jobs.close()


def test_a_run_failed_by_a_full_disk_says_its_own_error_first(tmp_path):
    """A run that failed on a full disk was recorded with its supervisor's line ("cannot write
    exit-0.json") instead of the run's own error; the run's line comes first, the supervisor's
    trouble is not the cause."""
    log = tmp_path / "stderr-0.log"
    log.write_text(
        "ampkit train: mlp/tiny on cpu in fp32\n"
        "ampkit train: error: No space left on device\n"
        "ampkit supervisor: cannot write /x/exit-0.json: OSError: [Errno 28] No space left\n"
    )
    assert runner_mod._tail(str(log)) == "ampkit train: error: No space left on device"
    log.write_text("ampkit supervisor: cannot start the run: FileNotFoundError: python\n")
    assert "cannot start the run" in runner_mod._tail(str(log))  # the only error there is


def test_a_record_that_cannot_be_written_leaves_no_temporary_file(tmp_path, monkeypatch):
    """On a full disk the supervisor's exit record failed at its sync and left
    ``exit-0.json.tmp-PID`` behind in the run directory."""
    from ampkit.service import supervise

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(supervise.os, "fsync", full)
    with pytest.raises(OSError):
        supervise.write_private(str(tmp_path / "exit-0.json"), b"{}")
    assert os.listdir(tmp_path) == []


def test_a_port_in_use_is_one_clear_error_before_anything_starts(tmp_path):
    """``ampkit serve --port P`` with P taken printed its banner, opened the database, then
    uvicorn's ``ERROR: [Errno 98] error while attempting to bind`` and exit 3. Now: an OSError
    naming the address and what to do, and the data directory's lock is released."""
    import socket

    pytest.importorskip("uvicorn")
    from ampkit.service import lock
    from ampkit.service.server import serve

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        with pytest.raises(OSError) as e:
            serve("127.0.0.1", port, data_dir=str(tmp_path / "svc"))
    finally:
        taken.close()
    assert e.value.errno == errno.EADDRINUSE
    assert f"127.0.0.1:{port}" in str(e.value) and "--port" in str(e.value), str(e.value)
    lock.release(lock.hold(str(tmp_path / "svc")))  # free again


@pytest.mark.parametrize("where", ["run file", "database"])
def test_a_submit_refused_by_a_full_disk_leaves_no_run_directory(tmp_path, monkeypatch, where):
    """A 507 ("nothing was stored") left ``runs/<id>/`` behind: empty when the run file could not
    be written, holding an orphan run.toml when the database could not."""
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from ampkit.service import runfile
    from ampkit.service.app import ServiceConfig, create_app

    def full(*a, **kw):
        if where == "database":
            raise sqlite3.OperationalError("database or disk is full")
        raise OSError(errno.ENOSPC, "No space left on device")

    app = create_app(ServiceConfig(data_dir=str(tmp_path / "svc")), tokens=TOKENS)
    if where == "database":
        monkeypatch.setattr(Store, "create", full)
    else:
        monkeypatch.setattr(runfile.tomlio, "write", full)
    c = TestClient(app)  # no lifespan: nothing starts
    r = c.post(
        "/v1/runs",
        json={"model": "gpt", "size": "tiny", "texts": ["some text"]},
        headers={"Authorization": "Bearer tok-alice"},
    )
    assert r.status_code == 507, r.text
    assert os.listdir(tmp_path / "svc" / "runs") == []


def test_serve_announces_itself_only_once_it_listens(tmp_path, capsys):
    """``ampkit serve`` printed ``ampkit serve: http://127.0.0.1:P ...`` and then failed (a port
    in use, a data directory another server holds): the start line now comes once it listens."""
    import socket

    pytest.importorskip("uvicorn")
    from ampkit.cli import main

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    try:
        port = str(taken.getsockname()[1])
        assert main(["serve", "--port", port, "--data_dir", str(tmp_path / "svc")]) == 2
    finally:
        taken.close()
    out, err = capsys.readouterr()
    assert "http://" not in out and "cannot listen on 127.0.0.1:" in err, (out, err)


def test_a_runs_texts_file_is_written_atomically(tmp_path, monkeypatch):
    """The training texts beside the run file go through a temporary file as the run file does: a
    write that fails (a full disk at fsync) leaves no texts file, half or whole, and no temporary
    file; the error says so."""
    spec = RunSpec(model="gpt", steps=2, texts=["hello there", "general kenobi"]).model_dump()

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="No space left"):
        write_run_file(spec, str(tmp_path / "run"))
    monkeypatch.undo()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == []
    path = write_run_file(spec, str(tmp_path / "run"))
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == sorted([RUN_FILE, TEXTS_FILE])
    assert os.path.basename(path) == RUN_FILE
