"""Moved to :mod:`ampkit.train.trainer_config` (issue 35); this path stays for imports written before."""

from ..train.trainer_config import *  # noqa: F403
