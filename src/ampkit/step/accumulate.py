"""Gradient-accumulation window bookkeeping: how many micro-steps, what the loss is divided by.

A window normally holds ``accumulation_steps`` micro-steps and each loss is divided by that
number, so the gradients are the mean over the window -- exactly what a hand-written loop does
with ``loss / accum``. Two ways to end a window early (the last, short window of an epoch):

* ``set_size(k)`` before the window's first backward: the next window holds ``k`` micro-steps
  and each loss is divided by ``k`` (timm's ``last_accum_steps``; bitwise the hand-written loop).
* ``step(flush=True)`` when the window turns out short: the sum so far, divided by the full size,
  is multiplied by ``size / k`` -- the mean over the ``k`` micro-steps, up to rounding.
"""

from __future__ import annotations

from typing import Optional

__all__ = ["Window"]


class Window:
    """Counts micro-steps of the current accumulation window (host ints only: no sync)."""

    __slots__ = ("size", "micro", "_current")

    def __init__(self, size: int) -> None:
        self.size = size
        self.micro = 0
        self._current = size

    @property
    def current_size(self) -> int:
        """Micro-steps in the window being filled (``size``, or a one-off ``set_size``)."""
        return self._current

    @property
    def divisor(self) -> int:
        """What each loss of this window is divided by."""
        return self._current

    @property
    def complete(self) -> bool:
        return self.micro >= self._current

    def set_size(self, k: int) -> None:
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= self.size:
            raise ValueError(
                f"window size {k!r} must be an integer in 1..accumulation_steps ({self.size})"
            )
        if self.micro:
            raise RuntimeError(
                f"set_window({k}) called inside a window ({self.micro} micro-step(s) done with "
                f"divisor {self._current}); call it before the window's first backward()"
            )
        self._current = k

    def add_micro(self) -> None:
        """Record one backward(); raises when the window is already full."""
        if self.micro >= self._current:
            raise RuntimeError(
                f"backward() called {self.micro + 1} times in a window of {self._current} micro-step(s) "
                f"(accumulation_steps={self.size}) without step(): the extra gradients would be summed into one "
                "optimizer step. Call amp.step(optimizer) after every backward() (it steps at the boundary), "
                "or once after exactly accumulation_steps backward() calls"
            )
        self.micro += 1

    def flush_factor(self) -> Optional[float]:
        """Multiplier that turns a short window's gradients into the mean over its micro-steps."""
        return None if self.micro == self._current else self._current / self.micro

    def reset(self) -> None:
        self.micro = 0
        self._current = self.size
