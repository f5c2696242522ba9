"""The web UI's pieces without a browser: plot downsampling, forms checked by the API's models,
and the pages' guards through the ASGI app (no server, no runs)."""

from __future__ import annotations

import json
import math
import os
import random
from array import array

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("jinja2")

from ampkit.service.schemas import RunSpec  # noqa: E402
from ampkit.service.ui import forms  # noqa: E402
from ampkit.service.ui.series import columns_of, downsample  # noqa: E402


def test_downsample_keeps_every_point_that_fits_and_each_buckets_exact_extremes():
    rng = random.Random(0)
    steps = array("q", range(1, 100_001))
    values = array("d", (rng.gauss(0, 1) if i % 97 else math.nan for i in range(100_000)))
    xs, ys = downsample(steps, values, 2000)
    assert len(xs) <= 2000 and xs == sorted(xs)
    exact = dict(zip(steps, values))
    assert all(exact[x] == y for x, y in zip(xs, ys))  # every point is a logged value at its step
    finite = [v for v in values if v == v]
    assert min(y for y in ys if y is not None) == min(finite) and max(
        y for y in ys if y is not None
    ) == max(finite)
    small_x, small_y = downsample(steps[:50], values[:50], 2000)
    assert small_x == list(range(1, 51)) and small_y[0] is None and small_y[1] == values[1]


def test_columns_grow_with_the_log_and_restart_for_another_log():
    def step(s, loss):
        return json.dumps(
            {
                "type": "step",
                "step": s,
                "loss": loss,
                "scale": 2.0,
                "skipped": loss is None,
                "peak_mem_bytes": 2**20,
            }
        )

    lines = [
        step(1, 3.0),
        step(2, None),
        json.dumps({"type": "event", "kind": "fallback", "step": 2}),
    ]
    cols = columns_of("unit-run", lines)
    assert (
        list(cols.steps) == [1, 2] and cols.skipped == [2] and cols.events[0]["kind"] == "fallback"
    )
    assert list(cols.values["memory"]) == [1.0, 1.0]
    cols = columns_of("unit-run", [*lines, step(3, 1.0)])
    assert list(cols.steps) == [1, 2, 3] and cols.values["loss"][2] == 1.0
    cols = columns_of("unit-run", [step(1, 7.0)])  # a log that is not the one cached
    assert list(cols.steps) == [1] and cols.values["loss"][0] == 7.0


def test_a_form_is_checked_by_the_apis_model_with_its_messages():
    from pydantic import ValidationError

    values = {
        "steps": "0",
        "lr": "fast",
        "size": "tiny",
        "amp": '{"fallback": "fp16,bf16"}',
        "user_id": "42",
        "texts": "one text\n\nanother",
    }
    body = forms.body(RunSpec, values)
    assert body["steps"] == 0 and body["lr"] == "fast" and body["user_id"] == 42
    assert body["texts"] == ["one text", "another"] and body["activation_checkpointing"] is False
    with pytest.raises(ValidationError) as e:
        RunSpec.model_validate(body)
    shown = forms.errors(e.value)
    api = {err["loc"][0]: err["msg"] for err in e.value.errors()}
    assert shown["steps"] == api["steps"] and shown["lr"] == api["lr"]
    kinds = {f.name: f.kind for f in forms.fields(RunSpec)}
    assert kinds["steps"] == "number" and kinds["size"] == "select" and kinds["amp"] == "json"
    assert (
        kinds["save_model"] == "checkbox"
        and kinds["texts"] == "lines"
        and kinds["user_id"] == "auto"
    )


@pytest.fixture
def client(tmp_path):
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from ampkit.service.app import ServiceConfig, create_app

    app = create_app(
        ServiceConfig(data_dir=str(tmp_path / "svc")), tokens={"tok-a": "alice", "tok-b": "bob"}
    )
    # not entered as a context: no lifespan, no runner, so runs stay queued
    c = TestClient(app, base_url="http://127.0.0.1", follow_redirects=False)
    c.app = app
    yield c
    c.close()


def _sign_in(client, token="tok-a"):
    r = client.post("/ui/signin", data={"token": token}, headers={"Origin": "http://127.0.0.1"})
    assert r.status_code == 303 and r.headers["location"] == "/ui/runs"
    client.cookies.set("ampkit_session", r.cookies["ampkit_session"])
    page = client.get("/ui/launch").text
    return page.split('name="csrf" value="', 1)[1].split('"', 1)[0]


def test_pages_need_a_session_and_carry_the_security_headers(client):
    for path in ("/", "/ui/runs", "/ui/launch", "/ui/plan", "/ui/compare", "/ui/runs/abc"):
        r = client.get(path)
        assert r.status_code == 303 and r.headers["location"] == "/ui/signin", path
        assert (
            r.headers["x-frame-options"] == "DENY"
            and "frame-ancestors 'none'" in r.headers["content-security-policy"]
        )
    assert client.get("/ui/runs/abc/data").status_code == 401
    signin = client.get("/ui/signin")
    assert signin.status_code == 200 and "<script" not in signin.text  # no inline script anywhere
    static = client.get("/ui/static/run.js")
    assert static.status_code == 200 and static.headers["x-content-type-options"] == "nosniff"
    assert client.get("/ui/static/..%2Fsession.py").status_code == 404
    assert client.get("/ui/static/uPlot.LICENSE").text.startswith("The MIT License")


def test_a_cross_site_sign_in_and_a_post_without_the_token_are_refused(client):
    r = client.post("/ui/signin", data={"token": "tok-a"}, headers={"Origin": "http://evil.test"})
    assert r.status_code == 403 and "ampkit_session" not in r.cookies
    csrf = _sign_in(client)
    assert client.post("/ui/launch", data={"steps": "2"}).status_code == 403
    assert (
        client.post(
            "/ui/launch", data={"steps": "2", "csrf": csrf}, headers={"Origin": "http://evil.test"}
        ).status_code
        == 403
    )
    assert client.app.state.store.list() == []


def test_launch_rejects_what_the_api_rejects_and_runs_stay_the_owners(client, monkeypatch):
    csrf = _sign_in(client)
    r = client.post(
        "/ui/launch",
        data={"csrf": csrf, "model": "no-such-model", "steps": "2"},
        headers={"Origin": "http://127.0.0.1"},
    )
    assert r.status_code == 422 and "is not available here" in r.text  # submit()'s own message
    r = client.post(
        "/ui/launch",
        data={"csrf": csrf, "steps": "2", "batch_size": "4"},
        headers={"Origin": "http://127.0.0.1"},
    )
    assert r.status_code == 303
    rid = r.headers["location"].rsplit("/", 1)[1]
    run = client.app.state.store.get(rid)
    assert run["owner"] == "alice" and run["spec"]["steps"] == 2 and os.path.exists(run["run_dir"])
    _sign_in(client, "tok-b")
    assert client.get(f"/ui/runs/{rid}").status_code == 404
    assert client.get(f"/ui/runs/{rid}/data").status_code == 404
    assert rid not in client.get("/ui/runs").text


def test_the_ui_mounted_inside_another_app_links_under_its_prefix(tmp_path):
    pytest.importorskip("httpx")
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    from ampkit.service.app import ServiceConfig, create_app

    outer = FastAPI()
    outer.mount(
        "/ampkit",
        create_app(ServiceConfig(data_dir=str(tmp_path / "svc")), tokens={"tok-a": "alice"}),
    )
    c = TestClient(outer, base_url="http://127.0.0.1", follow_redirects=False)
    assert c.get("/ampkit/").headers["location"] == "/ampkit/ui/signin"
    r = c.post("/ampkit/ui/signin", data={"token": "tok-a"}, headers={"Origin": "http://127.0.0.1"})
    assert r.status_code == 303 and r.headers["location"] == "/ampkit/ui/runs"
    assert "Path=/ampkit" in r.headers["set-cookie"]
    page = c.get("/ampkit/ui/runs")
    assert page.status_code == 200 and 'href="/ampkit/ui/launch"' in page.text
    assert (
        'href="/ampkit/ui/static/ui.css"' in page.text
        and c.get("/ampkit/ui/static/ui.css").status_code == 200
    )
    assert 'data-root="/ampkit"' in page.text and 'class="here"' in page.text
    c.close()


def test_without_jinja2_the_ui_says_which_extra_and_the_api_still_answers(client, monkeypatch):
    import sys

    from ampkit.service.ui import pages

    pages.templates.cache_clear()
    monkeypatch.setitem(sys.modules, "jinja2", None)  # import jinja2 -> ImportError
    try:
        r = client.get("/ui/signin")
        assert r.status_code == 501 and "pip install 'ampkit[serve]'" in r.text
        assert client.get("/health").status_code in (200, 503)
    finally:
        pages.templates.cache_clear()


def test_cancel_and_resume_buttons_do_what_the_api_does(client):
    csrf = _sign_in(client)
    origin = {"Origin": "http://127.0.0.1"}
    r = client.post("/ui/launch", data={"csrf": csrf, "steps": "2"}, headers=origin)
    rid = r.headers["location"].rsplit("/", 1)[1]
    page = client.get(f"/ui/runs/{rid}").text
    assert 'id="cancel"' in page and 'id="resume"' not in page  # queued: it can be cancelled
    r = client.post(f"/ui/runs/{rid}/cancel", data={"csrf": csrf}, headers=origin)
    assert r.status_code == 303 and client.app.state.store.get(rid)["status"] == "cancelled"
    page = client.get(f"/ui/runs/{rid}").text
    assert 'id="cancel"' not in page and 'id="resume"' in page
    again = client.post(f"/ui/runs/{rid}/cancel", data={"csrf": csrf}, headers=origin)
    # the API's 409s, shown on the run's page
    assert again.status_code == 409 and "has already ended (cancelled)" in again.text
    r = client.post(f"/ui/runs/{rid}/resume", data={"csrf": csrf}, headers=origin)
    assert r.status_code == 409 and "has no checkpoint to resume from" in r.text
    assert client.app.state.store.get(rid)["status"] == "cancelled"


def test_the_plan_form_offers_the_devices_and_shows_the_apis_messages_beside_them(client):
    """The plan page's device is a select of what the API takes (cpu and plan.devices.DEVICES);
    a bad device, or a plan of the CPU without its memory, is the API's own message beside the
    field it is about (what the JSON route answers for the same body)."""
    import html
    import re

    from ampkit.plan.devices import DEVICES

    csrf = _sign_in(client)
    page = client.get("/ui/plan").text
    select = page.split('<select id="in-device" name="device">', 1)[1].split("</select>", 1)[0]
    assert re.findall(r"<option(?: selected)?>([^<]+)</option>", select) == ["cpu", *DEVICES]
    assert "<option selected>cpu</option>" in select  # the API's default
    origin = {"Origin": "http://127.0.0.1"}
    for body, field in (
        ({"device": "h100"}, "device"),
        ({"device": "cpu"}, "gpu_memory_gb"),
        ({"device": "h100-80gb", "gpu_memory_gb": "100"}, "gpu_memory_gb"),
    ):
        api = client.post(
            "/finetuning/optimize-mixed-precision",
            json={
                "model_name": "gpt",
                **{k: json.loads(v) if k != "device" else v for k, v in body.items()},
            },
            headers={"Authorization": "Bearer tok-a"},
        )
        assert api.status_code == 422, api.text
        (said,) = [e["msg"] for e in api.json()["detail"]]
        r = client.post(
            "/ui/plan", data={"csrf": csrf, "model_name": "gpt", **body}, headers=origin
        )
        assert r.status_code == 422
        beside = r.text.split(f'id="error-{field}">', 1)[1].split("</span>", 1)[0]
        assert html.unescape(beside) == said, (body, beside, said)


def test_the_ui_is_inside_the_apis_rate_limit_and_body_cap(client):
    """The plan form spends the owner's planner budget that the JSON route spends (one bucket: two
    API requests, then the page is refused with the API's 429, its message and Retry-After), and a form body over
    the service's cap is a 413 before the page reads it, as for the API."""
    from ampkit.service.limits import Limits

    client.app.state.limits = Limits(per_minute=0.01, burst=2)
    csrf = _sign_in(client)
    origin = {"Origin": "http://127.0.0.1"}
    for _ in range(2):
        r = client.post(
            "/finetuning/optimize-mixed-precision",
            json={"model_name": "no-such-model", "gpu_memory_gb": 8},
            headers={"Authorization": "Bearer tok-a"},
        )
        assert r.status_code == 422, r.text  # checked after the limit: each one spent a request
    r = client.post(
        "/ui/plan",
        data={"csrf": csrf, "model_name": "gpt", "gpu_memory_gb": "8"},
        headers=origin,
    )
    assert r.status_code == 429 and int(r.headers["retry-after"]) > 0
    api = client.post(
        "/finetuning/optimize-mixed-precision",
        json={"model_name": "gpt", "gpu_memory_gb": 8},
        headers={"Authorization": "Bearer tok-a"},
    )
    assert api.status_code == 429 and api.json()["detail"] in r.text
    cap = client.app.state.service.config.body_cap
    r = client.post("/ui/launch", data={"csrf": csrf, "name": "x" * (cap + 1)}, headers=origin)
    assert r.status_code == 413 and str(cap) in r.json()["detail"]
    assert client.app.state.store.list() == []


def test_compare_page_with_a_recommend_run_says_why(client):
    """The compare page with a ``recommend`` run among the ids was a 500 (the API's KeyError);
    now the API's 422, shown on the page, and the runs' differences beside the table."""
    _sign_in(client)
    store = client.app.state.store
    trained = {"final_loss": 2.0, "ms_per_step": 1.0, "samples_per_s": 10.0, "skipped_steps": 0}
    for rid, model in (("a", "mlp"), ("b", "gpt")):
        store.create(rid, "alice", "train", {"model": model, "size": "tiny"}, f"/nonexistent/{rid}")
        store.update(rid, status="succeeded", summary={**trained, "precision": "bf16"})
    store.create("rec", "alice", "recommend", {"model": "mlp", "size": "tiny"}, "/nonexistent/rec")
    store.update("rec", status="succeeded", summary={"recommendation": {}, "bench": []})
    listing = client.get("/ui/runs").text  # a recommend run has no compare box to tick
    assert 'aria-label="compare a"' in listing and 'aria-label="compare rec"' not in listing
    page = client.get("/ui/compare?ids=a,rec")
    assert page.status_code == 200 and "is a recommend run" in page.text, page.text[-800:]
    page = client.get("/ui/compare?ids=a,b")
    assert page.status_code == 200 and "differs from the baseline in: model" in page.text


def test_launch_form_with_epochs_leaves_steps_at_its_default(client):
    """The form shows each default in its input (steps: 100), so a browser posts it back: a run
    of 2 epochs from the form is ``epochs`` with ``steps`` left at its default, not both given
    (the API refuses both); a steps value typed with the epochs is refused as the API does."""
    csrf = _sign_in(client)
    form = client.get("/ui/launch").text
    assert 'id="in-steps" name="steps" value="100"' in form
    origin = {"Origin": "http://127.0.0.1"}
    r = client.post(
        "/ui/launch", data={"csrf": csrf, "steps": "100", "epochs": "2"}, headers=origin
    )
    assert r.status_code == 303, r.text[-600:]
    (run,) = client.app.state.store.list()
    assert run["spec"]["epochs"] == 2
    r = client.post("/ui/launch", data={"csrf": csrf, "steps": "3", "epochs": "2"}, headers=origin)
    assert r.status_code == 422 and "both say how long to train" in r.text


def test_a_finished_recommend_run_page_shows_its_recommendation_as_a_table(client):
    """A recommend run's page drew five empty training plots and its summary as Python reprs
    (``{'precision': 'fp32', 'step_ms': 0.698...}``); now the recommendation and a row per
    precision measured, with why each other one was not chosen."""
    _sign_in(client)
    store = client.app.state.store
    rec = {
        "precision": "fp32",
        "speedup_vs_fp32": 1.0,
        "loss_gap": 0.0,
        "tolerance": 0.01,
        "why_not": {"bf16": "slower: 1.41 ms/step vs 0.70 ms/step for fp32"},
        "timed": "whole training step, 1 thread, 2 repeats",
    }
    row = {"status": "ok", "reason": "", "skipped_steps": 0, "bytes_per_param": 12.0}
    bench = {
        "results": [
            {
                **row,
                "precision": "fp32",
                "step_ms": 0.7,
                "speedup_vs_fp32": 1.0,
                "final_loss": 2.3,
                "loss_gap": 0.0,
            },
            {
                **row,
                "precision": "bf16",
                "step_ms": 1.41,
                "speedup_vs_fp32": 0.49,
                "final_loss": 2.3,
                "loss_gap": -8e-6,
            },
            {"precision": "fp8", "status": "skipped", "reason": "needs an NVIDIA GPU"},
        ]
    }
    store.create("rec", "alice", "recommend", {"model": "mlp", "size": "tiny"}, "/nonexistent/rec")
    store.update("rec", status="succeeded", summary={"recommendation": rec, "bench": bench})
    page = client.get("/ui/runs/rec").text
    assert 'id="plots"' not in page and "{&#39;precision&#39;" not in page, page[-1500:]
    assert 'id="recommendation"' in page and "<strong>fp32</strong>" in page
    table = page.split('id="bench"', 1)[1].split("</table>", 1)[0]
    assert table.count("<tr") == 4  # the header and one row per precision measured
    assert "slower: 1.41 ms/step vs 0.70 ms/step for fp32" in table
    assert "needs an NVIDIA GPU" in table
