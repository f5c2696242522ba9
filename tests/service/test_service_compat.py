"""The fine-tuning brief's routes (../shared/SERVICE-API.md) on a real uvicorn server: the brief's
own bodies are accepted (unknown fields ignored), mapped onto real ``ampkit train`` runs of a GPT-2
built from ``GPT2Config`` on the given texts, and answered with the fields the brief names."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # a real server and real training processes

from .test_service import ALICE, BOB, Server  # noqa: E402

# The brief's bodies, verbatim.
SETUP = {
    "model_name": "gpt2",
    "enabled": True,
    "dtype": "float16",
    "init_scale": 65536,
    "memory_efficient": True,
}
TRAIN = {
    "model_name": "gpt2",
    "dataset_config": {"texts": ["sample text 1", "sample text 2"], "max_length": 512},
    "training_config": {"epochs": 3, "learning_rate": 5e-5},
    "user_id": 123,
    "mixed_precision_config": {"enabled": True, "dtype": "float16", "init_scale": 65536},
}
OPTIMIZED = {k: v for k, v in TRAIN.items() if k != "mixed_precision_config"} | {
    "use_mixed_precision": True,
    "use_gradient_accumulation": True,
    "target_effective_batch_size": 64,
}
OPTIMIZE = {"model_name": "gpt2", "gpu_memory_gb": 8.0, "batch_size": 16}
# ampkit's one extension, so that CI trains a small GPT-2 (same code path, fewer layers).
SMALL = {"model_overrides": {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_positions": 128}}
TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "import os\nprint(os.getcwd())\n",
    "for i in range(3):\n    pass\n",
    "class A:\n    x = 1\n",
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(str(tmp_path_factory.mktemp("compat") / "svc"), max_concurrent=2)
    yield s
    for run in s.client.get("/v1/runs", headers=ALICE).json()["runs"]:
        if run["status"] in ("queued", "running"):
            s.client.delete(f"/v1/runs/{run['id']}", headers=ALICE)
    s.stop()


def test_setup_then_stats_without_a_run(server):
    c = server.client
    assert c.post("/finetuning/setup-mixed-precision", json=SETUP).status_code == 401
    r = c.post("/finetuning/setup-mixed-precision", json={**SETUP, "unknown_field": 1}, headers=BOB)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["precision"] == "fp16" and out["enabled"] is True and out["dtype"] == "float16"
    assert out["scaler"]["enabled"] is True and out["scaler"]["init_scale"] == 65536
    assert out["activation_checkpointing"] is True
    bf = c.post(
        "/finetuning/setup-mixed-precision", json={**SETUP, "dtype": "bfloat16"}, headers=BOB
    ).json()
    assert bf["precision"] == "bf16" and bf["scaler"]["enabled"] is False
    off = c.post(
        "/finetuning/setup-mixed-precision", json={**SETUP, "enabled": False}, headers=BOB
    ).json()
    assert off["precision"] == "fp32" and off["enabled"] is False
    bad = c.post(
        "/finetuning/setup-mixed-precision", json={**SETUP, "dtype": "float12"}, headers=BOB
    )
    assert bad.status_code == 422 and "float12" in bad.text and "bf16" in bad.text
    c.post("/finetuning/setup-mixed-precision", json=SETUP, headers=BOB)
    stats = c.get("/finetuning/mixed-precision-stats", headers=BOB).json()
    assert stats["run_id"] is None and stats["enabled"] is True and stats["scaler_scale"] == 65536
    assert (
        stats["overflow_count"] == 0
        and stats["underflow_count"] == 0
        and "memory_savings_gb" in stats
    )


def test_brief_body_is_accepted_as_is(server):
    """The exact body (a 124M GPT-2): accepted, answered, then cancelled (CI does not train it)."""
    c = server.client
    r = c.post("/finetuning/mixed-precision", json=TRAIN, headers=ALICE)
    assert r.status_code == 201, r.text
    out = r.json()
    assert (
        out["run_id"]
        and out["mixed_precision"]["precision"] == "fp16"
        and out["scaler_scale"] == 65536
    )
    assert out["user_id"] == 123 and out["spec"]["epochs"] == 3 and out["spec"]["lr"] == 5e-5
    assert out["result"] == f"/finetuning/runs/{out['run_id']}"
    assert c.delete(f"/v1/runs/{out['run_id']}", headers=ALICE).status_code == 200
    # (a 124M GPT-2's first estimate takes about a minute on a loaded 2-core machine)
    done = c.get(out["result"], headers=ALICE, timeout=300).json()
    assert done["status"] == "cancelled" and done["model_path"] is None
    # Predicted fp32 peak minus fp16's: >= 0; about 0 here, where 13-token texts make the optimizer
    # step (the same in both) the peak, not the activations.
    assert done["memory_savings_gb"] is not None and done["memory_savings_gb"] >= 0


def test_mixed_precision_run_trains_and_reports(server):
    c = server.client
    body = (
        TRAIN
        | SMALL
        | {
            "dataset_config": {"texts": TEXTS, "max_length": 64},
            "training_config": {"epochs": 3, "learning_rate": 1e-3, "batch_size": 2},
        }
    )
    r = c.post("/finetuning/mixed-precision", json=body, headers=ALICE)
    assert r.status_code == 201, r.text
    rid = r.json()["run_id"]
    run = server.wait(rid, ("succeeded", "failed"), timeout=240)
    assert run["status"] == "succeeded", run
    assert (
        run["summary"]["precision"] == "fp16" and run["summary"]["optimizer_steps"] == 6
    )  # 3 epochs x 2 batches
    done = c.get(f"/finetuning/runs/{rid}", headers=ALICE).json()
    assert done["scaler_scale"] == run["summary"]["final_scale"] > 0
    assert done["memory_savings_gb"] is not None
    # model_path holds a GPT-2 that transformers loads, with the trained (not the initial) weights
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(done["model_path"])
    assert model.config.n_layer == 2 and model.config.n_embd == 64
    x = torch.tensor([list(b"def add(a, b):")])
    with torch.no_grad():
        loss = model(input_ids=x, labels=x).loss.item()
    fresh = AutoModelForCausalLM.from_config(model.config)
    with torch.no_grad():
        fresh_loss = fresh(input_ids=x, labels=x).loss.item()
    assert loss < fresh_loss - 0.5  # it learnt the texts
    stats = c.get(f"/finetuning/mixed-precision-stats?run_id={rid}", headers=ALICE).json()
    assert stats["enabled"] is True and stats["scaler_scale"] == done["scaler_scale"]
    assert (
        stats["overflow_count"] == run["summary"]["skipped_steps"] and stats["underflow_count"] == 0
    )
    latest = c.get("/finetuning/mixed-precision-stats", headers=ALICE).json()
    assert latest["run_id"] == rid
    assert c.get(f"/finetuning/mixed-precision-stats?run_id={rid}", headers=BOB).status_code == 404


def test_optimized_run_uses_accumulation_for_the_effective_batch(server):
    c = server.client
    body = (
        OPTIMIZED
        | SMALL
        | {
            "dataset_config": {"texts": TEXTS, "max_length": 64},
            "training_config": {"epochs": 2, "learning_rate": 1e-3, "batch_size": 2},
            "target_effective_batch_size": 8,
        }
    )
    r = c.post("/finetuning/optimized", json=body, headers=ALICE)
    assert r.status_code == 201, r.text
    out = r.json()
    assert out["effective_batch_size"] == 8 == out["batch_size"] * out["accumulation_steps"]
    assert out["batch_size"] == 2 and out["accumulation_steps"] == 4
    assert out["gradient_accumulation_enabled"] is True and out["mixed_precision_enabled"] is True
    assert "memory_savings_gb" in out
    run = server.wait(out["run_id"], ("succeeded", "failed"), timeout=240)
    assert run["status"] == "succeeded", run
    assert run["spec"]["accumulation_steps"] == 4
    assert (
        run["summary"]["optimizer_steps"] == 1
    )  # 2 epochs x 2 batches of 2 = 4 micro-batches = 1 step of 8
    plain = c.post(
        "/finetuning/optimized",
        json=body | {"use_mixed_precision": False, "use_gradient_accumulation": False},
        headers=ALICE,
    ).json()
    assert (
        plain["mixed_precision_enabled"] is False
        and plain["gradient_accumulation_enabled"] is False
    )
    assert plain["effective_batch_size"] == 2 and plain["memory_savings_gb"] == 0.0
    c.delete(f"/v1/runs/{plain['run_id']}", headers=ALICE)


def test_optimize_mixed_precision_answers_from_the_planner(server):
    from ampkit.plan.estimate import estimate

    c = server.client
    # a byte-level GPT-2 (vocab 256), so that activations, not the 50k-wide logits, fill the budget
    byte = {
        "n_layer": 2,
        "n_embd": 128,
        "n_head": 2,
        "n_positions": 128,
        "vocab_size": 256,
        "bos_token_id": 0,
        "eos_token_id": 0,
    }
    body = OPTIMIZE | {
        "model_overrides": byte,
        "gpu_memory_gb": 0.05,
        "batch_size": 16,
        "max_length": 128,
    }
    # 5 precisions x a batch search on fake tensors: minutes on a loaded 2-core machine
    r = c.post("/finetuning/optimize-mixed-precision", json=body, headers=ALICE, timeout=600)
    deadline = time.monotonic() + 900
    while r.status_code == 202:  # not ready within the route's wait: a job to poll
        assert time.monotonic() < deadline, r.text
        time.sleep(1)
        r = c.get(r.json()["poll"], headers=ALICE)
    assert r.status_code == 200, r.text
    out = r.json()
    rows = {row["precision"]: row for row in out["recommendations"]}
    assert set(rows) >= {"fp32", "bf16", "fp16"} and isinstance(
        out["should_use_mixed_precision"], bool
    )
    # the largest batch really is the largest by the estimate: B fits, B + 1 does not
    import torch

    from ampkit.models.hf_configs import build_hf

    budget = int(0.05 * 2**30)
    factory = lambda: build_hf("gpt2", byte)  # noqa: E731
    for p in ("fp32", "bf16"):
        b = rows[p]["max_batch_size"]
        assert b >= 1
        x = torch.randint(0, 256, (b, 128))
        assert estimate(factory, (x, x), precision=p).peak_bytes <= budget
        x = torch.randint(0, 256, (b + 1, 128))
        assert estimate(factory, (x, x), precision=p).peak_bytes > budget
    assert rows["bf16"]["max_batch_size"] > rows["fp32"]["max_batch_size"]
    assert out["should_use_mixed_precision"] is True
    assert (
        c.post(
            "/finetuning/optimize-mixed-precision",
            json={**OPTIMIZE, "gpu_memory_gb": -1},
            headers=ALICE,
        ).status_code
        == 422
    )
    assert (
        c.post(
            "/finetuning/optimize-mixed-precision",
            json={**OPTIMIZE, "model_name": "os:system"},
            headers=ALICE,
        ).status_code
        == 422
    )
    huge = {
        "n_layer": 96,
        "n_embd": 12288,
        "n_head": 96,
    }  # ~175B parameters: refused before any estimate
    for route, body in (
        ("/finetuning/optimize-mixed-precision", {**OPTIMIZE, "model_overrides": huge}),
        ("/finetuning/mixed-precision", {**TRAIN, "model_overrides": huge}),
    ):
        r = c.post(route, json=body, headers=ALICE)
        assert r.status_code == 422 and "over this server's limit" in r.text, r.text
    r = c.post("/v1/runs", json={"model": "gpt2", "model_overrides": {"n_layr": 2}}, headers=ALICE)
    assert r.status_code == 422 and "n_layr" in r.text
