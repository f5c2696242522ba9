"""``--config FILE.toml``: merge a settings file under the flags typed on the command line.

The file holds an ``[amp]`` table (:class:`~ampkit.step.config.MixedPrecisionConfig` fields) and a
``[train]`` table whose keys are the command's option names (any spelling, underscores: ``steps``,
``grad_accum_steps``, ``no_fallback``); a ``[train]`` value goes through the same parser as the flag.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..step.aliases import unknown_key_message
from ..step.config import ConfigError, MixedPrecisionConfig, canonical_config_keys, read_toml
from .flags import Switch, Toggle, negated

__all__ = ["FileSettings", "explicit_flags", "read_config_file", "train_keys"]

NOT_FROM_FILE = ("help", "config", "json")  # the file cannot name itself, and --json shapes stdout


@dataclass(frozen=True)
class FileSettings:
    """What a ``--config`` file asked for: its ``[amp]`` table, and the ``[train]`` values by
    destination (parsed as the flags would be)."""

    amp: dict[str, Any] = field(default_factory=dict)
    train: dict[str, Any] = field(default_factory=dict)


def explicit_flags(sub: argparse.ArgumentParser, argv: Sequence[str]) -> frozenset[str]:
    """Destinations of the options actually typed on the command line (to let them win over a file)."""
    by_option = {o: a for a in sub._actions for o in a.option_strings}
    return frozenset(
        by_option[t.split("=", 1)[0]].dest for t in argv if t.split("=", 1)[0] in by_option
    )


def train_keys(sub: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every ``[train]`` key the command accepts: each option's spellings, with underscores."""
    keys: dict[str, argparse.Action] = {}
    for action in sub._actions:
        if action.option_strings and action.dest not in NOT_FROM_FILE:
            for o in action.option_strings:
                keys.setdefault(o.lstrip("-").replace("-", "_"), action)
    return keys


def read_config_file(sub: argparse.ArgumentParser, path: str) -> FileSettings:
    """Read and check ``path``: unknown tables or keys and wrong types are :class:`ConfigError`\\ s
    naming the key; ``[amp]`` is validated as a MixedPrecisionConfig."""
    data = read_toml(path)
    unknown = [k for k in data if k not in ("amp", "train")]
    if unknown:
        raise ConfigError(
            f"config file {path!r}: unknown table(s) {', '.join(map(repr, unknown))}; "
            "expected [amp] and/or [train]"
        )
    amp = data.get("amp", {})
    if not isinstance(amp, dict):
        raise ConfigError(
            f"config file {path!r}: [amp] must be a table of MixedPrecisionConfig fields"
        )
    try:  # aliases (min_loss_scale, dtype, ...) become their fields, once, here
        amp = canonical_config_keys(amp)
    except ConfigError as e:
        raise type(e)(f"config file {path!r}: [amp]: {e}") from None
    MixedPrecisionConfig.from_dict(amp)  # validate now: unknown keys and wrong types name the key
    keys, train = train_keys(sub), {}
    for key, value in data.get("train", {}).items():
        action = keys.get(key)
        if action is None:
            valid = sorted(k for k, a in keys.items() if k == a.dest)
            raise ConfigError(
                f"config file {path!r}: {unknown_key_message([key], valid, '[train] key')}"
            )
        if action.dest in train:
            raise ConfigError(
                f"config file {path!r}: [train] sets {action.dest} twice (as {key!r} too)"
            )
        train[action.dest] = _value(action, key, value, path)
    return FileSettings(amp, train)


def _value(action: argparse.Action, key: str, value: Any, path: str) -> Any:
    """``value`` as the flag would have parsed it."""
    where = f"config file {path!r}: [train] {key} = {value!r}"
    if action.nargs == 0 or (isinstance(action, Toggle) and isinstance(value, bool)):
        if not isinstance(value, bool):
            raise ConfigError(f"{where} must be true or false")
        if isinstance(action, Switch):
            return value != negated(key)
        if isinstance(action, Toggle) or action.const is True:
            return value
        return action.const if value else action.default  # no_fallback = true: fallback off
    if action.type is not None:
        try:
            if isinstance(value, bool):
                raise ValueError
            value = action.type(str(value))
        except (ValueError, TypeError, argparse.ArgumentTypeError):
            raise ConfigError(
                f"{where} is not a valid {getattr(action.type, '__name__', 'value').strip('_')}"
            ) from None
    elif not isinstance(value, str):
        raise ConfigError(f"{where} must be a string")
    if action.choices is not None and value not in action.choices:
        raise ConfigError(f"{where}; choose one of {list(action.choices)}")
    return value


# Options that are not settings of the run: the file itself, the output's shape, this very request.
_NOT_PRINTED = ("command", "func", "amp_opt_level", "print_config", *NOT_FROM_FILE)


def resolved_toml(inv: Any) -> str:
    """``ampkit train --print_config``: the run's resolved settings as TOML -- ``[amp]``, the engine's
    whole config (flags, the file's ``[amp]``, train's defaults, ``--amp_opt_level`` folded into
    ``precision``) and ``[train]``, every other option's value (None left out). ``--config`` reads
    it back to the same settings."""
    from ..step import tomlio
    from .flags import ENGINE_FIELDS, engine_config

    notes: list[str] = []
    config = engine_config(inv.args, inv.flags_given, inv.file.amp, notes)
    train = {
        k: v for k, v in sorted(vars(inv.args).items()) if k not in (*_NOT_PRINTED, *ENGINE_FIELDS)
    }
    head = [
        "# ampkit train --print_config: the resolved settings; `ampkit train --config FILE` reads them back"
    ]
    head += [f"# note: {n}" for n in notes]
    return "\n".join(head) + "\n" + tomlio.dumps({"amp": config.to_dict(), "train": train})
