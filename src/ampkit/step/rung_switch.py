"""Moving between precisions and memory-ladder rungs: what a switch or a fallback chain names.

The rung itself (its fields, its spelling) is :mod:`ampkit.step.rung`; this is its use by
:meth:`ampkit.MixedPrecision.switch` and the fallback chain (:mod:`ampkit.step.fallback`): the
chain name of where training is (:func:`rung_label`), the move to a precision or rung
(:func:`rung_move`), and one chain entry validated (:func:`chain_entry`).
"""

from __future__ import annotations

from typing import Any

from .config import MixedPrecisionConfig
from .hardware import DeviceInfo
from .precision import (
    NAMES,
    REGISTRY,
    Precision,
    PrecisionError,
    parse_precision,
    resolve_precision,
)
from .rung import RungError, join_spec, split_spec

__all__ = ["chain_entry", "ladder_form", "rung_label", "rung_move"]


def rung_label(precision: str, config: MixedPrecisionConfig) -> str:
    """The chain name of training in ``precision`` under ``config``: ``"bf16-pure:<masters>[+bf16]"``
    for bf16-pure (its rung of the memory ladder), else the precision's name."""
    if precision not in REGISTRY or not REGISTRY[precision].has_ladder:
        return precision
    return join_spec(precision, config.rung)


def ladder_form(precision: str, config: MixedPrecisionConfig) -> tuple[str, int]:
    """What a model's form under ``precision`` depends on: its rung (:func:`rung_label`) and, on the
    ladder, ``ladder_scratch_mib`` (it sets each optimizer call's size, so the random stream). A
    resume whose checkpoint differs in either rebuilds the form as the checkpoint's run had it."""
    has = precision in REGISTRY and REGISTRY[precision].has_ladder
    return rung_label(precision, config), config.ladder_scratch_mib if has else 0


def rung_move(
    config: MixedPrecisionConfig, current: str, target: Any, info: DeviceInfo
) -> tuple[Precision, MixedPrecisionConfig, dict[str, str]]:
    """A switch to ``target`` (a precision, or a rung such as ``"bf16-pure:split"``) from ``current``:
    the precision resolved on ``info``, the config with the target's rung (validated now, before
    anything changes), and the ``from_rung``/``to_rung`` event fields when either side is a bf16-pure
    rung. Raises ``PrecisionError`` / ``ConfigError``."""
    name, rung = split_spec(target)  # refuses a rung on a precision without the ladder
    new = resolve_precision(name, info, emulate_fp8=config.fp8_emulate)
    cfg = config.replace(**rung.fields()) if rung is not None else config
    frm, to = rung_label(current, config), rung_label(new.name, cfg)
    return new, cfg, ({"from_rung": frm, "to_rung": to} if ":" in frm + to else {})


def chain_entry(spec: str, info: DeviceInfo) -> str:
    """One chain entry, validated: a precision name or a bf16-pure rung (canonical spelling)."""
    try:
        name, rung = split_spec(spec.strip())
    except RungError as e:
        raise PrecisionError(f"fallback chain entry {spec!r}: {e}") from None
    name = parse_precision(name)
    if name not in NAMES:
        raise PrecisionError(
            f"fallback chain entry {spec!r} is not supported; use names from: {', '.join(NAMES)}, "
            "or a rung bf16-pure:<masters>[+bf16]"
        )
    resolve_precision(name, info)  # raises PrecisionError naming the device and the reason
    return join_spec(name, rung)
