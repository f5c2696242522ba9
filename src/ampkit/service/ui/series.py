"""A run's log as plot data: one column per plotted figure, downsampled for the browser.

The columns are read from the same JSONL lines the API pages through (``runner.read_log``) and
kept per run, parsed once: a log only grows, so the next poll parses only its new lines (a
run of 100,000 steps is parsed once, not on every poll). A series longer than ``max_points`` is cut
into ``max_points // 2`` buckets of consecutive steps, and each bucket keeps its smallest and its
largest value at the steps where they occurred: the plot's envelope is exact, and every plotted
point is a value the log holds at that step (the browser shows it on hover).
"""

from __future__ import annotations

import contextlib
import json
import math
import threading
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

__all__ = ["FIGURES", "MARKED", "Columns", "columns_of", "downsample"]

# figure -> (title, the step record's key(s), the first one present is plotted)
FIGURES = {
    "loss": ("loss", ("loss",)),
    "scale": ("loss scale", ("scale",)),
    "speed": ("tokens/s", ("tokens_per_s", "samples_per_s")),
    "step_time": ("step time (ms)", ("step_time_ms",)),
    "memory": ("peak memory (MiB)", ("peak_mem_bytes",)),
}
# events marked on the plots (others are only listed; an overflow is marked as its skipped step)
MARKED = (
    "fallback",
    "fallback_retry",
    "spike",
    "manifest_violation",
    "stop",
    "precision_switch",
    "scale_exhausted",
    "fallback_exhausted",
)
_SCALE = {"peak_mem_bytes": 1 / 2**20}
MAX_EVENTS = 1000  # events kept per run for the list (the first ones, then a count)
MAX_SKIPS = 4000  # skipped steps kept for markers


@dataclass
class Columns:
    """A run's step records as columns (NaN where a value is missing or not finite)."""

    steps: array = field(default_factory=lambda: array("q"))
    values: dict[str, array] = field(default_factory=lambda: {k: array("d") for k in FIGURES})
    speed_key: Optional[str] = None
    skipped: list[int] = field(default_factory=list)
    skipped_total: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)
    events_total: int = 0
    lines: int = 0  # log lines parsed
    last_line: str = ""
    # points -> (log lines seen, the downsampled series)
    _shown: dict[int, tuple[int, dict[str, Any]]] = field(default_factory=dict)

    def add(self, line: str) -> None:
        rec = json.loads(line)
        if rec.get("type") == "step":
            self.steps.append(int(rec.get("step", 0)))
            for name, (_, keys) in FIGURES.items():
                v = None
                for key in keys:
                    v = rec.get(key)
                    if v is not None:
                        break
                if name == "speed" and v is not None and self.speed_key is None:
                    self.speed_key = key
                ok = isinstance(v, (int, float)) and not isinstance(v, bool)
                self.values[name].append(float(v) * _SCALE.get(key, 1.0) if ok else math.nan)
            if rec.get("skipped"):
                self.skipped_total += 1
                if len(self.skipped) < MAX_SKIPS:
                    self.skipped.append(int(rec.get("step", 0)))
        elif rec.get("type") == "event" and rec.get("kind") not in ("overflow", "summary"):
            self.events_total += 1
            if len(self.events) < MAX_EVENTS:
                self.events.append(rec)

    def series(self, points: int) -> dict[str, dict[str, Any]]:
        """Each figure downsampled to ``points`` (kept until the log grows)."""
        got = self._shown.get(points)
        if got is not None and got[0] == self.lines:
            return got[1]
        out = {}
        for name, (title, _) in FIGURES.items():
            xs, ys = downsample(self.steps, self.values[name], points)
            out[name] = {
                "title": "samples/s"
                if name == "speed" and self.speed_key == "samples_per_s"
                else title,
                "x": xs,
                "y": ys,
            }
        self._shown = {points: (self.lines, out)}
        return out


class _Cache:
    """The parsed columns of the last few runs looked at, grown as their logs grow."""

    def __init__(self, size: int = 16) -> None:
        self._items: OrderedDict[str, Columns] = OrderedDict()
        self._lock = threading.Lock()
        self.size = size

    def get(self, key: str, lines: list[str]) -> Columns:
        with self._lock:
            cols = self._items.pop(key, None)
        if (
            cols is None
            or cols.lines > len(lines)
            or (cols.lines and lines[cols.lines - 1] != cols.last_line)
        ):
            cols = Columns()  # new, or not the log it was (a run directory reused): parse it all
        for line in lines[cols.lines :]:
            # a malformed line is the log's reader's business (read_jsonl); the plot skips it
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                cols.add(line)
        cols.lines = len(lines)
        cols.last_line = lines[-1] if lines else ""
        with self._lock:
            self._items[key] = cols
            while len(self._items) > self.size:
                self._items.popitem(last=False)
        return cols


_CACHE = _Cache()


def columns_of(run_id: str, lines: list[str]) -> Columns:
    """The columns of run ``run_id`` whose log is ``lines`` (``runner.read_log``)."""
    return _CACHE.get(run_id, lines)


def downsample(
    steps: array, values: array, max_points: int
) -> tuple[list[int], list[Optional[float]]]:
    """``(steps, values)`` with at most ``max_points`` points (NaN as None, a gap in the plot): all
    of them when they fit, else the smallest and largest value of each of ``max_points // 2``
    buckets, in step order. A bucket with no finite value keeps one gap."""
    n = len(steps)
    if n <= max_points:
        return list(steps), [None if v != v else v for v in values]
    buckets = max(1, max_points // 2)
    xs: list[int] = []
    ys: list[Optional[float]] = []
    for b in range(buckets):
        lo, hi = b * n // buckets, (b + 1) * n // buckets
        chunk = values[lo:hi]
        finite = [i for i, v in enumerate(chunk) if v == v]
        if not finite:
            xs.append(steps[lo])
            ys.append(None)
            continue
        i_min = min(finite, key=chunk.__getitem__)
        i_max = max(finite, key=chunk.__getitem__)
        for i in sorted({i_min, i_max}):
            xs.append(steps[lo + i])
            ys.append(chunk[i])
    return xs, ys
