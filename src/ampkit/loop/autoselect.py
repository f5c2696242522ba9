"""Moved to :mod:`ampkit.choose.autoselect` (issue 35); this path stays for imports written before."""

from ..choose.autoselect import *  # noqa: F403
