"""Moved to :mod:`ampkit.models.builtin` (issue 35); this path stays for imports written before."""

from ..models.builtin import *  # noqa: F403
from ..models.builtin import config_of  # noqa: F401
