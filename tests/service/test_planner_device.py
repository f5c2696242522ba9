"""The REST planner's target device (``device`` on ``POST /finetuning/optimize-mixed-precision``):
checked as ``ampkit plan --device`` checks it, planned by the same code (a GPU from this CPU-only
machine: its allocator's blocks, cuBLAS workspaces and budget), the answer naming the device its
figures are for; rows a device cannot run, or that fit no batch, say why while the others answer."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("fastapi")

from pydantic import ValidationError  # noqa: E402

from ampkit.plan.devices import CONTEXT_BYTES, DEVICES, FRAGMENTATION  # noqa: E402
from ampkit.service.planner import plan_answer  # noqa: E402
from ampkit.service.schemas import OptimizeBody  # noqa: E402

GiB = 1 << 30
# the built-in byte-level GPT, tiny: a whole plan is a few dozen fake-tensor steps (seconds)
TINY = {"model_name": "gpt", "size": "tiny", "batch_size": 4, "max_length": 64}


def _error(**body) -> str:
    with pytest.raises(ValidationError) as e:
        OptimizeBody(**body)
    return str(e.value)


def test_the_device_is_checked_as_the_cli_checks_it():
    said = _error(**TINY, device="h100")
    # the value, why, and every valid choice (the CLI's list: cpu and plan.devices.DEVICES)
    assert "device 'h100' is not a device a plan knows (did you mean 'h100-80gb'?); choose" in said
    assert all(name in said for name in DEVICES) and "--device" not in said
    # case and '_' for '-' are forgiven, as on the command line; the answer names the canonical one
    assert OptimizeBody(**TINY, device="H100_80GB").device == "h100-80gb"
    # a named GPU brings its memory; cpu and cuda need one
    assert OptimizeBody(**TINY, device="h100-80gb").gpu_memory_gb is None
    assert "gpu_memory_gb is needed for a plan of the CPU" in _error(**TINY)
    assert "give gpu_memory_gb" in _error(**TINY, device="cuda")
    assert "gpu_memory_gb 100.00 GiB is more than the NVIDIA H100" in _error(
        **TINY, device="h100-80gb", gpu_memory_gb=100
    )
    assert "no more than the CUDA context" in _error(**TINY, device="cuda", gpu_memory_gb=0.5)
    # omitted: this server's CPU, as before
    assert OptimizeBody(**TINY, gpu_memory_gb=1).device == "cpu"


def test_max_length_takes_what_a_training_body_takes():
    """``max_length`` is tokens per sample, as ``dataset_config.max_length`` (>= 1, ``ampkit train
    --block_size``): a plan for one-token samples is a plan like any other."""
    assert OptimizeBody(**{**TINY, "max_length": 1}, gpu_memory_gb=0.02).max_length == 1
    out = plan_answer(OptimizeBody(**{**TINY, "max_length": 1}, gpu_memory_gb=0.02))
    assert all(r["fits"] and r["max_batch_size"] >= 1 for r in out["recommendations"])
    assert "max_length" in _error(**{**TINY, "max_length": 0}, gpu_memory_gb=0.02)


def test_a_plan_for_a_named_gpu_names_it_and_counts_its_memory():
    cpu = plan_answer(OptimizeBody(**TINY, gpu_memory_gb=80))
    gpu = plan_answer(OptimizeBody(**TINY, device="h100-80gb"))
    h100 = DEVICES["h100-80gb"]
    assert cpu["device"] == "cpu" and cpu["device_name"]  # omitted: still named
    assert gpu["device"] == "h100-80gb" and gpu["device_name"] == h100.label
    assert gpu["gpu_memory_gb"] == round(h100.memory_bytes / GiB, 3)
    budget = int((h100.memory_bytes - CONTEXT_BYTES) * (1 - FRAGMENTATION))
    assert gpu["budget_gb"] == round(budget / GiB, 3) and cpu["budget_gb"] == 80
    assert h100.label in gpu["note"]
    rows = {r["precision"]: r for r in gpu["recommendations"]}
    cpu_rows = {r["precision"]: r for r in cpu["recommendations"]}
    assert set(rows) == set(cpu_rows) and all(r["fits"] for r in rows.values())
    # the GPU's step holds cuBLAS's two workspaces and whole allocator blocks on top of the CPU's
    # (rounded to MB in the answer: at least the workspaces, less one rounding step each side)
    for p, r in rows.items():
        assert r["why_not"] is None
        assert r["predicted_peak_gb"] >= cpu_rows[p]["predicted_peak_gb"] + (
            h100.workspace_bytes() / GiB - 0.001
        ), p


def test_rows_a_device_cannot_run_say_why_while_the_others_answer():
    out = plan_answer(OptimizeBody(**TINY, device="t4-16gb"))  # sm_75: no bf16
    rows = {r["precision"]: r for r in out["recommendations"]}
    for p in ("bf16", "bf16-pure"):
        assert rows[p]["method"] == "refused" and rows[p]["fits"] is False
        assert rows[p]["max_batch_size"] == 0 and rows[p]["predicted_peak_gb"] is None
        assert rows[p]["why_not"] == "the NVIDIA T4 (sm_75) has no bf16"
    for p in ("fp32", "fp16", "fp16-pure"):
        assert rows[p]["fits"] and rows[p]["max_batch_size"] > 1 and rows[p]["why_not"] is None
    assert out["device"] == "t4-16gb" and out["recommended_precision"] in ("fp32", "fp16")


def test_rows_that_fit_no_batch_say_why_while_the_others_answer():
    """A budget between the precisions' peaks at batch 1: the rows over it fit no batch and say
    why, the rows under it answer (the budget is derived from a first plan's own peaks)."""
    # gpt medium (~11M parameters), one 32-token sample: bf16-pure's fp32 masters beside its bf16
    # weights make its peak ~20 MB over fp32's and bf16's (tiny's differ by less than the rounding)
    body = {**TINY, "size": "medium", "batch_size": 1, "max_length": 32}
    first = plan_answer(OptimizeBody(**body, device="h100-80gb"))
    peaks = {r["precision"]: r["predicted_peak_gb"] for r in first["recommendations"]}
    low, high = min(peaks.values()), max(peaks.values())
    assert high - low > 0.002, peaks  # room for a budget between them (peaks are in MB steps)
    budget = (low + high) / 2 * GiB
    memory = (budget / (1 - FRAGMENTATION) + CONTEXT_BYTES) / GiB
    out = plan_answer(OptimizeBody(**body, device="cuda", gpu_memory_gb=memory))
    rows = {r["precision"]: r for r in out["recommendations"]}
    over = [p for p, v in peaks.items() if v > (low + high) / 2 + 0.001]
    under = [p for p, v in peaks.items() if v < (low + high) / 2 - 0.001]
    assert over and under, peaks
    for p in over:
        assert rows[p]["max_batch_size"] == 0 and not rows[p]["fits"]
        assert "budget's" in rows[p]["why_not"], rows[p]
    for p in under:
        assert rows[p]["max_batch_size"] >= 1 and rows[p]["fits"] and rows[p]["why_not"] is None


@pytest.fixture
def client(tmp_path):
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from ampkit.service.app import ServiceConfig, create_app
    from ampkit.service.jobs import jobs

    app = create_app(ServiceConfig(data_dir=str(tmp_path / "svc")), tokens={"tok-a": "alice"})
    with TestClient(app, base_url="http://127.0.0.1") as c:
        yield c
    jobs().close()


ALICE = {"Authorization": "Bearer tok-a"}
ROUTE = "/finetuning/optimize-mixed-precision"


def test_a_bad_device_is_a_422_that_lists_the_choices(client):
    r = client.post(ROUTE, json={**TINY, "device": "h100"}, headers=ALICE)
    assert r.status_code == 422, r.text
    (err,) = r.json()["detail"]
    assert err["loc"] == ["body", "device"] and "'h100'" in err["msg"]
    assert "choose cpu or one of: cuda, h200-141gb, h100-80gb" in err["msg"]
    r = client.post(ROUTE, json={**TINY, "device": "cuda"}, headers=ALICE)
    assert r.status_code == 422 and "give gpu_memory_gb" in r.text


@pytest.mark.slow
def test_the_route_plans_for_a_named_gpu_from_this_cpu(client):
    """Through the route, its worker process and its cache: the plan of an H100 from this machine."""
    r = client.post(ROUTE, json={**TINY, "device": "h100-80gb"}, headers=ALICE)
    deadline = time.monotonic() + 600  # a bound for hangs only (the worker imports torch)
    while r.status_code == 202:
        assert time.monotonic() < deadline, r.text
        time.sleep(0.5)
        r = client.get(r.json()["poll"], headers=ALICE)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["device"] == "h100-80gb" and out["device_name"] == "NVIDIA H100 80GB HBM3"
    assert [row["precision"] for row in out["recommendations"]][:2] == ["fp32", "bf16"]
    assert all(row["fits"] for row in out["recommendations"])
    again = client.post(ROUTE, json={**TINY, "device": "H100_80GB"}, headers=ALICE)
    assert again.status_code == 200 and again.json()["cached"] is True  # the same plan's key
    cpu = client.post(ROUTE, json={**TINY, "gpu_memory_gb": 80}, headers=ALICE)
    assert cpu.status_code in (200, 202) and cpu.json().get("cached") is not True  # not the GPU's
