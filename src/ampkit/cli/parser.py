"""argparse as the ``ampkit`` command uses it: no abbreviations, and every usage error one line.

argparse answers a mistyped flag with the usage and ``unrecognized arguments``, and a bad value
with the sub-command's whole usage (dozens of lines). Here each is one line naming the command,
and a flag that does not exist gets the closest one that does::

    ampkit train: unknown flag '--precison' (did you mean '--precision'?)

A value that starts with ``-`` and a digit (``--memory_budget -1GiB``, ``--lr -1e-3``) is taken
as that flag's value, so that the flag's own check says what is wrong with it (argparse alone
takes ``-1GiB`` for an option and answers ``expected one argument``).
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn, Optional

__all__ = ["CommandParser", "TopParser", "unknown_argument_line"]

_HELP = "--help lists the flags"
_NEGATIVE = re.compile(r"-\.?[0-9]")  # -1GiB, -5m, -1e-3, -.5: a value, never one of our flags


class CommandParser(argparse.ArgumentParser):
    """A sub-command's parser: no abbreviations (``--prec`` must not quietly mean ``--precision``),
    errors on one line."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {_closest_choice(message)}\n")


class TopParser(argparse.ArgumentParser):
    """The ``ampkit`` parser: a flag the command does not know is one line with its closest flag."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)
        self.commands: dict[str, argparse.ArgumentParser] = {}

    def add_commands(self, **kwargs: Any) -> Any:
        """``add_subparsers`` whose parsers are :class:`CommandParser`\\ s, remembered by name."""
        sub = self.add_subparsers(parser_class=CommandParser, **kwargs)
        self.commands = sub.choices
        return sub

    def parse_args(
        self,
        args: Optional[Sequence[str]] = None,  # type: ignore[override]
        namespace: Optional[argparse.Namespace] = None,
    ) -> argparse.Namespace:
        words = sys.argv[1:] if args is None else list(args)
        ns, extras = self.parse_known_args(self._negatives_joined(words), namespace)
        if extras:
            command = getattr(ns, "command", None)
            parser = self.commands.get(command) if command else None
            who = f"ampkit {command}" if parser else "ampkit"
            self.exit(2, unknown_argument_line(who, extras, parser or self) + "\n")
        return ns

    def _negatives_joined(self, words: Sequence[str]) -> list[str]:
        """``words`` with ``--flag -1GiB`` written ``--flag=-1GiB`` where ``--flag`` (of any command)
        takes a value; nothing after ``--`` is touched (``ampkit slurm ... -- TRAIN_FLAGS``)."""
        takes_value = {
            s
            for parser in (self, *self.commands.values())
            for a in parser._actions  # argparse has no public list of its actions
            if a.nargs != 0
            for s in a.option_strings
        }
        out: list[str] = []
        i = 0
        while i < len(words):
            word = words[i]
            if word == "--":
                return out + list(words[i:])
            if word in takes_value and i + 1 < len(words) and _NEGATIVE.match(words[i + 1]):
                out.append(f"{word}={words[i + 1]}")
                i += 2
            else:
                out.append(word)
                i += 1
        return out

    def error(self, message: str) -> NoReturn:
        if "invalid choice:" in message and "argument COMMAND" in message:
            word = message.split("invalid choice: ", 1)[1].split(" ", 1)[0].strip("'")
            close = difflib.get_close_matches(word, list(self.commands), n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            self.exit(
                2,
                f"ampkit: unknown command {word!r}{hint}; choose one of: {', '.join(self.commands)}\n",
            )
        self.exit(2, f"ampkit: error: {message}\n")


def _closest_choice(message: str) -> str:
    """argparse's ``invalid choice: 'tinny' (choose from ...)`` with the closest choice named."""
    if "invalid choice: " not in message or " (choose from " not in message:
        return message
    head, _, rest = message.partition("invalid choice: ")
    typed, _, choices = rest.partition(" (choose from ")
    names = [c.strip().strip("'\"") for c in choices.rstrip(")").split(",")]
    close = difflib.get_close_matches(typed.strip("'\""), names, n=1, cutoff=0.6)
    if not close:
        return message
    listed = choices[:-1] if choices.endswith(")") else choices
    return f"{head}invalid choice: {typed} (did you mean {close[0]!r}?); choose from {listed}"


def unknown_argument_line(who: str, extras: Sequence[str], parser: argparse.ArgumentParser) -> str:
    """``ampkit train: unknown flag '--precison' (did you mean '--precision'?)``, for the first of
    ``extras`` (what ``parser`` did not recognise) that looks like a flag, else the first."""
    flags = [x for x in extras if x.startswith("-") and len(x) > 1]
    if not flags:
        owner = _flag_of_value(extras[0], parser)
        hint = f"did you mean '{owner} {extras[0]}'?" if owner else f"{who} {_HELP}"
        return f"{who}: unexpected argument {extras[0]!r} ({hint})"
    typed = flags[0].split("=", 1)[0]
    # every long spelling the parser knows (argparse has no public list of its actions)
    known = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    close = difflib.get_close_matches(typed, known, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else f" ({who} {_HELP})"
    return f"{who}: unknown flag {typed!r}{hint}"


def _flag_of_value(word: str, parser: argparse.ArgumentParser) -> Optional[str]:
    """The flag of ``parser`` that ``word`` (typed without it) is a value of: a precision, a list
    of them, or a built-in model; None when it is none of these or the parser has no such flag."""
    from ..models.builtin import MODELS
    from ..step.rung import spec_list

    known = {s for a in parser._actions for s in a.option_strings}
    if word in MODELS and "--model" in known:
        return "--model"
    try:
        several = len(spec_list(word)) > 1
    except ValueError:  # PrecisionError and RungError are ValueErrors: not precisions
        return None
    for name in ("--precisions", "--precision") if several else ("--precision", "--precisions"):
        if name in known:
            return name
    return None
