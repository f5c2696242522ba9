"""What every page of the web UI shares: the route class (security headers on every answer, an
error as a page), the templates (Jinja2, autoescaped, strict), and the session helpers a route
calls (``me``: the signed-in owner or a redirect to sign in; ``form``: a POSTed form after the
CSRF and origin checks). Paths are made under the app's mount point (``root``)."""

from __future__ import annotations

import functools
import time
from collections.abc import Awaitable
from typing import Any, Callable, Optional

from fastapi import HTTPException, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, RedirectResponse
from fastapi.routing import APIRoute

from .session import Session, check_post, secure, signed_in

__all__ = ["UIRoute", "form", "me", "page", "root", "templates", "to"]


class SignIn(Exception):
    """Not signed in: the page answers with a redirect to the sign-in page."""


class UIRoute(APIRoute):
    """A UI route: its answer carries the security headers, and an error is a page (not JSON)."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                response = await handler(request)
            except SignIn:
                response = to(request, "/ui/signin")
            except HTTPException as e:
                if request.url.path.endswith("/data"):
                    response = JSONResponse(
                        {"detail": e.detail}, status_code=e.status_code, headers=e.headers
                    )
                elif e.status_code == 501:  # no jinja2: nothing to render a page with
                    response = PlainTextResponse(str(e.detail), status_code=501)
                else:
                    response = page(
                        request,
                        "error.html",
                        signed_in(request),
                        status=e.status_code,
                        detail=e.detail,
                        headers=e.headers,
                    )
            except RequestValidationError as e:
                response = page(
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


@functools.lru_cache(maxsize=1)
def templates() -> Any:
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


def page(
    request: Request,
    name: str,
    who: Optional[tuple[str, Session]],
    status: int = 200,
    headers: Optional[dict[str, str]] = None,
    **context: Any,
) -> HTMLResponse:
    base = root(request)
    path = request.url.path
    html = (
        templates()
        .get_template(name)
        .render(
            owner=who[0] if who else None,
            csrf=who[1].csrf if who else "",
            root=base,
            path=path[len(base) :] if path.startswith(base) else path,
            **context,
        )
    )
    return HTMLResponse(html, status_code=status, headers=headers)


def root(request: Request) -> str:
    """The path the service is mounted at (``""`` at the top; ``/ampkit`` inside another app)."""
    return str(request.scope.get("root_path") or "").rstrip("/")


def to(request: Request, path: str) -> RedirectResponse:
    return RedirectResponse(root(request) + path, status_code=303)


def me(request: Request) -> tuple[str, Session]:
    """``(owner, session)`` of the request, or (raised) a redirect to the sign-in page."""
    who = signed_in(request)
    if who is None:
        raise SignIn
    return who


async def form(request: Request, who: tuple[str, Session]) -> dict[str, Any]:
    """The POSTed form, after the CSRF and origin checks (403 otherwise)."""
    got = await request.form()
    check_post(request, who[1], got)
    return dict(got)


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
