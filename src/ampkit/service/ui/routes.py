"""The web UI's pages for runs: sign in and out, the runs, a run (its plots' data, cancel,
resume), compare, and the static files.

Every page reads through the API's own route functions (``routes.runs``) with the signed-in
owner, so it shows exactly what that owner's token could read, inside the same owner checks; the
body cap is the app's middleware, which sees these forms too. The plots are drawn by
``static/run.js`` with uPlot (vendored, MIT) from ``/ui/runs/{id}/data``.
"""

from __future__ import annotations

import json
import time
from importlib import resources
from typing import Annotated, Any, Callable, Optional

from fastapi import APIRouter, HTTPException, Query, Request, Response

from ..checks import shown
from ..deps import lookup, service
from ..limits import limit
from ..routes import runs
from ..runner import TERMINAL, read_log
from ..schemas import run_view
from ..store import STATUSES
from .pages import UIRoute, form, me, page, root, to
from .series import FIGURES, MARKED, columns_of
from .session import COOKIE, check_origin, sessions_of, set_cookie, signed_in

__all__ = ["router"]

MAX_POINTS = 2000  # points per plotted series (more: min/max per bucket, series.downsample)
LISTED = 1000  # runs on the runs page (the API's largest page)
STATIC = {
    "uPlot.iife.min.js": "text/javascript",
    "uPlot.min.css": "text/css",
    "uPlot.LICENSE": "text/plain",
    "run.js": "text/javascript",
    "ui.css": "text/css",
}

router = APIRouter(route_class=UIRoute, include_in_schema=False)


# --- signing in and out ----------------------------------------------------------------------


@router.get("/")
def home(request: Request) -> Response:
    return to(request, "/ui/runs" if signed_in(request) else "/ui/signin")


@router.get("/ui/signin")
def signin_page(request: Request) -> Response:
    return page(request, "signin.html", signed_in(request), error=None)


@router.post("/ui/signin")
async def signin(request: Request) -> Response:
    check_origin(request)
    client = request.client.host if request.client else "?"
    limit(request, f"ip:{client}", "sign-in")  # the API's rate limit: no token guessing at speed
    form = await request.form()
    token = str(form.get("token") or "").strip()
    if service(request).tokens.get(token) is None:
        return page(
            request,
            "signin.html",
            None,
            status=401,
            error="that token is not one this server knows",
        )
    old = request.cookies.get(COOKIE)
    sessions_of(request).close(old)  # a new session id on sign-in (no session fixation)
    response = to(request, "/ui/runs")
    set_cookie(request, response, sessions_of(request).open(token), path=root(request) or "/")
    return response


@router.post("/ui/signout")
async def signout(request: Request) -> Response:
    who = me(request)
    await form(request, who)
    sessions_of(request).close(request.cookies.get(COOKIE))
    response = to(request, "/ui/signin")
    response.delete_cookie(
        COOKIE,
        path=root(request) or "/",
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )
    return response


# --- runs ------------------------------------------------------------------------------------


@router.get("/ui/runs")
def runs_page(request: Request, status: Optional[str] = None) -> Response:
    who = me(request)
    status = status or None  # the filter's "any"; another word is the listing's 422
    listed = runs.list_runs(who[0], service(request), status=status, limit=LISTED)["runs"]
    return page(
        request,
        "runs.html",
        who,
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


def _run(request: Request, run_id: str, error: Optional[str] = None, status: int = 200) -> Response:
    """The run's page (``error``: why the button just pressed did nothing, e.g. it ended)."""
    who = me(request)
    svc = service(request)
    view = run_view(svc.runner.shown(lookup(svc, run_id, who[0])))
    return page(
        request,
        "run.html",
        who,
        status=status,
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
    who = signed_in(request)
    if who is None:
        raise HTTPException(401, "not signed in")
    svc = service(request)
    run = svc.runner.shown(lookup(svc, run_id, who[0]))
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


async def _act(request: Request, run_id: str, action: Callable[[dict, Any], Any]) -> Response:
    """A run page's button: the API's own action for this owner's run; its 409 shown on the page."""
    who = me(request)
    await form(request, who)
    svc = service(request)
    try:
        action(lookup(svc, run_id, who[0]), svc)
    except HTTPException as e:
        if e.status_code != 409:
            raise
        return _run(request, run_id, error=str(e.detail), status=409)
    return to(request, f"/ui/runs/{run_id}")


@router.post("/ui/runs/{run_id}/cancel")
async def cancel(request: Request, run_id: str) -> Response:
    return await _act(request, run_id, runs.cancel)


@router.post("/ui/runs/{run_id}/resume")
async def resume(request: Request, run_id: str) -> Response:
    return await _act(request, run_id, runs.resume)


# --- compare ---------------------------------------------------------------------------------


@router.get("/ui/compare")
def compare_page(request: Request, ids: Annotated[Optional[list[str]], Query()] = None) -> Response:
    who = me(request)
    wanted = [i for x in ids or () for i in x.split(",") if i][:20]
    table, error = None, None
    try:
        table = runs.compare(",".join(wanted), who=who[0], svc=service(request))
    except HTTPException as e:
        if e.status_code not in (409, 422):
            raise
        error = str(e.detail)
    return page(request, "compare.html", who, ids=wanted, table=table, error=error)


# --- static files ----------------------------------------------------------------------------


@router.get("/ui/static/{name}")
def static(name: str) -> Response:
    if name not in STATIC:
        raise HTTPException(404, f"no static file {shown(name)}")
    data = resources.files(__package__).joinpath("static", name).read_bytes()
    return Response(data, media_type=STATIC[name], headers={"Cache-Control": "max-age=3600"})
