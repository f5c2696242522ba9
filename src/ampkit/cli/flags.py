"""Flags defined once: the model group several commands share, and ``ampkit train``'s engine
flags, generated from :class:`~ampkit.step.config.MixedPrecisionConfig`'s fields.

Each engine flag is spelled like its field (``--init_scale``), takes its type, help and default
from the field, and keeps the older spellings users type in :data:`ALIASES`. Where ``ampkit
train`` wants another default than the library, :data:`TRAIN_DEFAULTS` says so and why; both
are printed in ``ampkit train --help``. The precedence is: the command line, then the ``--config``
file's ``[train]`` table, then its ``[amp]`` table, then :data:`TRAIN_DEFAULTS`, then the field.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any, Optional

from ..models.builtin import MODELS, SIZES
from ..step.aliases import FLAG_ALIASES, KEY_ALIASES
from ..step.config import FieldInfo, MixedPrecisionConfig, canonical_precision, fields_help
from ..step.precision import (
    CANONICAL,
    OPT_LEVELS,
    REFERENCE,
    PrecisionError,
    opt_level_form,
)
from ..step.rung import join_spec, spec_list, split_spec
from .common import data_flags, flag, positive_float, positive_int

__all__ = [
    "ALIASES",
    "ENGINE_FIELDS",
    "SIZE_CHOICES",
    "TRAIN_DEFAULTS",
    "Switch",
    "Toggle",
    "add_engine_flags",
    "debug_flags",
    "engine_config",
    "model_flags",
    "precision_help",
    "precision_list",
    "with_opt_level",
]

# Older spellings of engine fields, from the tools users come from (torch.amp, apex, Accelerate,
# Hugging Face's TrainingArguments, DeepSpeed): field -> its alias flags, read from the one alias
# table (ampkit.step.aliases); each also answers with hyphens.
ALIASES: dict[str, tuple[str, ...]] = {
    field: tuple(a for a in FLAG_ALIASES if KEY_ALIASES[a] == field)
    for field in dict.fromkeys(KEY_ALIASES[a] for a in FLAG_ALIASES)
}

# ``ampkit train``'s own defaults where they differ from MixedPrecisionConfig's: (value, why).
TRAIN_DEFAULTS: dict[str, tuple[Any, str]] = {
    "fallback": (
        True,
        "a run should survive a numerical failure (fp16 -> bf16 -> fp32) rather than end in "
        "skipped steps; --no_fallback turns it off",
    ),
    "clip_grad_norm": (
        1.0,
        "the built-in models train stably with it; --clip_grad_norm none turns it off "
        "(so does --optimizer_in_backward)",
    ),
}

ENGINE_FIELDS: tuple[str, ...] = tuple(f.name for f in fields_help())
SIZE_CHOICES: tuple[str, ...] = tuple(dict.fromkeys(s for sizes in SIZES.values() for s in sizes))


def precision_help(default: str) -> str:
    return f"one of {', '.join(CANONICAL)}, or an alias such as 16-mixed or O2 (default: {default})"


def precision_list(text: str) -> list[str]:
    """``--precisions fp32,bf16,bf16-pure:split`` (bench, tune, plan): the names as typed, each
    checked as ``--precision`` checks one, so a typo is refused with its "did you mean", and none
    named twice (:func:`ampkit.step.rung.spec_list`; argparse reports the ``ArgumentTypeError`` as
    one line naming the flag)."""
    try:
        return spec_list(text)
    except (PrecisionError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def model_flags(p: argparse.ArgumentParser, *, size: str, device: bool = True) -> None:
    """``--model``, ``--size`` (and ``--device``) with the data flags: one definition for every command."""
    g = p.add_argument_group("model and data")
    flag(
        g,
        "model",
        default="gpt",
        help=f"built-in model ({', '.join(MODELS)}), a Hugging Face config (gpt2, llama, mistral, "
        "qwen2, transformers.GPT2Config, a config.json or its directory) or package.module:factory "
        "(default: gpt)",
    )
    flag(g, "size", default=size, choices=SIZE_CHOICES, help=f"model size preset (default: {size})")
    if device:
        flag(g, "device", default=None, help="cpu, cuda, cuda:1, mps (default: best available)")
    data_flags(g)


class Switch(argparse.Action):
    """``--name`` turns a setting on, ``--no_name`` off (one option, like argparse's BooleanOptionalAction)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(
        self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None
    ) -> None:
        setattr(namespace, self.dest, not negated(option_string))


class Toggle(argparse.Action):
    """``--name`` alone is True, ``--name VALUE`` a value (fallback, deterministic); ``--no_name``
    is a separate option (a ``store_const`` of False)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs="?", **kwargs)

    def __call__(
        self, parser: Any, namespace: argparse.Namespace, values: Any, option_string: Any = None
    ) -> None:
        setattr(namespace, self.dest, True if values is None else values)


def negated(spelling: Optional[str]) -> bool:
    """``--no_x`` / ``--no-x`` / ``no_x`` (a [train] key)."""
    return bool(spelling) and spelling.lstrip("-").replace("-", "_").startswith("no_")


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """One flag per MixedPrecisionConfig field (spelling, type, help and default from the field)."""
    g = p.add_argument_group(
        "engine (MixedPrecisionConfig fields; a --config file's [amp] table sets the same)"
    )
    for f in fields_help():
        default, note = _default(f)
        spellings = ALIASES.get(f.name, ())
        kwargs: dict[str, Any] = {
            "default": default,
            "help": f"{_escape(f.help)} (default: {note})",
            "metavar": _metavar(f),
        }
        if f.kind is bool and not f.toggle:
            flag(
                g, f.name, *spellings, f"no_{f.name}", action=Switch, **{**kwargs, "metavar": None}
            )
        elif f.toggle:  # fallback, deterministic: on, off, or a value
            flag(g, f.name, *spellings, action=Toggle, type=_union_value(f), **kwargs)
            flag(
                g,
                f"no_{f.name}",
                dest=f.name,
                action="store_const",
                const=False,
                default=default,
                help=f"the same as --{f.name} false",
            )
        else:
            flag(g, f.name, *spellings, type=_value_type(f), choices=f.choices or None, **kwargs)
    flag(
        g,
        "amp_opt_level",
        default=None,
        choices=list(OPT_LEVELS),
        help="apex-style level: O0 = fp32, O1 = autocast, O2 = half weights with fp32 masters; with --precision: "
        "bf16 O2 = bf16-pure, bf16 O1 = bf16, any O0 = fp32",
    )
    rows = "\n".join(f"  {k} = {v!r}: {why}" for k, (v, why) in TRAIN_DEFAULTS.items())
    p.epilog = (
        "ampkit train's defaults that differ from MixedPrecisionConfig's:\n"
        + rows.replace("%", "%%")
        + "\nprecedence: command line > --config [train] > --config [amp] > these > the config's"
    )


def debug_flags(p: argparse.ArgumentParser) -> None:
    """``--debug`` and ``--print_config``: looking at a run rather than changing it (kept together)."""
    g = p.add_argument_group("debugging")
    flag(
        g,
        "debug",
        action="store_true",
        help="debug lines from logging.getLogger('ampkit') on stderr (precision choice, scale changes, skipped "
        "steps, fallbacks) and torch.autograd.set_detect_anomaly (NaN checks unless the loss is scaled); slow",
    )
    flag(
        g,
        "print_config",
        action="store_true",
        help="print the resolved settings as TOML (an [amp] and a [train] table; --config reads it back) and exit",
    )


def engine_config(
    args: argparse.Namespace,
    given: frozenset[str],
    file_amp: Mapping[str, Any],
    notes: Optional[list[str]] = None,
) -> MixedPrecisionConfig:
    """The engine's settings: a flag given (on the command line or in [train]) beats the file's
    [amp] table, which beats ``ampkit train``'s defaults; the rest are the config's defaults.
    ``--amp_opt_level`` combines with the precision (:func:`with_opt_level`); what it decided is
    appended to ``notes``."""
    values = {**{k: v for k, (v, _) in TRAIN_DEFAULTS.items()}, **file_amp}
    values.update({name: getattr(args, name) for name in ENGINE_FIELDS if name in given})
    if "precision" in given and split_spec(values["precision"])[1] is not None:
        for key in {
            "masters",
            "state_dtype",
            "allow_stall",
        } - given:  # the flag's rung beats the file's
            values.pop(key, None)
    if (
        values.get("optimizer_in_backward")
        and "clip_grad_norm" not in given
        and "clip_grad_norm" not in file_amp
    ):
        values["clip_grad_norm"] = (
            None  # train's default clipping needs every gradient before the first update
        )
        if notes is not None:
            notes.append(
                "--optimizer_in_backward: no gradient clipping (ampkit train's default --clip_grad_norm 1.0 "
                "needs every gradient before the first update)"
            )
    if args.amp_opt_level:
        chosen = (
            values.get("precision") if "precision" in given or "precision" in file_amp else None
        )
        values["precision"], note = with_opt_level(chosen, args.amp_opt_level)
        if note and notes is not None:
            notes.append(note)
    return MixedPrecisionConfig.from_dict(values)


def with_opt_level(precision: Optional[Any], level: str) -> tuple[str, Optional[str]]:
    """``(precision, note)`` for ``--amp_opt_level level`` with ``--precision precision`` (None: not given).

    ``O0`` is fp32 whatever the precision (the note says that O0 wins); ``O1`` keeps an autocast
    precision (``bf16 O1`` -> ``bf16``); ``O2`` makes it pure (``bf16 O2`` -> ``bf16-pure``).
    Raises ``ValueError`` for a pair that contradicts itself (``fp32 O2``, ``bf16-pure O1``).
    """
    level = level.upper()
    if precision is None:
        return opt_level_form(None, level), None
    name, rung = split_spec(
        precision
    )  # "bf16-pure:split": the level speaks of the precision, the rung stays
    name = canonical_precision(name)
    try:  # the combination is the precision rows' (o1_form, o2_form): step.precision.opt_level_form
        form = opt_level_form(name, level)
    except PrecisionError as e:
        raise ValueError(
            f"conflicting flags: --amp_opt_level {level} with precision {precision!r}: {e}"
        ) from None
    if level == "O0":
        note = (
            None
            if name == REFERENCE
            else (
                f"--amp_opt_level O0 wins: training in fp32 (the precision {precision} "
                "is not used; O0 means no mixed precision)"
            )
        )
        return form, note
    form = join_spec(form, rung)
    return form, f"--amp_opt_level {level} with precision {precision}: training in {form}"


def _default(f: FieldInfo) -> tuple[Any, str]:
    if f.name in TRAIN_DEFAULTS:
        value = TRAIN_DEFAULTS[f.name][0]
        return value, f"{_show(value)} in ampkit train; the library's: {_show(f.default)}"
    return f.default, _show(f.default)


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return ",".join(value) or "none"
    return (
        "none"
        if value is None
        else str(value).lower()
        if isinstance(value, bool)
        else f"{value:g}"
        if isinstance(value, float)
        else str(value)
    )


def _metavar(f: FieldInfo) -> Optional[str]:
    if f.choices and not f.toggle:
        return None  # argparse shows the choices
    if f.toggle:
        return "VALUE"
    base = {int: "N", float: "X", str: "NAME"}.get(f.kind, "GLOB,...")
    return f"{base}|none" if f.optional else base


def _escape(text: str) -> str:
    return text.replace("%", "%%")  # argparse formats help with %


def _value_type(f: FieldInfo) -> Any:
    base = {int: positive_int, float: positive_float, str: str}.get(f.kind, _patterns)

    def parse(text: str) -> Any:
        return None if f.optional and text.strip().lower() in ("none", "off") else base(text)

    parse.__name__ = getattr(base, "__name__", "value")
    return parse


def _patterns(text: str) -> tuple[str, ...]:
    """``'lm_head,*.ln_*'`` -> ``('lm_head', '*.ln_*')``."""
    return tuple(p.strip() for p in text.split(",") if p.strip())


def _union_value(f: FieldInfo) -> Any:
    """``true``/``false``, or a value: a choice (deterministic: warn) or, without choices, a string
    (fallback: a chain such as fp16,bf16,fp32; the config checks it)."""

    def parse(text: str) -> Any:
        t = str(text).strip()
        if t.lower() in ("true", "false"):
            return t.lower() == "true"
        if f.choices and t not in f.choices:
            raise argparse.ArgumentTypeError(
                f"{t!r}: choose true, false or one of "
                f"{', '.join(str(c) for c in f.choices if not isinstance(c, bool))}"
            )
        return t

    parse.__name__ = f.name
    return parse
