"""Numerical diagnosis: a per-module precision audit (what breaks in fp16/bf16 and why).

Which module produced the first inf/NaN is the step's own diagnosis: ``ampkit.step.localize``
(``ampkit.localize_nonfinite``). Both are one-off diagnostics that run extra forward/backward
passes and read values to the host
(they synchronize); they are meant for the first skipped step of a run or for choosing settings
before training, never for the hot path.
"""

from __future__ import annotations

from .audit import SENSITIVE, AuditReport, ModuleAudit, audit

__all__ = ["SENSITIVE", "AuditReport", "ModuleAudit", "audit"]
