"""ampkit's messages through Python's ``logging``, on the logger ``"ampkit"``.

What is logged: the precision chosen and why (``DEBUG``, when an engine is built), fallbacks and
the other notable events (``INFO``), and with ``DEBUG`` every skipped step and every change of the
loss scale. Nothing is logged, and nothing costs, unless the logger is enabled for ``INFO`` (or
``DEBUG``) *when the engine is built*: only then does the engine get a subscriber. Reading a
step's skip and scale syncs with the device, so the per-step lines (``DEBUG``) are for debugging.

``enable_debug()`` is what ``ampkit train --debug`` does: a stderr handler at ``DEBUG`` on the
``"ampkit"`` logger and autograd's anomaly mode.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from collections.abc import Iterator
from typing import Any, Optional, TextIO

import torch

__all__ = ["LOGGER_NAME", "enable_debug", "logger", "quiet_imports", "watch"]

LOGGER_NAME = "ampkit"
logger = logging.getLogger(LOGGER_NAME)


#: loggers whose import-time lines concern nothing ampkit does: on a CPU build of torch torchao logs
#: "Failed to load ... .so" for each CUDA kernel library; torch's pytree a deprecation of torchao's enums
NOISY_IMPORTS = ("torchao", "torch.utils._pytree")


@contextlib.contextmanager
def quiet_imports(names: tuple[str, ...] = NOISY_IMPORTS) -> Iterator[None]:
    """Inside: the records of the loggers ``names`` go to ampkit's logger at ``DEBUG`` instead of the
    user's terminal (torchao is imported by ampkit's fp8 and by transformers' quantizers)."""

    class _ToDebug(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            logger.debug("while importing (%s): %s", record.name, record.getMessage())
            return False

    quiet, loggers = _ToDebug(), [logging.getLogger(n) for n in names]
    for lg in loggers:
        lg.addFilter(quiet)
    try:
        yield
    finally:
        for lg in loggers:
            lg.removeFilter(quiet)


def watch(amp: Any) -> None:
    """Log ``amp``'s precision choice, and subscribe to its events when the logger is enabled."""
    if not logger.isEnabledFor(logging.INFO):
        return
    p = amp.precision
    logger.debug("precision %s on %s (asked for %s): %s", p.name, amp.device, p.requested, p.reason)
    amp.subscribe(_EventLog(amp))


class _EventLog:
    """Turns engine events into log lines; per-step lines only at DEBUG (they sync)."""

    def __init__(self, amp: Any) -> None:
        self.amp = amp

    def __call__(self, event: Any) -> None:
        if event.kind != "step":
            level = (
                logging.INFO
                if event.kind
                in ("fallback", "fallback_exhausted", "scale_exhausted", "memory_efficient")
                else logging.DEBUG
            )
            logger.log(level, "step %d: %s %s", event.step, event.kind, event.data)
            return
        if not logger.isEnabledFor(logging.DEBUG):
            return
        result = event.data["result"]
        before = None if result.scale is None else float(result.scale.item())
        if result.found_inf is not None and result.found_inf.item() > 0:
            logger.debug(
                "step %d skipped: non-finite gradients (loss scale %s)", event.step, before
            )
        if before is not None and self.amp.precision.needs_scaler:
            after = self.amp.scaler.get_scale()
            if after != before:
                logger.debug("step %d: loss scale %g -> %g", event.step, before, after)


def enable_debug(
    stream: Optional[TextIO] = None, anomaly: bool = True, check_nan: bool = True
) -> logging.Handler:
    """``DEBUG`` lines from the ``"ampkit"`` logger to ``stream`` (stderr), and (``anomaly``)
    ``torch.autograd.set_detect_anomaly(True, check_nan=check_nan)``: a backward error names the
    forward op that made it. ``check_nan=False`` for loss-scaled precisions, whose overflows are
    expected and handled (skipped steps), not errors. Returns the handler added."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    if anomaly:
        torch.autograd.set_detect_anomaly(True, check_nan=check_nan)
    return handler
