"""The web UI's forms: launch a run and plan memory, each checked by the API's own request
model (its messages beside their fields) and answered by the API's own route function
(``routes.runs.create_run``; the planner route of ``routes.finetuning``, with its cache, rate
limit and jobs)."""

from __future__ import annotations

import json
from typing import Any, Callable, Optional
from urllib.parse import urlencode

from fastapi import APIRouter, HTTPException, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from ...plan.devices import DEVICES
from ...step.precision import CANONICAL
from ..deps import service
from ..routes import finetuning, runs
from ..schemas import OptimizeBody, RunSpec
from .forms import body as form_body
from .forms import errors as form_errors
from .forms import fields as form_fields
from .pages import UIRoute, form, me, page, root, to
from .session import Session

__all__ = ["router"]

SUGGEST = {
    "precision": CANONICAL,
    "device": ("cpu", "cuda", "cuda:0", "mps"),
}  # the launch form's hints
# the plan form's device: a select of what the API takes (cpu and the planner's devices)
PLAN_CHOICES = {"device": ("cpu", *DEVICES)}

router = APIRouter(route_class=UIRoute, include_in_schema=False)


# --- launch ----------------------------------------------------------------------------------


@router.get("/ui/launch")
def launch_page(request: Request) -> Response:
    who = me(request)
    return page(
        request,
        "launch.html",
        who,
        fields=form_fields(RunSpec, suggest=SUGGEST),
        values={},
        errors={},
        error=None,
    )


@router.post("/ui/launch")
async def launch(request: Request) -> Response:
    who = me(request)
    posted = await form(request, who)
    values = {k: v for k, v in posted.items() if k != "csrf" and isinstance(v, str)}
    errors, error, refused = {}, None, None
    try:
        spec = RunSpec.model_validate(form_body(RunSpec, values))
        run = runs.create_run(spec, who[0], service(request))
        return to(request, f"/ui/runs/{run['id']}")
    except ValidationError as e:
        errors = form_errors(e)
    except HTTPException as e:
        if e.status_code not in (422, 429, 507):
            raise
        error, refused = str(e.detail), e
    return _as_api(
        refused,
        page(
            request,
            "launch.html",
            who,
            status=422 if errors or error else 200,
            fields=form_fields(RunSpec, suggest=SUGGEST),
            values=values,
            errors=errors,
            error=error,
        ),
    )


def _as_api(refused: Optional[HTTPException], response: Response) -> Response:
    """The page of a request the API refused carries the API's status and headers (429 and its
    ``Retry-After``, 507), so a browser, a proxy and a script see what the API would say."""
    if refused is not None:
        response.status_code = refused.status_code
        for k, v in (refused.headers or {}).items():
            response.headers[k] = v
    return response


# --- plan ------------------------------------------------------------------------------------


@router.get("/ui/plan")
def plan_page(request: Request) -> Response:
    who = me(request)
    return page(
        request,
        "plan.html",
        who,
        fields=_plan_fields(),
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
    who = me(request)
    posted = await form(request, who)
    values = {k: v for k, v in posted.items() if k != "csrf" and isinstance(v, str)}
    fields = _plan_fields()
    try:
        body = OptimizeBody.model_validate(form_body(OptimizeBody, values))
    except ValidationError as e:
        return page(
            request,
            "plan.html",
            who,
            status=422,
            fields=fields,
            values=values,
            errors=form_errors(e, OptimizeBody),
            error=None,
            plan=None,
            job=None,
        )
    return _plan_answer(
        request,
        who,
        lambda: finetuning.optimize(body, who[0], service(request), request),
        fields=fields,
        values=values,
    )


@router.get("/ui/plan/jobs/{job_id}")
def plan_job(request: Request, job_id: str) -> Response:
    who = me(request)
    return _plan_answer(
        request,
        who,
        lambda: finetuning.optimize_job(job_id, who[0]),
        fields=_plan_fields(),
        values={k: v for k, v in request.query_params.items() if k in OptimizeBody.model_fields},
    )


def _plan_fields() -> list[Any]:
    return form_fields(OptimizeBody, choices=PLAN_CHOICES)


def _plan_answer(
    request: Request, who: tuple[str, Session], ask: Callable[[], Any], **context: Any
) -> Response:
    plan, job, error, refused = None, None, None, None
    try:
        got = ask()
    except HTTPException as e:
        if e.status_code not in (422, 429):
            raise
        error, refused = str(e.detail), e
    else:
        if isinstance(got, JSONResponse):
            got = json.loads(bytes(got.body))
        if "recommendations" in got:
            plan = got
        elif got.get("status") == "failed":
            error = f"the planner failed: {got.get('error')}"
        else:
            job = got
    response = page(
        request,
        "plan.html",
        who,
        status=422 if error else 200,
        errors={},
        error=error,
        plan=plan,
        job=job,
        **context,
    )
    if job is not None:
        # no script: the browser polls the job, the form's values along (to show what was planned)
        asked = urlencode(context["values"])
        response.headers["Refresh"] = f"2; url={root(request)}/ui/plan/jobs/{job['job_id']}?{asked}"
    return _as_api(refused, response)
