"""Moved to tests/support/unstable_model.py; this re-export keeps imports from before the move working."""

from .support.unstable_model import Unstable, data, train_unstable  # noqa: F401
