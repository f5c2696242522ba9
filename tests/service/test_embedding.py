"""create_app() inside another FastAPI app, as docs/guides/service.md shows: the routes answer
under the mount and the runner (started by the passed-on lifespan) trains a queued run."""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

import pytest

pytest.importorskip("fastapi")  # the serve extra
pytest.importorskip("httpx")  # fastapi's TestClient

from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from ampkit.service.app import create_app  # noqa: E402
from ampkit.service.schemas import ServiceConfig  # noqa: E402

ALICE = {"Authorization": "Bearer tok-alice"}


@pytest.mark.slow  # the run is a real `ampkit train` process
def test_create_app_mounted_in_another_app_serves_and_runs(tmp_path):
    amp_app = create_app(
        ServiceConfig(data_dir=str(tmp_path / "svc"), poll_s=0.1), tokens={"tok-alice": "alice"}
    )

    @asynccontextmanager
    async def lifespan(app):
        async with amp_app.router.lifespan_context(amp_app):
            yield

    parent = FastAPI(lifespan=lifespan)

    @parent.get("/own")
    def own():
        return {"mine": True}

    parent.mount("/ampkit", amp_app)
    with TestClient(parent) as c:
        assert c.get("/own").json() == {"mine": True}
        assert c.get("/ampkit/health").status_code == 200
        assert c.get("/ampkit/v1/runs").status_code == 401  # the token still guards it
        r = c.post(
            "/ampkit/v1/runs", json={"model": "mlp", "steps": 2, "precision": "fp32"}, headers=ALICE
        )
        assert r.status_code == 201, r.text
        rid = r.json()["id"]
        deadline = time.monotonic() + 180
        while (run := c.get(f"/ampkit/v1/runs/{rid}", headers=ALICE).json())["status"] not in (
            "succeeded",
            "failed",
        ):
            assert time.monotonic() < deadline, run
            time.sleep(0.2)
        assert run["status"] == "succeeded", run
    assert c.app is parent


def test_optimized_honours_epochs_when_the_effective_batch_exceeds_the_data(tmp_path):
    """2 texts, an effective batch of 8: `ampkit train --epochs 5` would count 5 * 1 // 4 = 1 step (4
    passes); the route trains 2 steps (8 passes >= 5) and says so."""
    pytest.importorskip("transformers")
    app = create_app(ServiceConfig(data_dir=str(tmp_path / "svc")), tokens={"tok-alice": "alice"})
    c = TestClient(app)  # no lifespan: the runner does not start, the runs stay queued
    body = {
        "model_name": "gpt2",
        "model_overrides": {"n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 64},
        "dataset_config": {"texts": ["first text", "second text"], "max_length": 32},
        "training_config": {"batch_size": 2},
        "target_effective_batch_size": 8,
        "use_mixed_precision": False,
    }
    got = {}
    for epochs in (1, 5, 16):
        r = c.post(
            "/finetuning/optimized",
            json={**body, "training_config": {"batch_size": 2, "epochs": epochs}},
            headers=ALICE,
        )
        assert r.status_code == 201, r.text
        out = r.json()
        assert out["effective_batch_size"] == 8 and out["epochs"] == epochs
        assert out["spec"]["steps"] == out["optimizer_steps"] and out["spec"]["epochs"] is None
        assert out["data_passes"] == out["optimizer_steps"] * 8 / 2 >= epochs
        got[epochs] = out["optimizer_steps"]
    assert got == {1: 1, 5: 2, 16: 4}
