"""``tune``: the precision to train in, from a :class:`~ampkit.choose.bench.BenchReport`.

The fastest precision whose final loss stays within a tolerance of fp32's and that needed no
fallback, or (with bf16-pure rungs measured) the fewest bytes per parameter; every other
candidate gets its reason for losing. A speed-up within its measured spread is not a reason to
leave fp32 (:mod:`.speed`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Optional

from ..step import tomlio
from ..step.precision import REFERENCE
from ..step.rung import split_spec
from .speed import speed_words, within_noise

if TYPE_CHECKING:
    from .bench import BenchReport, BenchResult

__all__ = ["Recommendation", "tune"]


@dataclass(frozen=True)
class Recommendation:
    """What ``tune`` picked, with every other candidate's reason for losing."""

    precision: str
    step_ms: float
    speedup_vs_fp32: float
    loss_gap: float
    tolerance: float
    batch_size: Optional[int]
    accumulation_steps: int
    why_not: dict[str, str]
    model: Optional[str] = (
        None  # what was measured: the advice holds for this model, size and batch
    )
    size: Optional[str] = None
    prefer: str = (
        "speed"  # speed: the fastest within the tolerance; memory: the fewest bytes per parameter
    )
    bytes_per_param: Optional[float] = None  # the pick's, measured from the live tensors
    timed: str = ""  # what the speeds are: "whole training step, 2 threads, 5 repeats"
    note: str = ""  # e.g. why fp32 won: the fastest candidate was within noise of it

    @property
    def config(self) -> dict[str, Any]:
        """The ``[amp]`` settings: the precision, and for a rung its ``masters`` and ``state_dtype``."""
        base, rung = split_spec(self.precision)
        out: dict[str, Any] = {"precision": base, **(rung.fields() if rung else {})}
        return {**out, "accumulation_steps": self.accumulation_steps}

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_toml(self) -> str:
        """A config ``ampkit train --config`` and ``MixedPrecisionConfig.from_toml`` accept."""
        what = "fastest precision" if self.prefer == "speed" else "fewest bytes per parameter"
        mem = f", {self.bytes_per_param:.2f} B/param" if self.bytes_per_param is not None else ""
        lines = [
            "# written by `ampkit tune`",
            f"# {what} within {100 * self.tolerance:g}% of the fp32 loss: "
            f"{self.precision}, {self.speedup_vs_fp32:.2f}x fp32's speed, loss gap {100 * self.loss_gap:+.2f}%{mem}",
            *([f"# timed: {self.timed}"] if self.timed else []),
            *([f"# {self.note}"] if self.note else []),
            "",
        ]
        text = "\n".join(lines) + "\n" + tomlio.dumps({"amp": self.config})
        train = {
            "model": self.model or None,
            "size": self.size or None,
            "batch_size": self.batch_size or None,
        }
        if any(v is not None for v in train.values()):
            text += (
                "\n# measured on this model, size and batch: the advice is for them\n"
                + tomlio.dumps({"train": train})
            )
        return text


def tune(
    report: BenchReport, tolerance: float = 0.01, prefer: Optional[str] = None
) -> Recommendation:
    """The fastest precision whose final-loss gap to fp32 is within ``tolerance`` (a fraction of the
    fp32 loss) and that had no fallback. fp32 always qualifies (its gap is 0 by definition).

    ``prefer="memory"`` (the default when a bf16-pure rung was measured) picks the fewest bytes per
    parameter instead (weights + masters + optimizer state, measured), ties to the faster step.

    For speed, a candidate whose speed-up over fp32 is within its measured spread
    (:func:`.speed.within_noise`) is not picked: the measurement cannot tell it from fp32, so fp32
    wins (``note`` says so, and the candidate's ``why_not`` gives the figure)."""
    if not tolerance >= 0:
        raise ValueError(
            f"tolerance={tolerance!r} must be >= 0 (a fraction of the fp32 loss, e.g. 0.01)"
        )
    if prefer is None:
        prefer = "memory" if any(":" in r.precision for r in report.results) else "speed"
    if prefer not in ("speed", "memory"):
        raise ValueError(f"prefer={prefer!r} is not a tune objective; choose one of: speed, memory")
    why: dict[str, str] = {}
    ok = []
    for r in report.results:
        if r.status != "ok":
            why[r.precision] = f"could not run here: {r.reason}"
        elif r.fallbacks:
            why[r.precision] = f"fell back to {r.final_precision} during the measurement"
        elif r.loss_gap is None or not math.isfinite(r.loss_gap) or abs(r.loss_gap) > tolerance:
            gap = (
                "non-finite"
                if r.loss_gap is None or not math.isfinite(r.loss_gap)
                else f"{100 * abs(r.loss_gap):.2f}%"
            )
            why[r.precision] = (
                f"final-loss gap to fp32 {gap} exceeds the tolerance {100 * tolerance:g}%"
            )
        else:
            ok.append(r)
    if not ok:
        raise ValueError("no precision qualified, not even fp32; was fp32 measured?")
    note = ""
    if prefer == "memory":
        best = min(
            ok,
            key=lambda r: (
                round(r.bytes_per_param or math.inf, 2),
                r.step_ms,
                r.precision != REFERENCE,
            ),
        )
        for r in ok:
            if r is not best:
                why[r.precision] = _why_more_memory(r, best)
    else:
        noisy = [r for r in ok if r.precision != REFERENCE and _noisy(r)]
        for r in noisy:
            why[r.precision] = (
                f"not clearly faster than fp32: {_speed(r)} ({r.step_ms:.2f} ms/step)"
            )
        clear = [r for r in ok if r not in noisy]
        best = min(clear, key=lambda r: (r.step_ms, r.precision != REFERENCE))
        fastest = min(ok, key=lambda r: (r.step_ms, r.precision != REFERENCE))
        if fastest is not best:
            note = (
                f"{fastest.precision} timed fastest, but at {_speed(fastest)} the measurement "
                f"cannot tell it from fp32, so {best.precision}"
            )
        for r in clear:
            if r is not best:
                why[r.precision] = (
                    f"slower: {r.step_ms:.2f} ms/step vs {best.step_ms:.2f} ms/step for {best.precision}"
                    if r.step_ms > best.step_ms
                    else f"as fast as {best.precision}; ties go to the earlier candidate"
                )
    # "name/size" as the CLI labels it; a bare label from the Python API names no train model.
    model, _, size = (report.model or "").rpartition("/")
    return Recommendation(
        model=model or None,
        size=size or None,
        precision=best.precision,
        step_ms=best.step_ms,
        speedup_vs_fp32=best.speedup_vs_fp32 or 1.0,
        loss_gap=best.loss_gap or 0.0,
        tolerance=tolerance,
        batch_size=report.batch_size,
        accumulation_steps=report.accumulation_steps,
        why_not=why,
        prefer=prefer,
        bytes_per_param=best.bytes_per_param,
        timed=report.timed,
        note=note,
    )


def _speed(r: BenchResult) -> str:
    spread = math.inf if r.speedup_spread is None else r.speedup_spread
    return speed_words(r.speedup_vs_fp32 or 1.0, spread)


def _noisy(r: BenchResult) -> bool:
    """Whether ``r``'s speed-up over fp32 is within its spread (unknown spread: taken as exact)."""
    return (
        r.speedup_vs_fp32 is not None
        and r.speedup_spread is not None
        and within_noise(r.speedup_vs_fp32, r.speedup_spread)
    )


def _why_more_memory(r: BenchResult, best: BenchResult) -> str:
    """Why ``r`` lost to ``best`` on memory: its bytes per parameter (then its time on a tie)."""
    mine, theirs = r.bytes_per_param or math.inf, best.bytes_per_param or math.inf
    if round(mine, 2) > round(theirs, 2):
        return (
            f"more memory: {mine:.2f} B/param vs {theirs:.2f} for {best.precision} "
            f"(gap {100 * (r.loss_gap or 0.0):+.2f}%, {r.step_ms:.2f} ms/step)"
        )
    return (
        f"as small as {best.precision} ({mine:.2f} B/param) but slower: "
        f"{r.step_ms:.2f} vs {best.step_ms:.2f} ms/step"
    )
