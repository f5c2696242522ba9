"""Moved to :mod:`ampkit.plan.tracker` (issue 35); this path stays for imports written before."""

from ..plan.tracker import *  # noqa: F403
