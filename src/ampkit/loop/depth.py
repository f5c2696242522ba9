"""Moved to :mod:`ampkit.plan.depth` (issue 35); this path stays for imports written before."""

from ..plan.depth import *  # noqa: F403
