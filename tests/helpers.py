"""Moved to tests/support/helpers.py; this re-export keeps imports from before the move working."""

from .support.helpers import CRASH_MARKERS, SyncCounter, assert_exits_cleanly  # noqa: F401
