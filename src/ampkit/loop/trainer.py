"""Moved to :mod:`ampkit.train.trainer` (issue 35); this path stays for imports written before."""

from ..train.trainer import *  # noqa: F403
