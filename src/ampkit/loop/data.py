"""Moved to :mod:`ampkit.models.data` (issue 35); this path stays for imports written before."""

from ..models.data import *  # noqa: F403
