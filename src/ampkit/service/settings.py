"""``ampkit serve``'s numeric settings, one table: the ``ampkit serve`` flags are generated from it
(:mod:`ampkit.cli.serve`, one bounded-number parser) and :class:`ampkit.service.schemas.ServiceConfig`
takes its bounds from it, so the command line and the Python API refuse the same values. Plain
Python (no pydantic): the CLI builds its parser without the ``serve`` extra installed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

__all__ = ["MAX_SECONDS", "SERVE_NUMBERS", "Bounded"]

MAX_SECONDS = 30 * 86_400.0  # a run's wall-clock limit: at most 30 days


@dataclass(frozen=True)
class Bounded:
    """A number setting: its type, default, bounds (``gt``/``ge`` below, ``le`` above; finite), the
    unit its errors name, and the flag's help."""

    kind: type  # int or float
    default: Any
    help: str
    gt: Optional[float] = None
    ge: Optional[float] = None
    le: Optional[float] = None
    unit: str = ""

    def bounds(self) -> dict[str, float]:
        """``{"gt": 0, "le": 150}``: the bounds given, as pydantic's ``Field`` and the CLI's parser take them."""
        return {
            k: v for k, v in (("gt", self.gt), ("ge", self.ge), ("le", self.le)) if v is not None
        }


SERVE_NUMBERS: dict[str, Bounded] = {
    "port": Bounded(int, 8000, "port (default: 8000)", ge=1, le=65_535),
    "max_concurrent": Bounded(int, 1, "runs at a time (default: 1)", ge=1),
    "queue_cap": Bounded(
        int, 16, "queued runs per owner before that owner's new ones get 429 (default: 16)", ge=1
    ),
    "max_seconds": Bounded(
        float,
        86_400.0,
        "a run's time limit when its request gives none, in seconds "
        "(default: 86400; at most 30 days)",
        gt=0,
        le=MAX_SECONDS,
        unit="seconds",
    ),
    "max_params": Bounded(
        int,
        2_000_000_000,
        "refuse Hugging Face config models with more parameters (default: 2e9)",
        ge=1,
    ),
    "run_memory_gb": Bounded(
        float,
        None,
        "each run's memory cap in GB (its processes' heap, RLIMIT_DATA): a run that needs more "
        "fails with 'out of memory' instead of waking the machine's OOM killer (default: 90 percent of "
        "this machine's memory, or its container's limit, divided by --max_concurrent, at least 2 GB)",
        gt=0,
        le=1e6,
        unit="GB",
    ),
    "max_gpu_temp": Bounded(
        float,
        None,
        "hold queued runs while a GPU is hotter than this many °C (default: no hold)",
        gt=0,
        le=150,
        unit="°C",
    ),
    "header_timeout": Bounded(
        float,
        10.0,
        "close a connection whose request head, or a pause in its body, takes "
        "longer (seconds; default: 10)",
        gt=0,
        le=3600,
        unit="seconds",
    ),
}
