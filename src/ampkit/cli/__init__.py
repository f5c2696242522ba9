"""The ``ampkit`` command: one module per command (info, train, audit, bench/tune, report).

Every ``--flag_name`` also answers to ``--flag-name``; abbreviations are off, so a typo or a
prefix never silently picks a flag. The CLI only composes: it parses, builds the pieces (model,
data, engine, trainer) and prints; no feature lives only here.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Optional

from .. import __version__
from ..distributed.env import exit_worker, launched, leave, rank
from ..loop.checkpoint import CheckpointError
from ..step.config import ConfigError
from ..step.fallback import NumericsError
from ..step.precision import PrecisionError
from ..train.stop import TrainingInterrupted
from . import audit, bench, explain, export, info, plan, report, serve, slurm, train
from .interrupts import PeerFailed
from .invocation import parse_invocation
from .parser import TopParser

__all__ = ["COMMANDS", "build_parser", "main"]

COMMANDS = (
    info,
    train,
    audit,
    bench,
    plan,
    explain,
    report,
    slurm,
    export,
    serve,
)  # each adds its parser(s)


def build_parser() -> TopParser:
    """Every command's parser; usage errors are one line (:mod:`ampkit.cli.parser`)."""
    parser = TopParser(
        prog="ampkit", description="Mixed-precision training for PyTorch: fast, safe and visible."
    )
    parser.add_argument("--version", action="version", version=f"ampkit {__version__}")
    sub = parser.add_commands(dest="command", metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    raw = list(sys.argv[1:] if argv is None else argv)
    if not launched():
        return _run(parser, args, raw)[0]
    # One of several processes (torchrun): leave the job so that no rank waits for one that failed.
    try:
        code, stopped_together = _run(parser, args, raw)
    except BaseException:
        leave(1, together=False)
        raise
    leave(code, together=code == 0 or stopped_together)
    exit_worker(
        code
    )  # not through the interpreter's teardown: a gloo thread may still hold tensors


def _run(
    parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]
) -> tuple[int, bool]:
    """``(exit status, whether every rank stopped together after the same step)``."""
    return _status(args.command, lambda: args.func(parse_invocation(parser, args, argv)))


def _status(command: str, run: Callable[[], Optional[int]]) -> tuple[int, bool]:
    # torchrun's RANK: the process group (rank()) does not exist yet when the label is made
    who = f"ampkit {command}" + (f" (rank {os.environ.get('RANK', rank())})" if launched() else "")
    try:
        with _own_warnings(who):
            return int(run() or 0), False
    except PeerFailed as e:  # another rank failed and said why; only it prints
        return e.code, False
    except NumericsError as e:
        print(f"{who}: training failed numerically: {e}", file=sys.stderr)
        return 3, False
    except (
        PrecisionError,
        ConfigError,
        ValueError,
        FileNotFoundError,
        ImportError,
        CheckpointError,
    ) as e:
        print(f"{who}: error: {e}", file=sys.stderr)
        return 2, False
    except OSError as e:  # a filesystem fault during the run (full disk, vanished directory, ...)
        where = f": {e.filename!r}" if getattr(e, "filename", None) else ""
        print(f"{who}: error: {e.strerror or e}{where}", file=sys.stderr)
        return 2, False
    except (
        TrainingInterrupted
    ) as e:  # a graceful stop: the trainer checkpointed and said how to resume
        return e.exit_code, True  # every rank stopped after the same step
    except KeyboardInterrupt as e:  # before training started (or a command without a graceful stop)
        code = getattr(e, "exit_code", 130)
        print(
            f"{who}: interrupted ({'SIGTERM' if code == 143 else 'SIGINT'})"
            + (" before training started; nothing to save" if command == "train" else ""),
            file=sys.stderr,
        )
        return code, False


@contextlib.contextmanager
def _own_warnings(who: str) -> Iterator[None]:
    """ampkit's own warnings (a damaged checkpoint skipped, an unverified one loaded) as one line
    naming the command; other libraries' keep Python's form."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
    shown = warnings.showwarning

    def show(message: Any, category: Any, filename: str, lineno: int, *rest: Any) -> None:
        if os.path.abspath(filename).startswith(package):
            print(f"{who}: warning: {message}", file=sys.stderr, flush=True)
        else:
            shown(message, category, filename, lineno, *rest)

    warnings.showwarning = show
    try:
        yield
    finally:
        warnings.showwarning = shown


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
