"""Moved to tests/support/dist_helpers.py; this re-export keeps imports from before the move working."""

from .support.dist_helpers import free_port, run_ranks  # noqa: F401
