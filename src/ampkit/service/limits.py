"""Per-owner limits on costly work (the memory planner, estimates, recommendations): a rate limit
(a token bucket: ``burst`` requests at once, then ``per_minute``) and a cap on the owner's jobs in
flight. Over either: 429 with ``Retry-After`` (seconds until a request would pass).

One :class:`Limits` per app (``limits_of(request)`` makes it on first use, from ``app.state.limits``
when the embedding app put one there). A route takes one with ``limit(request, who, "planner")``::

    from ampkit.service.limits import limit
    limit(request, who, "recommend")   # 429 when this owner is over its rate or in-flight cap
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from fastapi import HTTPException

__all__ = ["Limits", "limit", "limits_of"]


@dataclass
class Limits:
    """``per_minute`` requests per owner per kind of work after a ``burst``; at most ``in_flight``
    of an owner's jobs queued or running at once (checked by the planner's job queue)."""

    per_minute: float = 30.0
    burst: int = 10
    in_flight: int = 2
    clock: Callable[[], float] = time.monotonic
    _buckets: dict[tuple[str, str], tuple[float, float]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        if not (self.per_minute > 0 and self.burst >= 1 and self.in_flight >= 1):
            raise ValueError(
                f"limits per_minute={self.per_minute}, burst={self.burst}, in_flight={self.in_flight}: "
                "per_minute must be > 0, burst and in_flight >= 1"
            )

    def take(self, who: str, kind: str) -> None:
        """Spend one request of ``who``'s ``kind`` bucket, or 429 with the wait in ``Retry-After``."""
        rate = self.per_minute / 60.0
        now = self.clock()
        with self._lock:
            tokens, last = self._buckets.get((who, kind), (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - last) * rate)
            if tokens < 1.0:
                self._buckets[(who, kind)] = (tokens, now)
                wait = max(1, math.ceil((1.0 - tokens) / rate))
                raise HTTPException(
                    429,
                    f"too many {kind} requests: {self.burst} at once, then "
                    f"{self.per_minute:g} a minute per owner; retry in {wait} s",
                    headers={"Retry-After": str(wait)},
                )
            self._buckets[(who, kind)] = (tokens - 1.0, now)
            if (
                len(self._buckets) > 10_000
            ):  # forget idle owners (a full bucket is the default anyway)
                full = [
                    k for k, (t, s) in self._buckets.items() if t + (now - s) * rate >= self.burst
                ]
                for k in full:
                    del self._buckets[k]

    def check_in_flight(self, who: str, running: int, kind: str = "planner") -> None:
        """429 when ``who`` already has ``in_flight`` jobs queued or running."""
        if running >= self.in_flight:
            raise HTTPException(
                429,
                f"you have {running} {kind} jobs in flight, this server's limit per owner; "
                "poll them (their job URL) and retry when one is done",
                headers={"Retry-After": "5"},
            )


_GUARD = threading.Lock()


def limits_of(request: Any) -> Limits:
    """The app's :class:`Limits` (``app.state.limits``; made with the defaults on first use)."""
    state = request.app.state
    with _GUARD:
        if getattr(state, "limits", None) is None:
            state.limits = Limits()
        return state.limits


def limit(request: Any, who: str, kind: str) -> Limits:
    """Take one of ``who``'s ``kind`` requests (429 when over the rate); returns the app's limits."""
    limits = limits_of(request)
    limits.take(who, kind)
    return limits
