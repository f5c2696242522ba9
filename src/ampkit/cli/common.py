"""What several commands share: flag spellings, value parsers, the model and data, a wide console."""

from __future__ import annotations

import argparse
from typing import Any

import torch

__all__ = ["flag", "model_and_data", "positive_float", "positive_int", "wide_console"]


def flag(parser: argparse.ArgumentParser, name: str, *aliases: str, **kwargs: Any) -> None:
    """Add ``--name`` with its hyphen spelling (and any aliases) as one option."""
    spellings = [f"--{name}"]
    for n in (name, *aliases):
        for s in (f"--{n}", f"--{n.replace('_', '-')}"):
            if s not in spellings:
                spellings.append(s)
    parser.add_argument(*spellings, dest=name, **kwargs)


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be >= 1")
    return v


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{v} must be > 0")
    return v


def model_and_data(args: argparse.Namespace, device: torch.device) -> tuple[torch.nn.Module, Any]:
    """A built-in model with its local data, or a user's ``module:factory``."""
    from ..loop.models import MODELS, builtin, user_model

    if args.model not in MODELS:
        return user_model(args.model, batch_size=args.batch_size, seed=args.seed, size=args.size, device=device)
    return builtin(args.model, args.size, batch_size=args.batch_size, seed=args.seed, device=device)


def wide_console() -> Any:
    """Wide tables stay readable when stdout is not a terminal (rich would fall back to 80 columns)."""
    from rich.console import Console

    c = Console()
    return c if c.is_terminal else Console(width=160)
