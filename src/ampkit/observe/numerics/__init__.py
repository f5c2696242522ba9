"""Numerical diagnosis: which module produced the first inf/NaN, and a per-module precision audit.

Both are one-off diagnostics that run extra forward/backward passes and read values to the host
(they synchronize); they are meant for the first skipped step of a run or for choosing settings
before training, never for the hot path.
"""

from __future__ import annotations

# The localizer is the step's own diagnosis (fallback events, amp.diagnose): its home is step/.
from ...step.localize import NonFiniteReport, localize_nonfinite
from .audit import SENSITIVE, AuditReport, ModuleAudit, audit

__all__ = ["SENSITIVE", "AuditReport", "ModuleAudit", "NonFiniteReport", "audit", "localize_nonfinite"]
