"""Graceful stops: SIGINT (Ctrl-C) and SIGTERM (``kill PID``, Slurm, Kubernetes) end a run after
the optimizer step in flight, with a checkpoint of that step, instead of killing it mid-step.

:class:`GracefulStop` is a context manager the :class:`~ampkit.train.trainer.Trainer` enters for
the length of ``fit``: it installs handlers for SIGINT and SIGTERM (in the main thread only;
elsewhere it installs nothing) and puts the previous handlers back on exit, so a user's own
handlers are untouched outside training. A handler only records the signal -- it never raises,
so it cannot interrupt a checkpoint being written; a second signal while the stop is under way
is reported and otherwise ignored (``kill -9`` still ends the process at once, and the atomic
checkpoint writes leave the previous checkpoint intact).

The loop calls :meth:`GracefulStop.poll` once per optimizer step. With several processes the
ranks must stop after the *same* step (a sharded checkpoint is a collective), but each rank may
receive its signal during a different step; ``poll`` therefore all-reduces the signal number
(max) over the ranks every step -- a 4-byte collective issued without waiting -- and decides on
the previous step's result: all ranks stop one step after the signal, and the agreement never
stalls a step (on CUDA the result comes back through a non-blocking copy: no host sync).

After the stop the loop raises :class:`TrainingInterrupted` (a ``KeyboardInterrupt`` and a
``SystemExit`` with code 130/143), so user code that already handles Ctrl-C handles a SIGTERM
stop alike, ``except Exception`` does not swallow it, and a script that does not catch it exits
with the status a shell expects.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from types import FrameType
from typing import Any, Optional

import torch

__all__ = ["STOP_SIGNALS", "GracefulStop", "TrainingInterrupted"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class TrainingInterrupted(KeyboardInterrupt, SystemExit):
    """Training stopped on a signal after a completed optimizer step.

    A ``KeyboardInterrupt`` -- code that handles Ctrl-C handles a SIGTERM stop alike, and
    ``except Exception`` does not swallow it -- and a ``SystemExit`` whose ``code`` is the
    conventional status, so a script that does not catch it exits 130 (SIGINT) or 143 (SIGTERM)
    without a traceback (the trainer has printed what happened and how to resume).

    Attributes:
        signal: the signal number (``signal.SIGINT`` or ``signal.SIGTERM``).
        step: the optimizer step the run stopped after (the checkpoint's step).
        checkpoint: the checkpoint written for that step, or None without a checkpoint directory.
        exit_code: ``128 + signal`` (also ``code``).
    """

    def __init__(self, signum: int, step: int, checkpoint: Optional[str]) -> None:
        where = (
            f"checkpoint {checkpoint} written"
            if checkpoint
            else "no checkpoint directory was given, so nothing was saved"
        )
        super().__init__(f"stopped by {signal_name(signum)} after optimizer step {step}; {where}")
        self.signal, self.step, self.checkpoint = int(signum), int(step), checkpoint
        self.exit_code = self.code = 128 + int(signum)


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class GracefulStop:
    """Record SIGINT/SIGTERM while training; see the module doc. Re-entrant use is not supported."""

    def __init__(self, *, announce: bool = True) -> None:
        self.announce = announce
        self.signum: Optional[int] = None  # the first signal received (this process)
        self._previous: dict[int, Any] = {}
        self._pending: Optional[tuple[torch.Tensor, Any]] = (
            None  # CUDA: the last step's reduced flag
        )

    # ------------------------------------------------------------------ handlers
    def __enter__(self) -> GracefulStop:
        if threading.current_thread() is threading.main_thread():
            for sig in STOP_SIGNALS:
                with contextlib.suppress(
                    ValueError, OSError
                ):  # not allowed here (e.g. embedded Python)
                    self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, old in self._previous.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.signum is None:
            self.signum = signum
            if self.announce:
                print(
                    f"ampkit: {signal_name(signum)} received: finishing the optimizer step in flight, then "
                    "writing a checkpoint and stopping",
                    file=sys.stderr,
                    flush=True,
                )
        elif self.announce:
            print(
                f"ampkit: {signal_name(signum)} received again: already stopping (the checkpoint is being "
                "finished; kill -9 ends the process at once, the previous checkpoint stays intact)",
                file=sys.stderr,
                flush=True,
            )

    def request(self, signum: int = signal.SIGTERM) -> None:
        """Ask for a stop as if ``signum`` had arrived (e.g. from a callback)."""
        if self.signum is None:
            self.signum = int(signum)

    # ------------------------------------------------------------------ agreement
    def poll(self, device: torch.device) -> Optional[int]:
        """The signal to stop on after this step, the same on every rank; None to go on.

        One process: the recorded signal. Several: this step's flag is all-reduced (max) without
        waiting, and the decision is taken on the *previous* step's result, long arrived by now --
        every rank reads the same value, so all stop after the same step (one step after the
        signal) and the agreement never stalls a step. A collective: call it on every rank after
        every optimizer step."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
            return self.signum
        flag = torch.full((1,), float(self.signum or 0), device=device)
        if device.type == "cuda":
            dist.all_reduce(
                flag, op=dist.ReduceOp.MAX
            )  # ordered on the stream; the host does not wait
            host = flag.to("cpu", non_blocking=True)  # pinned: a real asynchronous copy
            done: Any = torch.cuda.Event()
            done.record()
            current: tuple[torch.Tensor, Any] = (host, done)
        else:
            current = (flag, dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True))
        previous, self._pending = self._pending, current
        if previous is None:
            return None
        value, pending = previous
        _finish(pending)  # issued a step ago: done by now
        return int(value.item()) or None

    def drain(self) -> None:
        """Wait for the last flag's collective (after the final step, before leaving ``fit``)."""
        if self._pending is not None:
            _finish(self._pending[1])
            self._pending = None


def _finish(pending: Any) -> None:
    """Wait for a CUDA event (the flag's copy) or a collective's work handle."""
    if isinstance(pending, torch.cuda.Event):
        pending.synchronize()
    else:
        pending.wait()
