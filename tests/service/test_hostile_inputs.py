"""Hostile and malformed requests (issue 23): each is a clear 422 (or 413) at submit naming the
field, never a 500 and never a run that wedges the queue. In-process (FastAPI's TestClient, the
scheduler not started) unless marked slow."""

from __future__ import annotations

import json
import sys
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from ampkit.service import runner as runner_mod  # noqa: E402
from ampkit.service.app import ServiceConfig, create_app  # noqa: E402
from ampkit.service.runner import Runner  # noqa: E402
from ampkit.service.store import Store  # noqa: E402

TOKENS = {"tok-alice": "alice", "tok-bob": "bob"}
ALICE = {"Authorization": "Bearer tok-alice"}
BOB = {"Authorization": "Bearer tok-bob"}
NUL, SURROGATE, LONG = "a\x00b", "a\ud800b", "x" * 200_000
TEXTS = ["hello world", "second text"]
GPT2 = {
    "model": "gpt2",
    "model_overrides": {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 64},
}


def post(c: TestClient, path: str, body: dict, headers: dict = ALICE):
    """POST ``body`` as JSON written with ensure_ascii (a lone surrogate travels as ``\\ud800``, as
    a hostile client sends it)."""
    return c.post(
        path, content=json.dumps(body), headers={**headers, "content-type": "application/json"}
    )


@pytest.fixture
def client(tmp_path):
    app = create_app(ServiceConfig(data_dir=str(tmp_path / "svc"), body_cap=1 << 20), tokens=TOKENS)
    return TestClient(app)  # no lifespan: the scheduler does not run, runs stay queued


def _is_422(r, *words: str) -> None:
    assert r.status_code == 422, (r.status_code, r.text[:500])
    assert len(r.content) < 20_000  # the value is not echoed back whole
    for w in words:
        assert w in r.text, (w, r.text[:800])


# --- 1. strings: NUL, lone surrogates, absurd lengths; the scheduler never wedges -----------------


@pytest.mark.parametrize("bad", [NUL, SURROGATE, LONG], ids=["nul", "surrogate", "long"])
@pytest.mark.parametrize(
    "field,body",
    [
        ("model_overrides", lambda v: {**GPT2, "model_overrides": {"summary_type": v}}),
        ("model_overrides", lambda v: {**GPT2, "model_overrides": {v: 1}}),
        ("user_id", lambda v: {"model": "mlp", "user_id": v}),
        ("keep_fp32", lambda v: {"model": "mlp", "amp": {"keep_fp32": [v]}}),
        ("amp", lambda v: {"model": "mlp", "amp": {v: 1}}),
        ("model", lambda v: {"model": v}),
        ("precision", lambda v: {"precision": v}),
        ("device", lambda v: {"device": v}),
    ],
)
def test_bad_strings_in_a_run_are_422_naming_the_field(client, bad, field, body):
    r = post(client, "/v1/runs", body(bad))
    _is_422(r, field)
    assert client.get("/v1/runs", headers=ALICE).status_code == 200  # the listing still answers


@pytest.mark.parametrize("bad", [NUL, SURROGATE], ids=["nul", "surrogate"])
def test_bad_texts_are_422(client, bad):
    _is_422(post(client, "/v1/runs", {"model": "gpt", "texts": ["fine text", bad]}), "texts")
    brief = {"model_name": "gpt2", "dataset_config": {"texts": [bad, "ok text"]}, "user_id": 1}
    _is_422(post(client, "/finetuning/mixed-precision", brief), "texts")


@pytest.mark.parametrize("bad", [NUL, SURROGATE, LONG], ids=["nul", "surrogate", "long"])
def test_bad_strings_on_the_brief_routes_are_422(client, bad):
    brief = {"model_name": "gpt2", "dataset_config": {"texts": TEXTS}}
    _is_422(post(client, "/finetuning/mixed-precision", {**brief, "user_id": bad}), "user_id")
    _is_422(post(client, "/finetuning/optimized", {**brief, "device": bad}), "device")
    _is_422(post(client, "/finetuning/setup-mixed-precision", {"dtype": bad}), "dtype")
    _is_422(
        post(
            client, "/finetuning/optimize-mixed-precision", {"gpu_memory_gb": 8, "model_name": bad}
        ),
        "model_name",
    )
    _is_422(post(client, "/v1/recommend", {"precisions": bad}), "precisions")


@pytest.mark.parametrize(
    "twice", ["fp32,fp32", "bf16,fp32,bfloat16", "bf16-pure:split,bf16-pure:split"]
)
def test_a_precision_named_twice_is_422(client, twice):
    """``POST /v1/recommend`` with a precision listed twice (it measured it twice) is refused."""
    _is_422(post(client, "/v1/recommend", {"precisions": twice}), "precisions", "one precision")


def test_a_stored_surrogate_does_not_break_the_listing(client):
    """A row written by an older server (before these checks) still lists and shows: no 500."""
    store = client.app.state.store
    store.create(
        "old1", "alice", "train", {"model": "mlp", "user_id": SURROGATE}, "/nonexistent/old1"
    )
    r = client.get("/v1/runs", headers=ALICE)
    assert r.status_code == 200 and r.json()["runs"][0]["user_id"] == SURROGATE
    assert client.get("/v1/runs/old1", headers=ALICE).status_code == 200


def _fake_command(run: dict) -> list[str]:
    # the run's model travels on the command line: a NUL there makes Popen raise, like the old argv
    return [sys.executable, "-c", "print('{\"ok\": 1}')", run["spec"]["model"]]


def test_a_run_whose_launch_raises_fails_and_the_queue_moves_on(tmp_path, monkeypatch):
    monkeypatch.setattr(runner_mod, "command_for", _fake_command)
    store = Store(str(tmp_path))
    for i, model in enumerate([NUL, "x" * 3_000_000, "fine"]):  # oldest first: the bad ones lead
        store.create(
            f"r{i}",
            "alice" if i < 2 else "bob",
            "recommend",
            {"model": model},
            str(tmp_path / f"r{i}"),
        )
        time.sleep(0.01)
    for _ in range(2):  # the second Runner is a restarted server on the same store
        runner = Runner(store, max_concurrent=1, poll_s=0.05)
        runner.recover()
        deadline = time.monotonic() + 30
        while store.get("r2")["status"] != "succeeded":
            assert time.monotonic() < deadline, [store.get(f"r{i}") for i in range(3)]
            runner.tick()
            time.sleep(0.05)
    for i in range(2):
        bad = store.get(f"r{i}")
        assert bad["status"] == "failed" and bad["error"].startswith("could not start"), bad[
            "error"
        ][:200]


def test_a_launch_error_with_a_surrogate_is_stored(tmp_path, monkeypatch):
    def boom(run: dict) -> list[str]:
        raise UnicodeEncodeError("utf-8", SURROGATE, 1, 2, "surrogates not allowed")

    monkeypatch.setattr(runner_mod, "command_for", boom)
    store = Store(str(tmp_path))
    store.create("r0", "alice", "recommend", {"model": "mlp"}, str(tmp_path / "r0"))
    Runner(store).tick()
    assert store.get("r0")["status"] == "failed"


# --- 2. the --max_params bypass: overrides stay structured, separators refused, the built config counted

SMUGGLE = {"n_layer": 1, "n_embd": 32, "n_head": 2, "summary_type": "cls_index,vocab_size=2000000"}


@pytest.mark.parametrize(
    "path,body",
    [
        (
            "/finetuning/optimize-mixed-precision",
            {"model_name": "gpt2", "gpu_memory_gb": 8, "model_overrides": SMUGGLE},
        ),
        (
            "/finetuning/mixed-precision",
            {"model_name": "gpt2", "dataset_config": {"texts": TEXTS}, "model_overrides": SMUGGLE},
        ),
        ("/v1/runs", {"model": "gpt2", "model_overrides": SMUGGLE}),
        ("/finetuning/setup-mixed-precision", {"model_overrides": SMUGGLE}),
    ],
)
def test_a_separator_inside_an_override_value_is_422(client, path, body):
    _is_422(post(client, path, body), "summary_type", "vocab_size=2000000")


def test_the_planner_builds_the_overrides_it_was_given():
    """No joined ``k=v`` string between the request and the model: a comma stays inside its value."""
    pytest.importorskip("transformers")
    from ampkit.service import planner

    factory, _ = planner._text_model("gpt2", planner._overrides(SMUGGLE), "small")
    config = factory.args[1]
    assert config == SMUGGLE and "vocab_size" not in config


def test_the_size_check_counts_the_config_the_run_builds(tmp_path):
    """The check sees the overrides as ``ampkit train`` reads them back from run.toml."""
    pytest.importorskip("transformers")
    from ampkit.models.hf_configs import parse_overrides
    from ampkit.service.runfile import run_tables
    from ampkit.service.schemas import RunSpec

    spec = RunSpec(**GPT2).model_dump()
    assert (
        parse_overrides(run_tables(spec, str(tmp_path))["train"]["model_config"])
        == spec["model_overrides"]
    )
    app = create_app(
        ServiceConfig(data_dir=str(tmp_path / "svc"), max_params=100_000), tokens=TOKENS
    )
    r = post(
        TestClient(app),
        "/v1/runs",
        {**GPT2, "model_overrides": {**GPT2["model_overrides"], "n_layer": 4}},
    )
    assert r.status_code == 422 and "over this server's limit" in r.text, r.text


# --- 3. numbers, override names and config classes: 422 with the value, why and the choices --------


def raw(c: TestClient, path: str, text: str, headers: dict = ALICE):
    return c.post(path, content=text, headers={**headers, "content-type": "application/json"})


@pytest.mark.parametrize(
    "text,words",
    [
        ('{"lr": NaN}', ["lr", "finite"]),
        ('{"lr": Infinity}', ["lr", "finite"]),
        ('{"init_scale": 1e400}', ["init_scale", "finite"]),
        ('{"max_seconds": Infinity}', ["max_seconds", "finite"]),
        ('{"seed": 18446744073709551616}', ["seed", "9223372036854775807"]),
        ('{"steps": true}', ["steps", "integer"]),
        ('{"steps": "5"}', ["steps", "integer"]),
        ('{"batch_size": 1e300}', ["batch_size"]),
        ('{"save_model": 1}', ["save_model", "bool"]),
        ('{"amp": {"growth_factor": NaN}}', ["amp", "finite"]),
    ],
)
def test_bad_numbers_are_422(client, text, words):
    _is_422(raw(client, "/v1/runs", text), *words)


@pytest.mark.parametrize(
    "overrides,words",
    [
        ({"n_layer": "--resume"}, ["n_layer", "--resume", "integer", "12"]),
        ({"n_layer": 1e300}, ["n_layer", "1e+300", "integer"]),
        ({"n_layer": True}, ["n_layer", "integer"]),
        ({"layer_norm_epsilon": 1e300}, ["layer_norm_epsilon", "1e+300"]),
        ({"__class__": 1}, ["__class__", "choose from", "n_layer"]),
        ({"_attn_implementation": "eager"}, ["_attn_implementation", "choose from"]),
        ({"dtype": "float16"}, ["dtype", "choose from"]),
        ({"activation_function": "true"}, ["activation_function", "word"]),
        ({"to_dict": 1}, ["to_dict", "choose from"]),
    ],
)
def test_bad_overrides_are_422_with_the_choices(client, overrides, words):
    pytest.importorskip("transformers")
    body = {**GPT2, "model_overrides": {**GPT2["model_overrides"], **overrides}}
    _is_422(post(client, "/v1/runs", body), *words)
    _is_422(
        post(
            client,
            "/finetuning/optimize-mixed-precision",
            {"gpu_memory_gb": 8, "model_name": "gpt2", "model_overrides": body["model_overrides"]},
        ),
        *words,
    )


@pytest.mark.parametrize(
    "model",
    [
        "transformers.AutoConfig",
        "transformers.GPTQConfig",
        "transformers.PretrainedConfig",
        "torch.nn.Config",
        "os.path.Config",
    ],
)
def test_config_classes_that_are_not_model_configs_are_422(client, model):
    pytest.importorskip("transformers")
    choices = "GPT2Config" if model.startswith("transformers.") else "transformers.<Name>Config"
    _is_422(post(client, "/v1/runs", {"model": model}), model.rsplit(".", 1)[1], choices)
    _is_422(
        post(
            client,
            "/finetuning/optimize-mixed-precision",
            {"gpu_memory_gb": 8, "model_name": model},
        ),
        choices,
    )


def test_a_good_override_still_passes(client):
    pytest.importorskip("transformers")
    body = {
        **GPT2,
        "model_overrides": {
            **GPT2["model_overrides"],
            "activation_function": "gelu",
            "layer_norm_epsilon": 1e-6,
            "tie_word_embeddings": False,
            "hidden_size": 32,
        },
    }
    r = post(client, "/v1/runs", body)
    assert r.status_code == 201, r.text


BRIEF = {"model_name": "gpt2", "dataset_config": {"texts": TEXTS}}


@pytest.mark.parametrize(
    "path,text",
    [
        (
            "/finetuning/mixed-precision",
            json.dumps({**BRIEF, "mixed_precision_config": {"init_scale": float("inf")}}),
        ),
        ("/finetuning/mixed-precision", json.dumps({**BRIEF, "training_config": {"epochs": True}})),
        (
            "/finetuning/mixed-precision",
            json.dumps({**BRIEF, "training_config": {"learning_rate": float("nan")}}),
        ),
        ("/finetuning/optimized", json.dumps({**BRIEF, "target_effective_batch_size": 1e300})),
        ("/finetuning/optimized", json.dumps({**BRIEF, "max_seconds": float("inf")})),
        ("/finetuning/optimize-mixed-precision", '{"gpu_memory_gb": NaN}'),
        ("/finetuning/optimize-mixed-precision", '{"gpu_memory_gb": 8, "batch_size": true}'),
        ("/finetuning/setup-mixed-precision", '{"init_scale": 1e400}'),
        ("/finetuning/setup-mixed-precision", '{"enabled": "yes"}'),
        ("/v1/recommend", '{"max_seconds": Infinity}'),
        ("/v1/recommend", '{"device": "tpu:9999999999999999999999"}'),
        ("/v1/runs", '{"device": "cuda:99999999999999999999999"}'),
    ],
)
def test_bad_numbers_on_every_route_are_422(client, path, text):
    r = raw(client, path, text)
    assert r.status_code == 422, (r.status_code, r.text[:500])


# --- 4. what used to be accepted and then fail at start is a 422 at submit --------------------------


def test_cuda_on_a_server_without_cuda_is_422(client, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    for device in ("cuda", "cuda:1"):
        _is_422(post(client, "/v1/runs", {"device": device}), device, "no CUDA", "cpu")
        _is_422(post(client, "/finetuning/mixed-precision", {**BRIEF, "device": device}), device)
        _is_422(post(client, "/v1/recommend", {"device": device}), device)
    _is_422(post(client, "/v1/runs", {"device": "meta"}), "meta", "choose cpu")


@pytest.mark.parametrize(
    "extra,words",
    [
        ({"precision": "fp8"}, ["fp8", "cannot run here", "fp8_emulate"]),
        ({"precision": "fp32", "amp": {"state_dtype": "bf16"}}, ["memory-ladder rung", "fp32"]),
        ({"precision": "bf16", "amp": {"masters": "split"}}, ["memory-ladder rung", "bf16-pure"]),
    ],
)
def test_a_precision_the_run_would_refuse_at_start_is_422(client, extra, words):
    """fp8 on a CPU (no emulation) and a ladder rung with a precision that has no ladder were 201,
    queued, then failed at start: ``ampkit train`` refuses both before its first step."""
    run = {"model": "mlp", "size": "tiny", "device": "cpu", **extra}
    _is_422(post(client, "/v1/runs", run), *words)
    body = {"precision": "bf16-pure", "amp": {"masters": "split"}, "device": "cpu"}
    assert post(client, "/v1/runs", {"model": "mlp", "size": "tiny", **body}).status_code == 201
    brief = {**BRIEF, "device": "cpu", "mixed_precision_config": {"dtype": "fp8"}}
    _is_422(post(client, "/finetuning/mixed-precision", brief), "fp8", "cannot run here")


def test_texts_for_a_model_that_is_not_a_text_model_are_422(client):
    for model in ("mlp", "cnn"):
        _is_422(post(client, "/v1/runs", {"model": model, "texts": TEXTS}), "texts", model)
    assert post(client, "/v1/runs", {"model": "gpt", "texts": TEXTS}).status_code == 201


@pytest.mark.parametrize("model,extra", [("mlp", {}), ("gpt", {}), ("gpt2", GPT2)])
def test_keep_fp32_that_matches_no_module_is_422(client, model, extra):
    if model == "gpt2":
        pytest.importorskip("transformers")
    body = {"model": model, **extra}
    _is_422(
        post(client, "/v1/runs", {**body, "amp": {"keep_fp32": ["no_such_module*"]}}),
        "keep_fp32",
        "no_such_module*",
        "matches no module",
    )
    good = {"mlp": ["*"], "gpt": ["torch.nn.LayerNorm"], "gpt2": ["*ln_f"]}[model]
    r = post(client, "/v1/runs", {**body, "amp": {"keep_fp32": good}})
    assert r.status_code == 201, r.text


# --- 5. listings without texts, the queue cap per owner, a default max_seconds ---------------------


@pytest.mark.slow
def test_listings_do_not_carry_the_training_texts(client):
    big = ["some training text " * 500] * 20
    r = post(client, "/v1/runs", {"model": "gpt", "texts": big})
    assert r.status_code == 201 and "some training text" not in r.text
    rid = r.json()["id"]
    listing = client.get("/v1/runs", headers=ALICE)
    assert (
        listing.status_code == 200
        and "some training text" not in listing.text
        and len(listing.content) < 5_000
    )
    one = client.get(f"/v1/runs/{rid}", headers=ALICE).json()
    assert "texts" not in one["spec"] and one["texts_count"] == 20
    assert one["texts_bytes"] == sum(len(t.encode()) for t in big)
    assert "some training text" not in client.get(f"/finetuning/runs/{rid}", headers=ALICE).text


def test_the_queue_cap_is_per_owner(tmp_path):
    app = create_app(ServiceConfig(data_dir=str(tmp_path / "svc"), queue_cap=2), tokens=TOKENS)
    c = TestClient(app)
    assert [post(c, "/v1/runs", {"steps": 1}).status_code for _ in range(3)] == [201, 201, 429]
    full = post(c, "/v1/runs", {"steps": 1})
    assert full.status_code == 429 and full.headers["retry-after"] and "per owner" in full.text
    assert (
        post(c, "/v1/runs", {"steps": 1}, headers=BOB).status_code == 201
    )  # bob is not blocked by alice


def test_a_run_without_max_seconds_gets_the_servers_default(tmp_path):
    c = TestClient(
        create_app(ServiceConfig(data_dir=str(tmp_path / "svc"), max_seconds=600), tokens=TOKENS)
    )
    assert post(c, "/v1/runs", {"steps": 1}).json()["spec"]["max_seconds"] == 600
    assert post(c, "/v1/runs", {"steps": 1, "max_seconds": 5}).json()["spec"]["max_seconds"] == 5
    assert post(c, "/v1/recommend", {}).json()["spec"]["max_seconds"] == 600
    assert ServiceConfig().max_seconds == 86_400


# --- on a real server: the bad-input sweep gets no 5xx, and another owner's run still succeeds ------


def _sweep() -> list[tuple[str, str]]:
    """(path, raw JSON body): at least 30 hostile or malformed bodies over every submitting route."""
    bodies = []
    for bad in (NUL, SURROGATE, "x" * 200_000):
        bodies += [
            ("/v1/runs", json.dumps({**GPT2, "model_overrides": {"summary_type": bad}})),
            ("/v1/runs", json.dumps({"model": "mlp", "user_id": bad})),
            ("/v1/runs", json.dumps({"model": "mlp", "amp": {"keep_fp32": [bad]}})),
            ("/finetuning/mixed-precision", json.dumps({**BRIEF, "user_id": bad})),
            (
                "/finetuning/optimize-mixed-precision",
                json.dumps({"gpu_memory_gb": 8, "model_name": bad}),
            ),
        ]
    for text in (
        '{"lr": NaN}',
        '{"lr": Infinity}',
        '{"init_scale": 1e400}',
        '{"seed": 18446744073709551616}',
        '{"steps": true}',
        '{"max_seconds": Infinity}',
        '{"device": "cuda:99"}',
        '{"model": "cnn", "texts": ["ab"]}',
        '{"amp": {"keep_fp32": ["nothing_here"]}}',
        '{"model": "transformers.AutoConfig"}',
        '{"model": "transformers.GPTQConfig"}',
        '{"model": "gpt2", "model_overrides": {"__class__": 1}}',
        '{"model": "gpt2", "model_overrides": {"_attn_implementation": "x"}}',
        '{"model": "gpt2", "model_overrides": {"n_layer": "--resume"}}',
        '{"model": "gpt2", "model_overrides": {"n_layer": 1e300}}',
        "[]",
        '"x"',
        '{"amp": []}',
    ):
        bodies.append(("/v1/runs", text))
    bodies.append(
        (
            "/finetuning/optimize-mixed-precision",
            json.dumps({"gpu_memory_gb": 8, "model_overrides": SMUGGLE}),
        )
    )
    return bodies


def test_the_bad_input_sweep_gets_no_5xx_in_process(client):
    pytest.importorskip("transformers")
    codes = [raw(client, path, text).status_code for path, text in _sweep()]
    assert len(codes) >= 30 and all(400 <= c < 500 for c in codes), codes
    assert client.get("/v1/runs", headers=ALICE).status_code == 200


@pytest.mark.slow
def test_wedge_bodies_then_another_owners_run_succeeds(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("uvicorn")
    from .test_service import Server

    s = Server(str(tmp_path / "svc"))
    try:
        c = s.client
        codes = [
            c.post(
                path, content=text, headers={**ALICE, "content-type": "application/json"}
            ).status_code
            for path, text in _sweep()
        ]
        assert len(codes) >= 30 and all(400 <= code < 500 for code in codes), codes
        assert c.get("/v1/runs", headers=ALICE).json()["runs"] == []  # nothing bad was queued
        r = c.post("/v1/runs", json={"model": "mlp", "steps": 2, "precision": "fp32"}, headers=BOB)
        assert r.status_code == 201, r.text
        deadline = time.monotonic() + 120
        while (run := c.get(f"/v1/runs/{r.json()['id']}", headers=BOB).json())[
            "status"
        ] != "succeeded":
            assert run["status"] in ("queued", "running") and time.monotonic() < deadline, run
            time.sleep(0.2)
    finally:
        s.stop()


@pytest.mark.parametrize("status", ["runing", "RUNNING", ""])
def test_a_status_filter_that_is_no_status_is_422_with_the_choices(client, status):
    """``GET /v1/runs?status=runing`` answered ``{"runs": []}``, as if nothing ran (the web UI's
    listing refused it); each valid status still filters."""
    r = client.get("/v1/runs", params={"status": status}, headers=ALICE)
    _is_422(r, "status", repr(status), "queued, running, succeeded, failed, cancelled")
    assert post(client, "/v1/runs", {"model": "mlp", "size": "tiny"}).status_code == 201
    got = client.get("/v1/runs", params={"status": "queued"}, headers=ALICE)
    assert got.status_code == 200 and len(got.json()["runs"]) == 1
    assert client.get("/v1/runs", params={"status": "failed"}, headers=ALICE).json()["runs"] == []


@pytest.mark.parametrize(
    "damage",
    [b"\xff\xfe not utf-8", b"{torn by a full disk", b"[1, 2]", b"\x00\x00\x00\x00"],
    ids=["utf8", "torn", "not-an-object", "nul"],
)
def test_a_damaged_line_in_a_runs_log_is_left_out_not_a_500(client, tmp_path, damage):
    """One damaged line in a run's log.jsonl (a write torn by a full disk, a bad block) made
    ``GET /v1/runs/{id}`` and its ``/metrics`` answer 500 for as long as the run existed, and a
    stray ``log-x`` directory did too. The whole records are served; the damaged line is left
    out."""
    import os

    run = post(client, "/v1/runs", {"model": "mlp", "size": "tiny", "device": "cpu"}).json()
    logs = os.path.join(str(tmp_path / "svc"), "runs", run["id"], "log-0")
    os.makedirs(logs)
    step = [json.dumps({"type": "step", "step": i, "loss": 1.0}).encode() for i in (1, 2)]
    event = json.dumps({"type": "event", "kind": "fallback", "step": 2}).encode()
    with open(os.path.join(logs, "log.jsonl"), "wb") as f:
        f.write(b"\n".join([step[0], damage, step[1], event]) + b"\n")
    os.makedirs(os.path.join(os.path.dirname(logs), "log-x"))
    got = client.get(f"/v1/runs/{run['id']}/metrics", headers=ALICE)
    assert got.status_code == 200, got.text[:300]
    assert [r.get("step") for r in got.json()["records"]] == [1, 2, 2]
    view = client.get(f"/v1/runs/{run['id']}", headers=ALICE)
    assert view.status_code == 200 and [e["kind"] for e in view.json()["events"]] == ["fallback"]


def test_steps_and_epochs_together_are_422(client):
    """``{"steps": 3, "epochs": 2}`` trained 1250 steps (epochs win, as ``ampkit train`` let them);
    each alone is taken."""
    _is_422(post(client, "/v1/runs", {"model": "mlp", "steps": 3, "epochs": 2}), "steps", "epochs")
    assert post(client, "/v1/runs", {"model": "mlp", "epochs": 2}).status_code == 201
    assert post(client, "/v1/runs", {"model": "mlp", "steps": 3}).status_code == 201


def _finished(store, rid: str, kind: str, spec: dict, summary: dict, status: str = "succeeded"):
    store.create(rid, "alice", kind, spec, f"/nonexistent/{rid}")
    store.update(rid, status=status, summary=summary)


TRAINED = {
    "precision": "bf16",
    "final_loss": 2.0,
    "ms_per_step": 1.0,
    "samples_per_s": 10.0,
    "peak_mem_bytes": 100,
    "skipped_steps": 0,
}


def test_compare_refuses_what_it_cannot_compare_and_names_what_differs(client):
    """``GET /v1/compare`` with a ``recommend`` run answered 500 (its
    summary has no final loss); the same id twice compared a run with itself; runs of different
    models, batch sizes or data compared their losses and speeds without a word."""
    store = client.app.state.store
    mlp = {"model": "mlp", "size": "tiny", "batch_size": 16, "steps": 30, "precision": "bf16"}
    _finished(store, "a", "train", {**mlp, "precision": "fp32"}, {**TRAINED, "precision": "fp32"})
    _finished(store, "b", "train", mlp, TRAINED)
    _finished(store, "c", "train", {**mlp, "model": "gpt", "batch_size": 8}, TRAINED)
    _finished(store, "d", "train", mlp, {**TRAINED, "failure": "diverged"}, status="failed")
    _finished(store, "rec", "recommend", {"model": "mlp"}, {"recommendation": {}, "bench": []})
    r = client.get("/v1/compare?ids=a,rec", headers=ALICE)
    assert r.status_code == 422 and "rec" in r.text and "recommend" in r.text, r.text
    r = client.get("/v1/compare?ids=a,b,a", headers=ALICE)
    assert r.status_code == 422 and "'a'" in r.text and "twice" in r.text, r.text
    r = client.get("/v1/compare?ids=a,d", headers=ALICE)
    assert r.status_code == 409 and "d" in r.text and "failed" in r.text, r.text
    rows = client.get("/v1/compare?ids=a,b,c", headers=ALICE).json()["runs"]
    assert [row["differs"] for row in rows] == [[], [], ["batch_size", "model"]]


def test_a_query_parameter_given_twice_is_422(client):
    """``GET /v1/runs?status=succeeded&status=failed`` answered the failed runs alone (a scalar
    query parameter keeps its last value): a script that asked for both saw no succeeded run."""
    store = client.app.state.store
    _finished(store, "a", "train", {"model": "mlp"}, TRAINED)
    r = client.get("/v1/runs?status=succeeded&status=failed", headers=ALICE)
    assert r.status_code == 422 and "'status'" in r.text and "2 times" in r.text, r.text
    r = client.get("/finetuning/mixed-precision-stats?run_id=a&run_id=b", headers=ALICE)
    assert r.status_code == 422 and "'run_id'" in r.text, r.text
    got = client.get("/v1/runs?status=succeeded", headers=ALICE).json()["runs"]
    assert [x["id"] for x in got] == ["a"]


def test_stats_of_a_recommend_run_is_422(client):
    """``GET /finetuning/mixed-precision-stats?run_id=REC`` answered a recommendation as a
    training run (``enabled: false``, ``precision: null``, zero counts) after it measured bf16."""
    _finished(client.app.state.store, "rec", "recommend", {"model": "mlp"}, {"bench": []})
    r = client.get("/finetuning/mixed-precision-stats?run_id=rec", headers=ALICE)
    assert r.status_code == 422 and "recommend run" in r.text, r.text


@pytest.mark.parametrize(
    "path, body, hint",
    [
        ("/v1/runs", {"stepz": 3}, "did you mean 'steps'?"),
        ("/v1/runs", {"size": "tinny"}, "did you mean 'tiny'?"),
        ("/v1/runs", {"model": "gtp"}, "did you mean 'gpt'?"),
        ("/v1/runs", {"model": "lama"}, "did you mean 'llama'?"),
        ("/v1/recommend", {"sise": "tiny"}, "did you mean 'size'?"),
        ("/v1/runs", {"amp": {"enabled": False}}, "enabled=False"),
        ("/v1/runs", {"amp": {"mixed_precision": False}}, "mixed_precision=False"),
        ("/v1/runs", {**GPT2, "model_overrides": {"n_layr": 2}}, "did you mean 'n_layer'?"),
        ("/v1/runs", {"device": "cpuu"}, "did you mean 'cpu'?"),
        ("/v1/runs", {"precision": "bf16-pure", "amp": {"masters": "splt"}}, "'split'?"),
    ],
)
def test_a_mistyped_field_or_value_gets_the_closest_name(client, path, body, hint):
    """A typo in a request got "Extra inputs are not permitted", the choices without the closest
    one, or (amp's switches) an error naming ``precision``, a key the request did not hold."""
    _is_422(post(client, path, body), hint)


@pytest.mark.parametrize(
    "url, words",
    [
        ("/v1/runs?staus=running", ["'staus'", "did you mean 'status'?"]),
        ("/v1/runs?status=runing", ["did you mean 'running'?"]),
        ("/v1/runs/abc/metrics?aftr=3", ["'aftr'", "did you mean 'after'?"]),
        ("/v1/runs/abc?verbose=1", ["'verbose'", "takes none"]),
    ],
)
def test_a_mistyped_query_parameter_is_refused_with_the_closest(client, url, words):
    """``/v1/runs?staus=running`` answered every run, unfiltered, as if the filter had been
    applied; an unknown query parameter of the API is a 422 naming the closest one."""
    _is_422(client.get(url, headers=ALICE), *words)
    assert client.get("/v1/runs?status=running&limit=5", headers=ALICE).status_code == 200


def test_the_briefs_bodies_name_the_fields_they_ignored(client):
    """The brief's routes ignore fields they do not have (as the brief asks), so
    ``training_config: {"lerning_rate": ...}`` trained at the default rate without a word; the
    answer now lists each ignored field with the closest one."""
    r = post(
        client,
        "/finetuning/mixed-precision",
        {
            "model_name": "gpt2",
            "dataset_config": {"texts": TEXTS},
            "training_config": {"lerning_rate": 1e-4, "epochs": 1},
            "colour": "blue",
        },
    )
    assert r.status_code == 201, r.text
    ignored = r.json()["ignored_fields"]
    assert "training_config.lerning_rate (did you mean 'learning_rate'?)" in ignored, ignored
    assert "colour" in ignored, ignored
    ok = post(client, "/finetuning/setup-mixed-precision", {"model_name": "gpt2"})
    assert ok.status_code == 200 and ok.json()["ignored_fields"] == []
