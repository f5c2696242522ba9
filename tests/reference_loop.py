"""Moved to tests/support/reference_loop.py; this re-export keeps imports from before the move working."""

from .support.reference_loop import DTYPES, call_model, torch_amp_loop  # noqa: F401
