"""The web UI in a real browser: headless Chromium (Debian's ``chromium``) driven by Playwright,
against a real ``ampkit serve`` on 127.0.0.1 with real short runs (the tiny MLP, a few steps).
One server, one set of runs and one browser for the module; every wait is bounded (hangs only).
Screenshots of each page go to ``$AMPKIT_ARTIFACTS/webui`` (else the test's temporary directory)."""

from __future__ import annotations

import json
import os
import re
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("jinja2")
sync_api = pytest.importorskip("playwright.sync_api")

from .server_process import end, serve  # noqa: E402

CHROMIUM = "/usr/bin/chromium"
if not os.path.exists(CHROMIUM):
    pytest.skip(
        f"no {CHROMIUM} (Debian's chromium package; .ci/run installs it)", allow_module_level=True
    )

pytestmark = pytest.mark.slow
ALICE, BOB = "tok-alice", "tok-bob"
XSS = '<script>window.__xss = 1</script><img src=x onerror="window.__xss = 2">'
WAIT_MS = 120_000  # a bound for hangs only


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory):
    root = os.environ.get("AMPKIT_ARTIFACTS")
    path = os.path.join(root, "webui") if root else str(tmp_path_factory.mktemp("webui-shots"))
    os.makedirs(path, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def svc(tmp_path_factory):
    """``ampkit serve`` with two owners, alice's runs (training while the first tests run: see
    :func:`_trained`) and bob's (cancelled while queued: listed, never started)."""
    data = str(tmp_path_factory.mktemp("webui") / "svc")
    proc, alice = serve(
        data,
        "--max_concurrent",
        "2",
        env={"AMPKIT_TOKENS": f"alice:{ALICE},bob:{BOB}", "OMP_NUM_THREADS": "1"},
    )
    bob = httpx.Client(
        base_url=alice.base_url, timeout=30, headers={"Authorization": f"Bearer {BOB}"}
    )
    # fp16 from a loss scale no gradient survives: two skipped steps, then the fallback to bf16
    fallback = {
        "precision": "fp16",
        "init_scale": 2.0**120,
        "steps": 12,
        "log_every": 1,
        "batch_size": 8,
        "amp": {"fallback": "fp16,bf16", "fallback_patience": 2, "fallback_check_every": 1},
        "user_id": "fallback-demo",
    }
    ids = {
        "fallback": alice.post("/v1/runs", json=fallback).json()["id"],
        "xss": alice.post(
            "/v1/runs",
            json={"steps": 6, "log_every": 1, "batch_size": 8, "precision": "bf16", "user_id": XSS},
        ).json()["id"],
        "bob": bob.post(
            "/v1/runs", json={"steps": 2, "batch_size": 8, "user_id": "bobs-run"}
        ).json()["id"],
    }
    bob.delete(f"/v1/runs/{ids['bob']}")  # queued behind alice's two: cancelled before it starts
    try:
        yield {
            "base": str(alice.base_url).rstrip("/"),
            "data": data,
            "alice": alice,
            "bob": bob,
            "ids": ids,
            "trained": False,
        }
    finally:
        alice.close()
        bob.close()
        end(proc)


def _trained(svc) -> dict:
    """``svc`` once alice's runs have succeeded (waited for once)."""
    for name in ("fallback", "xss") if not svc["trained"] else ():
        deadline = time.monotonic() + 180
        while (run := svc["alice"].get(f"/v1/runs/{svc['ids'][name]}").json())["status"] not in (
            "succeeded",
            "failed",
            "cancelled",
        ):
            assert time.monotonic() < deadline, run
            time.sleep(0.2)
        assert run["status"] == "succeeded", run
    svc["trained"] = True
    return svc


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


def _sign_in(context, base: str, token: str = ALICE):
    page = context.new_page()
    page.goto(base + "/")
    page.fill("#token", token)
    page.click("button[type=submit]")
    page.wait_for_url(re.compile(r".*/ui/runs$"))
    return page


@pytest.fixture(scope="module")
def page(browser, svc):
    """A browser signed in as alice, collecting the page's console errors (CSP violations)."""
    context = browser.new_context(viewport={"width": 1300, "height": 900})
    p = _sign_in(context, svc["base"])
    p.console_errors = []
    p.on("console", lambda m: p.console_errors.append(m.text) if m.type == "error" else None)
    yield p
    context.close()


def _log(svc, rid: str) -> list[dict]:
    with open(os.path.join(svc["data"], "runs", rid, "log-0", "log.jsonl"), encoding="utf-8") as f:
        return [json.loads(x) for x in f if x.strip()]


def _until(page, js: str, timeout_s: float = WAIT_MS / 1000):
    """Poll ``js`` in the page until it is truthy (Playwright's wait_for_function evaluates a
    string, which the UI's CSP refuses: no 'unsafe-eval')."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            got = page.evaluate(js)
        except sync_api.Error:  # the page reloaded itself in between (a run page when its run ends)
            got = None
        if got:
            return got
        if time.monotonic() >= deadline:
            try:
                body = page.inner_text("body")[-1500:]
            except sync_api.Error:
                body = "(page unreadable)"
            raise AssertionError(f"{js} still false after {timeout_s} s; {page.url} shows:\n{body}")
        time.sleep(0.1)


def _shot(page, artifacts: str, name: str) -> None:
    page.screenshot(path=os.path.join(artifacts, f"{name}.png"), full_page=True)


def test_sign_in_sets_a_strict_httponly_cookie_and_sign_out_ends_it(browser, svc, artifacts):
    context = browser.new_context()
    page = context.new_page()
    first = page.goto(svc["base"] + "/")
    assert page.url.endswith("/ui/signin")
    headers = first.headers
    assert "script-src 'self'" in headers["content-security-policy"]
    assert "unsafe-inline" not in headers["content-security-policy"]
    assert "frame-ancestors 'none'" in headers["content-security-policy"]
    assert headers["x-content-type-options"] == "nosniff" and headers["x-frame-options"] == "DENY"
    page.fill("#token", "not-a-token")
    page.click("button[type=submit]")
    assert "not one this server knows" in page.inner_text("#signin-error")
    _shot(page, artifacts, "signin")
    page.fill("#token", ALICE)
    page.click("button[type=submit]")
    page.wait_for_url(re.compile(r".*/ui/runs$"))
    assert page.inner_text("#owner") == "alice"
    (cookie,) = [c for c in context.cookies() if c["name"] == "ampkit_session"]
    # Secure only over TLS: this is plain http
    assert cookie["httpOnly"] and cookie["sameSite"] == "Strict" and not cookie["secure"]
    assert "ampkit_session" not in page.evaluate("document.cookie")  # out of scripts' reach
    page.click("text=Sign out")
    page.wait_for_url(re.compile(r".*/ui/signin$"))
    page.goto(svc["base"] + "/ui/runs")
    assert page.url.endswith("/ui/signin")  # the old session is gone
    old = httpx.get(svc["base"] + "/ui/runs", cookies={"ampkit_session": cookie["value"]})
    assert old.status_code == 303 and old.headers["location"] == "/ui/signin"
    context.close()


def test_runs_page_lists_the_owners_runs_and_not_another_owners(page, svc, artifacts):
    svc = _trained(svc)
    page.goto(svc["base"] + "/ui/runs")
    shown = page.eval_on_selector_all("tr.run", "rows => rows.map(r => r.dataset.id)")
    assert svc["ids"]["fallback"] in shown and svc["ids"]["xss"] in shown
    assert svc["ids"]["bob"] not in shown and "bobs-run" not in page.content()
    row = page.locator(f"tr[data-id='{svc['ids']['fallback']}']")
    assert (
        "succeeded" in row.inner_text()
        and "12/12" in row.inner_text()
        and "bf16" in row.inner_text()
    )
    _shot(page, artifacts, "runs")
    page.select_option("#status", "failed")
    page.click("text=Filter")
    assert page.locator("tr.run").count() == 0 and "status=failed" in page.url
    # another owner's run: not there
    response = page.goto(f"{svc['base']}/ui/runs/{svc['ids']['bob']}")
    assert response.status == 404 and "no run" in page.inner_text("#error")
    data = page.request.get(f"{svc['base']}/ui/runs/{svc['ids']['bob']}/data")
    assert data.status == 404


def test_loss_plot_has_a_point_per_step_record_and_marks_the_fallback(page, svc, artifacts):
    svc = _trained(svc)
    rid = svc["ids"]["fallback"]
    log = _log(svc, rid)
    steps = [r for r in log if r["type"] == "step"]
    (fell,) = [r["step"] for r in log if r.get("kind") == "fallback"]
    skipped = [r["step"] for r in steps if r["skipped"]]
    assert skipped  # the run did skip steps before falling back
    page.goto(f"{svc['base']}/ui/runs/{rid}")
    _until(page, "window.ampkit && window.ampkit.marks.loss")
    assert page.evaluate("ampkit.charts.loss.data[0].length") == len(steps)
    assert page.evaluate("ampkit.charts.loss.data[0]") == [r["step"] for r in steps]
    marks = page.evaluate("ampkit.marks.loss")
    (mark,) = [m for m in marks["drawn"] if m["kind"] == "fallback"]
    assert mark["step"] == fell and marks["left"] <= mark["px"] <= marks["right"]
    assert sorted(m["step"] for m in marks["drawn"] if m["kind"] == "skipped") == skipped
    assert page.locator(f"#events tr[data-kind='fallback'][data-step='{fell}']").count() == 1
    # it has ended: neither button
    assert page.locator("#resume").count() == 0 and page.locator("#cancel").count() == 0
    assert "fallback" in page.inner_text("#settings")  # the run's amp settings
    _shot(page, artifacts, "run")
    assert not [e for e in page.console_errors if "Content Security Policy" in e], (
        page.console_errors
    )


def test_launching_from_the_form_creates_a_run_that_trains(page, svc, artifacts):
    page.goto(svc["base"] + "/ui/launch")
    page.fill("#in-steps", "5")
    page.fill("#in-log_every", "1")
    page.fill("#in-batch_size", "8")
    page.select_option("#in-size", "tiny")
    page.fill("#in-user_id", "from-the-form")
    page.click("#launch button[type=submit]")
    page.wait_for_url(re.compile(r".*/ui/runs/[0-9a-f]{12}$"))
    rid = page.url.rsplit("/", 1)[1]
    assert page.get_attribute("#plots", "data-live") == "true"  # queued when the page was drawn
    run = svc["alice"].get(f"/v1/runs/{rid}").json()
    assert run["spec"]["steps"] == 5 and run["user_id"] == "from-the-form"
    _until(page, "document.getElementById('run-status')?.textContent === 'succeeded'")
    _until(page, "window.ampkit?.charts.loss?.data[0].length === 5")
    assert svc["alice"].get(f"/v1/runs/{rid}").json()["summary"]["optimizer_steps"] == 5


def test_a_bad_form_value_shows_the_apis_message_beside_its_field(page, svc, artifacts):
    api = svc["alice"].post("/v1/runs", json={"steps": 0, "lr": "fast"})
    assert api.status_code == 422
    said = {e["loc"][-1]: e["msg"] for e in api.json()["detail"]}
    page.goto(svc["base"] + "/ui/launch")
    page.fill("#in-steps", "0")
    page.fill("#in-lr", "fast")
    page.click("#launch button[type=submit]")
    assert page.inner_text("#error-steps") == said["steps"]
    assert page.inner_text("#error-lr") == said["lr"]
    assert page.input_value("#in-lr") == "fast"  # the form keeps what was typed
    _shot(page, artifacts, "launch")


def test_script_in_a_run_label_does_not_execute(page, svc):
    svc = _trained(svc)
    rid = svc["ids"]["xss"]
    for url in ("/ui/runs", f"/ui/runs/{rid}", f"/ui/compare?ids={rid},{svc['ids']['fallback']}"):
        page.goto(svc["base"] + url)
        page.wait_for_load_state("load")
        assert page.evaluate("window.__xss") is None
        assert page.evaluate("document.querySelectorAll('img').length") == 0
    page.goto(svc["base"] + f"/ui/runs/{rid}")
    assert page.inner_text("h1 .label") == XSS  # shown as text


def test_a_cross_site_post_is_refused(browser, page, svc):
    svc = _trained(svc)
    before = len(svc["alice"].get("/v1/runs").json()["runs"])
    # A page of another site that posts the launch form: the Strict cookie is not sent along.
    context = page.context
    evil = context.new_page()
    evil.route(
        "http://evil.test/",
        lambda route: route.fulfill(
            content_type="text/html",
            body=(
                f"<form id=f method=post action='{svc['base']}/ui/launch'>"
                "<input name=steps value=3></form>"
                "<script>document.getElementById('f').submit()</script>"
            ),
        ),
    )
    evil.goto("http://evil.test/")
    evil.wait_for_url(re.compile(r".*/ui/(signin|launch)$"))
    evil.close()
    # With the session cookie (a same-site attacker, a browser bug): no CSRF token, or a
    # foreign Origin, is a 403.
    cookie = next(c["value"] for c in context.cookies() if c["name"] == "ampkit_session")
    page.goto(svc["base"] + "/ui/launch")
    csrf = page.get_attribute("#launch input[name=csrf]", "value")
    base = {"cookies": {"ampkit_session": cookie}, "follow_redirects": False}
    with httpx.Client(**base) as c:
        no_token = c.post(
            svc["base"] + "/ui/launch", data={"steps": "3"}, headers={"Origin": svc["base"]}
        )
        foreign = c.post(
            svc["base"] + "/ui/launch",
            data={"steps": "3", "csrf": csrf},
            headers={"Origin": "http://evil.test"},
        )
        cancel = c.post(f"{svc['base']}/ui/runs/{svc['ids']['xss']}/cancel", data={"csrf": "x"})
    assert no_token.status_code == foreign.status_code == cancel.status_code == 403, (
        no_token.text,
        foreign.text,
    )
    assert "cross-site request refused" in foreign.text
    assert len(svc["alice"].get("/v1/runs").json()["runs"]) == before  # nothing was launched


def test_compare_and_plan_pages(page, svc, artifacts):
    svc = _trained(svc)
    a, b = svc["ids"]["fallback"], svc["ids"]["xss"]
    page.goto(f"{svc['base']}/ui/compare?ids={a},{b}")
    _until(page, "window.ampkit && ampkit.charts['compare-loss']")
    assert page.evaluate("ampkit.charts['compare-loss'].series.length") == 3  # steps + one per run
    assert page.locator("#compare tbody tr").count() == 2
    _shot(page, artifacts, "compare")
    page.goto(svc["base"] + "/ui/plan")
    page.fill("#in-model_name", "gpt")
    page.fill("#in-gpu_memory_gb", "0.02")
    page.fill("#in-batch_size", "4")
    page.fill("#in-max_length", "64")
    page.select_option("#in-size", "tiny")
    page.click("#plan-form button[type=submit]")
    page.wait_for_selector("#plan", timeout=WAIT_MS)  # the page refreshes itself while the job runs
    rows = page.locator("#plan tbody tr")
    assert rows.count() >= 4 and "fp32" in rows.first.inner_text()
    assert page.get_attribute("#plan", "data-device") == "cpu"  # the default: this server's CPU
    _shot(page, artifacts, "plan-cpu")


def test_plan_page_plans_for_the_chosen_device(page, svc, artifacts):
    """A GPU chosen on the plan page (planned from this CPU-only server): the table says which
    device its figures are for, and the rows it cannot run say why beside the others; a plan of
    the CPU without its memory is the API's message beside the memory field."""
    api = svc["alice"].post(
        "/finetuning/optimize-mixed-precision", json={"model_name": "gpt", "device": "cpu"}
    )
    assert api.status_code == 422
    (said,) = [e["msg"] for e in api.json()["detail"]]
    page.goto(svc["base"] + "/ui/plan")
    page.fill("#in-model_name", "gpt")
    page.select_option("#in-device", "cpu")
    page.click("#plan-form button[type=submit]")
    assert page.inner_text("#error-gpu_memory_gb") == said
    page.select_option("#in-device", "t4-16gb")  # its memory: the budget's default
    page.fill("#in-gpu_memory_gb", "")
    page.fill("#in-batch_size", "4")
    page.fill("#in-max_length", "64")
    page.select_option("#in-size", "tiny")
    page.click("#plan-form button[type=submit]")
    page.wait_for_selector("#plan", timeout=WAIT_MS)  # the page refreshes itself while the job runs
    assert page.inner_text("#plan-for") == "figures for the NVIDIA T4 (t4-16gb)"
    assert "on NVIDIA T4 (t4-16gb)" in page.inner_text("#plan-device")
    assert page.get_attribute("#plan", "data-device") == "t4-16gb"
    rows = {r.split("\t")[0]: r for r in page.locator("#plan tbody tr").all_inner_texts()}
    assert list(rows) == ["fp32", "bf16", "fp16", "bf16-pure", "fp16-pure"]
    for p in ("bf16", "bf16-pure"):  # the T4 (sm_75) has no bf16: refused, and said why
        assert "refused" in rows[p] and "the NVIDIA T4 (sm_75) has no bf16" in rows[p]
    assert "yes" in rows["fp16"] and "refused" not in rows["fp16"]  # the others answer
    assert page.input_value("#in-device") == "t4-16gb"  # the form shows what was planned
    _shot(page, artifacts, "plan")
