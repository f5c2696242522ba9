"""Ending a command on a signal outside the training loop, and ranks that fail together.

``Trainer.fit`` stops gracefully on SIGINT/SIGTERM (:mod:`ampkit.train.stop`); before and after
it, :func:`sigterm_interrupts` makes SIGTERM end ``ampkit train`` like Ctrl-C does -- a message
and status 143 -- instead of a silent kill. :class:`PeerFailed` lets a rank exit quietly when
another rank failed a check they all depend on and already said why.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from typing import Any

__all__ = ["PeerFailed", "Terminated", "sigterm_interrupts"]


class PeerFailed(Exception):
    """Another rank failed a check every rank depends on and reported it; this rank exits quietly."""

    def __init__(self, code: int = 2) -> None:
        super().__init__("another rank failed")
        self.code = code


class Terminated(KeyboardInterrupt):
    exit_code = 143


@contextlib.contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """Outside ``Trainer.fit`` (which stops gracefully), SIGTERM ends the command like Ctrl-C does,
    with a message and exit status 143, instead of killing it silently."""

    def handler(signum: int, frame: Any) -> None:
        raise Terminated()

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
