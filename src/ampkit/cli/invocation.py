"""One command as the user asked for it, passed to the command as one typed object (not as
private attributes on argparse's Namespace)."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Optional

from ..step.config import MixedPrecisionConfig
from .config_file import FileSettings, explicit_flags, read_config_file

__all__ = ["Invocation", "TrainInvocation", "parse_invocation", "subparser"]


@dataclass(frozen=True)
class Invocation:
    """A parsed command line.

    ``args`` holds every option's value: typed on the command line, else from the ``--config``
    file's ``[train]`` table, else the option's default. ``argv`` is the words as typed (the resume
    hint and torchrun's relaunch repeat them). Treat ``args`` as read-only.
    """

    args: argparse.Namespace
    argv: tuple[str, ...] = ()
    explicit: frozenset[str] = frozenset()  # destinations of the options typed on the command line
    file: FileSettings = field(
        default_factory=FileSettings
    )  # the --config file's [amp] and [train]

    @property
    def command(self) -> str:
        return str(self.args.command)

    @property
    def flags_given(self) -> frozenset[str]:
        """Options the user set, on the command line or in ``[train]`` (as opposed to defaults)."""
        return self.explicit | frozenset(self.file.train)

    @property
    def given(self) -> frozenset[str]:
        """Settings the user chose anywhere (flags, ``[train]``, ``[amp]``): on ``--resume`` these are
        compared with the checkpoint's."""
        opt_level = {"precision"} if getattr(self.args, "amp_opt_level", None) else set()
        return self.flags_given | frozenset(self.file.amp) | opt_level


@dataclass(frozen=True)
class TrainInvocation:
    """``ampkit train`` once its settings are resolved: the flags (``batch_size`` and
    ``accumulation_steps`` as chosen by ``--batch_size auto`` / ``--target_effective_batch_size``),
    the engine's config, what the user chose, and why the batch is what it is."""

    args: argparse.Namespace
    argv: tuple[str, ...]
    config: MixedPrecisionConfig
    given: frozenset[str]
    batch_reason: Optional[str] = None


def subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def parse_invocation(
    parser: argparse.ArgumentParser, args: argparse.Namespace, argv: Sequence[str]
) -> Invocation:
    """``args`` (parsed from ``argv``) with its ``--config`` file read and merged under the typed flags."""
    sub = subparser(parser, args.command)
    explicit = explicit_flags(sub, argv)
    config = getattr(args, "config", None)
    file = read_config_file(sub, config) if config else FileSettings()
    merged = {**vars(args), **{k: v for k, v in file.train.items() if k not in explicit}}
    return Invocation(argparse.Namespace(**merged), tuple(argv), explicit, file)
