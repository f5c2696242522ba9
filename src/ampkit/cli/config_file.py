"""``--config FILE.toml``: merge a settings file under the flags typed on the command line."""

from __future__ import annotations

import argparse

from ..step.config import ConfigError, MixedPrecisionConfig, read_toml

__all__ = ["apply_config_file", "explicit_flags"]


def explicit_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> set[str]:
    """Destinations of the options actually typed on the command line (to let them win over a file)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
    by_option = {o: a for a in sub._actions for o in a.option_strings}
    return {by_option[t.split("=", 1)[0]].dest for t in argv if t.split("=", 1)[0] in by_option}


def apply_config_file(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> None:
    """Merge ``--config FILE.toml`` into ``args``: ``[train]`` keys fill flags not given on the
    command line; ``[amp]`` goes to MixedPrecisionConfig. Unknown keys and wrong types are errors."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
    explicit = args._explicit
    data = read_toml(args.config)
    unknown = [k for k in data if k not in ("amp", "train")]
    if unknown:
        raise ConfigError(f"config file {args.config!r}: unknown table(s) {', '.join(map(repr, unknown))}; "
                          "expected [amp] and/or [train]")
    amp = data.get("amp", {})
    MixedPrecisionConfig.from_dict(amp)  # validate now: unknown keys and wrong types name the key
    dests = {a.dest: a for a in sub._actions if a.option_strings and a.dest not in ("help", "config", "json")}
    for key, value in data.get("train", {}).items():
        action = dests.get(key)
        if action is None:
            raise ConfigError(f"config file {args.config!r}: unknown [train] key {key!r}; valid keys: "
                              f"{', '.join(sorted(dests))}")
        if isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                raise ConfigError(f"config file {args.config!r}: [train] {key} = {value!r} must be true or false")
        elif action.type is not None:
            try:
                if isinstance(value, bool):
                    raise ValueError
                value = action.type(str(value))
            except (ValueError, TypeError, argparse.ArgumentTypeError):
                raise ConfigError(f"config file {args.config!r}: [train] {key} = {value!r} is not a valid "
                                  f"{getattr(action.type, '__name__', 'value').strip('_')}") from None
        elif not isinstance(value, str):
            raise ConfigError(f"config file {args.config!r}: [train] {key} = {value!r} must be a string")
        if action.choices is not None and value not in action.choices:
            raise ConfigError(f"config file {args.config!r}: [train] {key} = {value!r}; choose one of {list(action.choices)}")
        if action.dest not in explicit:
            setattr(args, action.dest, value)
    args._file_amp = amp
    args._file_train = set(data.get("train", {}))
