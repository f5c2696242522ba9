"""create_app() inside another FastAPI app, as docs/guides/service.md shows: the routes answer
under the mount and the runner (started by the passed-on lifespan) trains a queued run."""

from __future__ import annotations

import time
from contextlib import asynccontextmanager

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from ampkit.service.app import create_app
from ampkit.service.schemas import ServiceConfig

ALICE = {"Authorization": "Bearer tok-alice"}


@pytest.mark.slow  # the run is a real `ampkit train` process
def test_create_app_mounted_in_another_app_serves_and_runs(tmp_path):
    amp_app = create_app(ServiceConfig(data_dir=str(tmp_path / "svc"), poll_s=0.1), tokens={"tok-alice": "alice"})

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
        r = c.post("/ampkit/v1/runs", json={"model": "mlp", "steps": 2, "precision": "fp32"}, headers=ALICE)
        assert r.status_code == 201, r.text
        rid = r.json()["id"]
        deadline = time.monotonic() + 180
        while (run := c.get(f"/ampkit/v1/runs/{rid}", headers=ALICE).json())["status"] not in ("succeeded", "failed"):
            assert time.monotonic() < deadline, run
            time.sleep(0.2)
        assert run["status"] == "succeeded", run
    assert c.app is parent
