"""What a speed figure timed, and whether a speed ratio is within its own noise.

``auto``'s check, ``ampkit info``, ``ampkit bench`` and ``ampkit tune`` each time something
different (a whole training step, or one matmul), on however many threads, so their ratios can
disagree. Each says what it timed with :meth:`Timing.describe` -- "whole training step, 1 thread,
5 repeats, ±4%" -- and words a ratio with :func:`speed_words`, which says "within noise" instead
of faster or slower when the ratio is inside the spread the repeats themselves showed.

The verdict rests on the paired ratios -- each repeat's reference time over its candidate time,
timed back to back -- and on their worst one, not on the medians alone: a load that slowed most
of fp32's repeats makes the medians say 11x for a precision no faster than fp32, while the
repeat that escaped the load says 1.0x. The spread is the distance from the ratio to the pair
least on its side (p10 or p90 from ten repeats, else the lowest or highest), plus half the
pairs' range (p10-p90, else the whole range): a ratio is outside it only when even that pair
beats (or loses to) the reference by more than half the range the repeats showed. A consistent
1.3x (pairs 1.28-1.32) is clear; pairs from 1.0x to 11x are "within noise". With one repeat
there is no spread to measure: every ratio is then "within noise", since nothing says it is not.

A spread is printed as a figure ("±4%") up to ±100% of the reference's speed (:data:`NOISY`);
above that (±1559% on a loaded machine) the figure says nothing, and :func:`spread_words` says
in words that the repeats disagree. Such a spread leaves almost every ratio within noise; one
that escapes it (pairs from 5x to 7x: a spread of 2) is a real verdict and keeps it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "NOISY",
    "Timing",
    "noise_words",
    "paired_ratio",
    "speed_words",
    "spread_words",
    "within_noise",
]

NOISY = 1.0  # a spread above ±100% of the reference's speed is said in words, not as a figure


@dataclass(frozen=True)
class Timing:
    """How a speed was measured: ``what`` was timed, on how many ``threads``, how many ``repeats``
    (each of ``per_repeat`` steps or calls), and the ``spread`` they showed (a fraction; inf for
    one repeat)."""

    what: str
    threads: int
    repeats: int
    spread: float
    per_repeat: str = ""

    def describe(self) -> str:
        threads = f"{self.threads} thread{'s' if self.threads != 1 else ''}"
        repeats = f"{self.repeats} repeat{'s' if self.repeats != 1 else ''}"
        if self.per_repeat:
            repeats += f" of {self.per_repeat}"
        return f"{self.what}, {threads}, {repeats}, {spread_words(self.spread)}"


def paired_ratio(reference: Sequence[float], candidate: Sequence[float]) -> tuple[float, float]:
    """``median(reference) / median(candidate)`` (> 1: the candidate is faster) and the spread of
    the paired ratios ``reference[i] / candidate[i]`` around it, in units of the ratio (module
    doc). Times in any one unit."""
    if not reference or len(reference) != len(candidate):
        raise ValueError(
            f"paired_ratio needs two equally long, non-empty lists of times "
            f"(got {len(reference)} and {len(candidate)})"
        )
    ratio = statistics.median(reference) / statistics.median(candidate)
    if len(reference) < 2:
        return ratio, math.inf
    pairs = sorted(r / c for r, c in zip(reference, candidate))
    n = len(pairs)
    lo, hi = pairs[int(0.1 * (n - 1))], pairs[math.ceil(0.9 * (n - 1))]
    worst = ratio - lo if ratio >= 1.0 else hi - ratio  # the pair least on the ratio's side of 1
    return ratio, max(0.0, worst) + (hi - lo) / 2


def within_noise(ratio: float, spread: float) -> bool:
    """Whether ``ratio`` (a speed relative to 1.0) is inside the measured ``spread``."""
    return not math.isfinite(spread) or abs(ratio - 1.0) <= spread


def speed_words(ratio: float, spread: float, reference: str = "fp32") -> str:
    """``ratio`` in words: "1.15x fp32's speed", "0.90x fp32's speed" or, inside the spread,
    "1.02x fp32's speed, within noise (±4%)"."""
    text = f"{ratio:.2f}x {reference}'s speed"
    return text + (f", within noise ({noise_words(spread)})" if within_noise(ratio, spread) else "")


def spread_words(spread: float) -> str:
    """The spread as every speed answer prints it: "±4%" up to :data:`NOISY`, then "the repeats
    disagree by more than ±100%"; "no spread from one repeat" for inf."""
    if not math.isfinite(spread):
        return "no spread from one repeat"
    if spread > NOISY:
        return f"the repeats disagree by more than ±{100 * NOISY:.0f}%"
    return f"±{100 * spread:.0f}%"


def noise_words(spread: float) -> str:
    """What "within noise (...)" says: the spread (:func:`spread_words`), and above
    :data:`NOISY` that there is no speed verdict."""
    return spread_words(spread) + (": no speed verdict" if spread > NOISY else "")
