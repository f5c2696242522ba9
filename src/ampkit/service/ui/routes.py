"""The web UI's pages, served by the service beside its API (``/`` and ``/ui/...``).

Every page reads through the API's own route functions (``routes.runs``, the planner route of
``routes.finetuning``) with the signed-in owner, so it shows exactly what that owner's token
could read, inside the same owner checks, queue cap and rate limits; the body cap is the app's
middleware, which sees these forms too. Pages are server-rendered (Jinja2, autoescaped); the
plots are drawn by ``static/run.js`` with uPlot (vendored, MIT) from ``/ui/runs/{id}/data``.
"""

from __future__ import annotations

import functools
import json
import time
from collections.abc import Awaitable
from importlib import resources
from typing import Annotated, Any, Callable, Optional

from fastapi import APIRouter, HTTPException, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse
from fastapi.routing import APIRoute
from pydantic import ValidationError

from ...step.precision import CANONICAL
from ..checks import shown
from ..deps import lookup, service
from ..limits import limit
from ..routes import finetuning, runs
from ..runner import TERMINAL, read_log
from ..schemas import OptimizeBody, RunSpec, run_view
from ..store import STATUSES
from .forms import body as form_body
from .forms import errors as form_errors
from .forms import fields as form_fields
from .series import FIGURES, MARKED, columns_of
from .session import (
    COOKIE,
    Session,
    check_origin,
    check_post,
    secure,
    sessions_of,
    set_cookie,
    signed_in,
)

__all__ = ["router"]

MAX_POINTS = 2000  # points per plotted series (more: min/max per bucket, series.downsample)
LISTED = 1000  # runs on the runs page (the API's largest page)
SUGGEST = {
    "precision": CANONICAL,
    "device": ("cpu", "cuda", "cuda:0", "mps"),
}  # the launch form's hints
STATIC = {
    "uPlot.iife.min.js": "text/javascript",
    "uPlot.min.css": "text/css",
    "uPlot.LICENSE": "text/plain",
    "run.js": "text/javascript",
    "ui.css": "text/css",
}


class _SignIn(Exception):
    """Not signed in: the page answers with a redirect to the sign-in page."""


class UIRoute(APIRoute):
    """A UI route: its answer carries the security headers, and an error is a page (not JSON)."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                response = await handler(request)
            except _SignIn:
                response = _to(request, "/ui/signin")
            except HTTPException as e:
                if request.url.path.endswith("/data"):
                    response = JSONResponse(
                        {"detail": e.detail}, status_code=e.status_code, headers=e.headers
                    )
                elif e.status_code == 501:  # no jinja2: nothing to render a page with
                    response = PlainTextResponse(str(e.detail), status_code=501)
                else:
                    response = _page(
                        request,
                        "error.html",
                        signed_in(request),
                        status=e.status_code,
                        detail=e.detail,
                        headers=e.headers,
                    )
            except RequestValidationError as e:
                response = _page(
                    request,
                    "error.html",
                    None,
                    status=422,
                    detail="; ".join(
                        f"{'.'.join(map(str, x['loc']))}: {x['msg']}" for x in e.errors()
                    ),
                )
            return secure(response)

        return route


router = APIRouter(route_class=UIRoute, include_in_schema=False)


@functools.lru_cache(maxsize=1)
def _templates() -> Any:
    try:
        import jinja2
    except ImportError:
        raise HTTPException(501, "the web UI needs jinja2: pip install 'ampkit[serve]'") from None
    env = jinja2.Environment(
        loader=jinja2.PackageLoader(__package__, "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["when"] = lambda t: (
        "" if t is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    )
    env.filters["num"] = _num
    env.filters["duration"] = _duration
    return env


def _page(
    request: Request,
    name: str,
    me: Optional[tuple[str, Session]],
    status: int = 200,
    headers: Optional[dict[str, str]] = None,
    **context: Any,
) -> HTMLResponse:
    root = _root(request)
    path = request.url.path
    html = (
        _templates()
        .get_template(name)
        .render(
            owner=me[0] if me else None,
            csrf=me[1].csrf if me else "",
            root=root,
            path=path[len(root) :] if path.startswith(root) else path,
            **context,
        )
    )
    return HTMLResponse(html, status_code=status, headers=headers)


def _root(request: Request) -> str:
    """The path the service is mounted at (``""`` at the top; ``/ampkit`` inside another app)."""
    return str(request.scope.get("root_path") or "").rstrip("/")


def _to(request: Request, path: str) -> RedirectResponse:
    return RedirectResponse(_root(request) + path, status_code=303)


def _me(request: Request) -> tuple[str, Session]:
    me = signed_in(request)
    if me is None:
        raise _SignIn
    return me


async def _form(request: Request, me: tuple[str, Session]) -> dict[str, Any]:
    """The POSTed form, after the CSRF and origin checks (403 otherwise)."""
    form = await request.form()
    check_post(request, me[1], form)
    return dict(form)


# --- signing in and out ----------------------------------------------------------------------


@router.get("/")
def home(request: Request) -> Response:
    return _to(request, "/ui/runs" if signed_in(request) else "/ui/signin")


@router.get("/ui/signin")
def signin_page(request: Request) -> Response:
    return _page(request, "signin.html", signed_in(request), error=None)


@router.post("/ui/signin")
async def signin(request: Request) -> Response:
    check_origin(request)
    client = request.client.host if request.client else "?"
    limit(
        request, f"ip:{client}", "sign-in"
    )  # the API's per-caller rate limit: no token guessing at speed
    form = await request.form()
    token = str(form.get("token") or "").strip()
    if service(request).tokens.get(token) is None:
        return _page(
            request,
            "signin.html",
            None,
            status=401,
            error="that token is not one this server knows",
        )
    old = request.cookies.get(COOKIE)
    sessions_of(request).close(old)  # a new session id on sign-in (no session fixation)
    response = _to(request, "/ui/runs")
    set_cookie(request, response, sessions_of(request).open(token), path=_root(request) or "/")
    return response


@router.post("/ui/signout")
async def signout(request: Request) -> Response:
    me = _me(request)
    await _form(request, me)
    sessions_of(request).close(request.cookies.get(COOKIE))
    response = _to(request, "/ui/signin")
    response.delete_cookie(
        COOKIE,
        path=_root(request) or "/",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


# --- runs ------------------------------------------------------------------------------------


@router.get("/ui/runs")
def runs_page(request: Request, status: Optional[str] = None) -> Response:
    me = _me(request)
    status = status or None  # the filter's "any"
    if status is not None and status not in STATUSES:
        raise HTTPException(422, f"status {shown(status)} is not one of: {', '.join(STATUSES)}")
    listed = runs.list_runs(me[0], service(request), status=status, limit=LISTED)["runs"]
    return _page(
        request,
        "runs.html",
        me,
        runs=[_row(r, service(request)) for r in listed],
        wanted=status,
        statuses=STATUSES,
        shown_max=LISTED,
    )


def _row(view: dict[str, Any], svc: Any) -> dict[str, Any]:
    """A line of the runs table: progress from the summary, or from the log while it runs."""
    s, spec = view.get("summary") or {}, view["spec"]
    done, loss = s.get("optimizer_steps"), s.get("final_loss")
    speed, unit = (
        (s["tokens_per_s"], "tokens/s")
        if s.get("tokens_per_s")
        else (s.get("samples_per_s"), "samples/s")
    )
    precision = s.get("precision") or spec.get("precision")
    row = svc.store.get(view["id"]) if view["status"] == "running" else None
    if row is not None:
        cols = columns_of(view["id"], read_log(row["run_dir"]))
        done = len(cols.steps)
        loss = next((v for v in reversed(cols.values["loss"]) if v == v), None)
        speed = next((v for v in reversed(cols.values["speed"]) if v == v), None)
        unit = "samples/s" if cols.speed_key == "samples_per_s" else "tokens/s"
    end = view["ended"] or (time.time() if view["status"] == "running" else None)
    return {
        **view,
        "done": done,
        "asked": spec.get("steps"),
        "loss": loss,
        "speed": speed,
        "unit": unit if speed else "",
        "precision": precision,
        "duration": end - view["started"] if end and view["started"] else None,
    }


@router.get("/ui/runs/{run_id}")
def run_page(request: Request, run_id: str) -> Response:
    return _run(request, run_id)


def _run(request: Request, run_id: str, error: Optional[str] = None) -> Response:
    """The run's page (``error``: why the button just pressed did nothing, e.g. it ended)."""
    me = _me(request)
    svc = service(request)
    view = run_view(svc.runner.shown(lookup(svc, run_id, me[0])))
    return _page(
        request,
        "run.html",
        me,
        run=view,
        settings=_settings(view),
        figures=FIGURES,
        error=error,
        resumable=view["kind"] == "train"
        and view["status"] in ("interrupted", "failed", "cancelled"),
        live=view["status"] not in TERMINAL,
    )


def _settings(view: dict[str, Any]) -> list[tuple[str, str]]:
    out = [
        (k, json.dumps(v, ensure_ascii=False) if isinstance(v, (dict, list)) else str(v))
        for k, v in view["spec"].items()
        if v not in (None, {}, [])
    ]
    if view["texts_count"]:
        out.append(("texts", f"{view['texts_count']} texts, {view['texts_bytes']:,} bytes"))
    return out


@router.get("/ui/runs/{run_id}/data")
def run_data(
    request: Request, run_id: str, points: int = Query(MAX_POINTS, ge=10, le=10_000)
) -> Response:
    """The run's plot data: each figure downsampled to ``points`` (exact bucket extremes), the
    skipped steps and the events, and the run's status (the page polls it while the run is live)."""
    me = signed_in(request)
    if me is None:
        raise HTTPException(401, "not signed in")
    svc = service(request)
    run = svc.runner.shown(lookup(svc, run_id, me[0]))
    cols = columns_of(run["id"], read_log(run["run_dir"]))
    body = {
        "id": run["id"],
        "status": run["status"],
        "error": run["error"],
        "steps": len(cols.steps),
        "series": cols.series(points),
        "skipped": cols.skipped,
        "skipped_total": cols.skipped_total,
        "events": cols.events,
        "events_total": cols.events_total,
        "marked": MARKED,
        "live": run["status"] not in TERMINAL,
    }
    return Response(
        json.dumps(body, ensure_ascii=True, separators=(",", ":"), allow_nan=False, default=str),
        media_type="application/json",
    )


@router.post("/ui/runs/{run_id}/cancel")
async def cancel(request: Request, run_id: str) -> Response:
    me = _me(request)
    await _form(request, me)
    svc = service(request)
    try:
        runs.cancel(lookup(svc, run_id, me[0]), svc)
    except HTTPException as e:
        if e.status_code != 409:
            raise
        return _run(request, run_id, error=str(e.detail))
    return _to(request, f"/ui/runs/{run_id}")


@router.post("/ui/runs/{run_id}/resume")
async def resume(request: Request, run_id: str) -> Response:
    me = _me(request)
    await _form(request, me)
    svc = service(request)
    try:
        runs.resume(lookup(svc, run_id, me[0]), svc)
    except HTTPException as e:
        if e.status_code != 409:
            raise
        return _run(request, run_id, error=str(e.detail))
    return _to(request, f"/ui/runs/{run_id}")


# --- compare ---------------------------------------------------------------------------------


@router.get("/ui/compare")
def compare_page(request: Request, ids: Annotated[Optional[list[str]], Query()] = None) -> Response:
    me = _me(request)
    wanted = [i for x in ids or () for i in x.split(",") if i][:20]
    table, error = None, None
    try:
        table = runs.compare(",".join(wanted), me[0], service(request))
    except HTTPException as e:
        if e.status_code not in (409, 422):
            raise
        error = str(e.detail)
    return _page(request, "compare.html", me, ids=wanted, table=table, error=error)


# --- launch ----------------------------------------------------------------------------------


@router.get("/ui/launch")
def launch_page(request: Request) -> Response:
    me = _me(request)
    return _page(
        request,
        "launch.html",
        me,
        fields=form_fields(RunSpec, suggest=SUGGEST),
        values={},
        errors={},
        error=None,
    )


@router.post("/ui/launch")
async def launch(request: Request) -> Response:
    me = _me(request)
    form = await _form(request, me)
    values = {k: v for k, v in form.items() if k != "csrf" and isinstance(v, str)}
    errors, error = {}, None
    try:
        spec = RunSpec.model_validate(form_body(RunSpec, values))
        run = runs.create_run(spec, me[0], service(request))
        return _to(request, f"/ui/runs/{run['id']}")
    except ValidationError as e:
        errors = form_errors(e)
    except HTTPException as e:
        if e.status_code not in (422, 429, 507):
            raise
        error = str(e.detail)
    return _page(
        request,
        "launch.html",
        me,
        status=422 if errors or error else 200,
        fields=form_fields(RunSpec, suggest=SUGGEST),
        values=values,
        errors=errors,
        error=error,
    )


# --- plan ------------------------------------------------------------------------------------


@router.get("/ui/plan")
def plan_page(request: Request) -> Response:
    me = _me(request)
    return _page(
        request,
        "plan.html",
        me,
        fields=form_fields(OptimizeBody, required=("gpu_memory_gb",)),
        values={},
        errors={},
        error=None,
        plan=None,
        job=None,
    )


@router.post("/ui/plan")
async def plan(request: Request) -> Response:
    """The planner route's own answer (``POST /finetuning/optimize-mixed-precision``: its checks,
    its cache, its rate limit and its jobs), as a table."""
    me = _me(request)
    form = await _form(request, me)
    values = {k: v for k, v in form.items() if k != "csrf" and isinstance(v, str)}
    fields = form_fields(OptimizeBody, required=("gpu_memory_gb",))
    try:
        body = OptimizeBody.model_validate(form_body(OptimizeBody, values))
    except ValidationError as e:
        return _page(
            request,
            "plan.html",
            me,
            status=422,
            fields=fields,
            values=values,
            errors=form_errors(e),
            error=None,
            plan=None,
            job=None,
        )
    return _plan_answer(
        request,
        me,
        lambda: finetuning.optimize(body, me[0], service(request), request),
        fields=fields,
        values=values,
    )


@router.get("/ui/plan/jobs/{job_id}")
def plan_job(request: Request, job_id: str) -> Response:
    me = _me(request)
    return _plan_answer(
        request,
        me,
        lambda: finetuning.optimize_job(job_id, me[0]),
        fields=form_fields(OptimizeBody, required=("gpu_memory_gb",)),
        values=None,
    )


def _plan_answer(
    request: Request, me: tuple[str, Session], ask: Callable[[], Any], **context: Any
) -> Response:
    plan, job, error = None, None, None
    try:
        got = ask()
    except HTTPException as e:
        if e.status_code not in (422, 429):
            raise
        error = str(e.detail)
    else:
        if isinstance(got, JSONResponse):
            got = json.loads(bytes(got.body))
        if "recommendations" in got:
            plan = got
            if context["values"] is None:  # a job's page: the form shows what was planned
                context["values"] = {
                    k: str(got[k]) for k in ("model_name", "gpu_memory_gb", "batch_size")
                }
        elif got.get("status") == "failed":
            error = f"the planner failed: {got.get('error')}"
        else:
            job = got
    context["values"] = context["values"] or {}
    response = _page(
        request,
        "plan.html",
        me,
        status=422 if error else 200,
        errors={},
        error=error,
        plan=plan,
        job=job,
        **context,
    )
    if job is not None:
        response.headers["Refresh"] = (
            f"2; url={_root(request)}/ui/plan/jobs/{job['job_id']}"  # no script: the browser polls
        )
    return response


# --- static files ----------------------------------------------------------------------------


@router.get("/ui/static/{name}")
def static(name: str) -> Response:
    if name not in STATIC:
        raise HTTPException(404, f"no static file {shown(name)}")
    data = resources.files(__package__).joinpath("static", name).read_bytes()
    return Response(data, media_type=STATIC[name], headers={"Cache-Control": "max-age=3600"})


# --- formatting ------------------------------------------------------------------------------


def _num(v: Any, digits: int = 4) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return ""
    if isinstance(v, float):
        return f"{v:.{digits}g}"
    return str(v)


def _duration(s: Optional[float]) -> str:
    if s is None:
        return ""
    s = int(s)
    return (
        f"{s // 3600}h{s // 60 % 60:02d}m"
        if s >= 3600
        else f"{s // 60}m{s % 60:02d}s"
        if s >= 60
        else f"{s}s"
    )
