"""Levers a plan answers for without measuring them: the optimizer stepped in backward.

With the optimizer in backward each parameter is stepped as soon as its gradient is final and the
gradient is freed, so no full set of gradients is ever held: at any moment the step holds at most
about one parameter's gradient (the largest's, to be safe) where the ordinary step holds every
gradient made so far. :func:`in_backward` turns a measured step
(:class:`~ampkit.plan.session.Measure`) into that step's memory by this rule, operation by
operation: the live bytes after each operation less the gradients held then, plus the smaller of
those and the largest parameter's gradient. Everything else -- weights, masters, optimizer state,
activations, the optimizer's own transients -- is kept as measured (its transients were measured
for every parameter at once, an upper bound for one parameter at a time). The step's peak and its
parts follow; the depth extrapolation (:class:`~ampkit.plan.depth.DepthFit`) then works on these
measures as on any other.
"""

from __future__ import annotations

from .session import Measure

__all__ = ["in_backward"]


def in_backward(m: Measure) -> Measure:
    """``m`` with the optimizer in backward (the module's rule). A measure without a gradient timeline
    (one from an older plan cache) raises ``ValueError``."""
    if len(m.grads) != len(m.timeline):
        raise ValueError(
            "this measure has no gradient timeline to plan the optimizer in backward from"
        )
    keep = m.largest_grad
    timeline = tuple(t - g + min(g, keep) for t, g in zip(m.timeline, m.grads))
    parts = dict(m.parts)
    parts["gradients"] = min(parts["gradients"], keep)
    floor = sum(v for k, v in parts.items() if k != "temporaries")
    peak = max(max(timeline, default=0), floor)
    parts["temporaries"] = peak - floor
    return Measure(
        m.precision,
        peak,
        parts,
        dict(m.by_dtype),
        timeline,
        m.phases,
        tuple(min(g, keep) for g in m.grads),
        keep,
    )
