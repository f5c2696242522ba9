"""Who is signed in to the web UI, and what every UI answer and form must carry.

A session is made by signing in with a bearer token (the same tokens as the API): the browser
gets a random session id in a cookie (``HttpOnly``, ``SameSite=Strict``, ``Secure`` when the
request came over TLS) and the server keeps ``id -> (token, CSRF token)`` in memory. The owner is
looked up from the token on every request, exactly as the API does, so a session reads what that
token could read and nothing more; a server restart signs everyone out.

A form POST is accepted only with the session's CSRF token in its ``csrf`` field and, when the
browser sends one (every current browser does on a POST), an ``Origin`` (else ``Referer``) of
this very server: a cross-site POST is a 403 before anything is done.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional
from urllib.parse import urlsplit

from fastapi import HTTPException, Request, Response

__all__ = [
    "COOKIE",
    "HEADERS",
    "Session",
    "Sessions",
    "check_origin",
    "check_post",
    "secure",
    "sessions_of",
    "signed_in",
]

COOKIE = "ampkit_session"
MAX_AGE_S = 12 * 3600  # a session lasts a working day
MAX_SESSIONS = 10_000  # the oldest is forgotten past this (bounded memory under sign-in floods)
# What a browser needs to render the UI safely: scripts and styles only from this server (no inline
# script), no framing, no MIME sniffing, no referrer leaving the site.
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}


@dataclass(frozen=True)
class Session:
    token: str  # the bearer token signed in with (its owner is looked up on each request)
    csrf: str
    created: float


class Sessions:
    """Session id -> :class:`Session`, in memory: at most ``MAX_SESSIONS``, for ``MAX_AGE_S``."""

    def __init__(self) -> None:
        self._items: OrderedDict[str, Session] = OrderedDict()
        self._lock = threading.Lock()

    def open(self, token: str) -> str:
        sid = secrets.token_urlsafe(32)
        with self._lock:
            self._items[sid] = Session(token, secrets.token_urlsafe(32), time.time())
            while len(self._items) > MAX_SESSIONS:
                self._items.popitem(last=False)
        return sid

    def get(self, sid: Optional[str]) -> Optional[Session]:
        if not sid:
            return None
        with self._lock:
            s = self._items.get(sid)
            if s is not None and time.time() - s.created > MAX_AGE_S:
                del self._items[sid]
                return None
            return s

    def close(self, sid: Optional[str]) -> None:
        with self._lock:
            self._items.pop(sid or "", None)


_GUARD = threading.Lock()


def sessions_of(request: Request) -> Sessions:
    """The app's sessions (``app.state.ui_sessions``, made on first use)."""
    state = request.app.state
    with _GUARD:
        if getattr(state, "ui_sessions", None) is None:
            state.ui_sessions = Sessions()
        return state.ui_sessions


def signed_in(request: Request) -> Optional[tuple[str, Session]]:
    """``(owner, session)`` of the request's session cookie, or None (no cookie, an unknown or
    expired session, or a token this server no longer knows)."""
    session = sessions_of(request).get(request.cookies.get(COOKIE))
    if session is None:
        return None
    who = request.app.state.service.tokens.get(session.token)  # the API's own token -> owner map
    return (who, session) if who is not None else None


def secure(response: Response) -> Response:
    """``response`` with the UI's security headers."""
    for k, v in HEADERS.items():
        if k not in response.headers:  # a static file keeps its own Cache-Control
            response.headers[k] = v
    return response


def set_cookie(request: Request, response: Response, sid: str, path: str = "/") -> None:
    response.set_cookie(
        COOKIE,
        sid,
        max_age=MAX_AGE_S,
        path=path,
        httponly=True,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def check_origin(request: Request) -> None:
    """403 for a POST whose ``Origin`` (else ``Referer``) is another site's."""
    origin = request.headers.get("origin") or request.headers.get("referer")
    if origin is None:
        return  # a non-browser client: the CSRF token still has to match
    parts = urlsplit(origin)
    if origin == "null" or (parts.scheme, parts.netloc) != (request.url.scheme, request.url.netloc):
        raise HTTPException(
            403,
            f"cross-site request refused: origin {origin[:100]!r} is not this server "
            f"({request.url.scheme}://{request.url.netloc})",
        )


def check_post(request: Request, session: Session, form: Any) -> None:
    """403 unless the form carries the session's CSRF token and comes from this site."""
    check_origin(request)
    sent = form.get("csrf")
    if not isinstance(sent, str) or not secrets.compare_digest(sent, session.csrf):
        raise HTTPException(
            403,
            "cross-site request refused: the form's CSRF token is missing or wrong "
            "(reload the page and submit it again)",
        )
