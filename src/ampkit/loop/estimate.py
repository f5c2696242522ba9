"""Moved to :mod:`ampkit.plan.estimate` (issue 35); this path stays for imports written before."""

from ..plan.estimate import *  # noqa: F403
