"""The one alias table: every spelling users bring from other tools, mapped once onto ampkit's names.

* :data:`PRECISION_ALIASES`: precision spellings (torch dtypes, apex O-levels, Lightning's and
  Accelerate's names) -> a precision name. :func:`ampkit.step.precision.parse_precision` reads it,
  and every surface parses a precision there: ``MixedPrecision("16-mixed")``, ``--precision``,
  a TOML's ``precision``, the service's ``precision`` and ``dtype``, the Lightning/Hugging Face
  plugins, fallback chains.
* :data:`KEY_ALIASES`: config keys -> :class:`MixedPrecisionConfig` fields. Every reader of a
  config -- ``MixedPrecisionConfig(...)`` and ``from_dict``, ``MixedPrecision(**kw)``, a
  ``--config`` TOML's ``[amp]`` table, the service's ``amp`` dict -- sends its keys through
  :func:`canonical_keys`: an alias becomes its field, ``scaling_strategy`` becomes the fields it
  means, and any other unknown key is refused with a "did you mean" and the valid keys.
  :data:`FLAG_ALIASES` are the ones ``ampkit train`` also takes as flags (``--max_grad_norm``).

The other direction (an ampkit precision's name in Lightning or Accelerate) is a column of the
precision rows (``PrecisionRow.lightning_name``); tests/step/test_aliases.py checks that each
such name comes back here to a precision of the same dtypes. docs/guides/coming-from.md is the
table for people; this module is the one for code (a leaf: it imports nothing from ampkit).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

__all__ = [
    "FLAG_ALIASES",
    "KEY_ALIASES",
    "PRECISION_ALIASES",
    "SCALING_STRATEGIES",
    "SHOWN_PRECISION_ALIASES",
    "SWITCH_KEYS",
    "SWITCH_WHEN_BOOL",
    "UnknownKeyError",
    "canonical_keys",
    "unknown_key_message",
]

#: alias -> precision name (lower case, ``_`` read as ``-``). ``o2`` is kept as ``o2``: the pure
#: form of ``auto``'s dtype, which only :func:`ampkit.step.precision.resolve_precision` can finish.
PRECISION_ALIASES: dict[str, str] = {
    # torch dtypes and plain words
    "float32": "fp32",
    "float": "fp32",
    "torch.float32": "fp32",
    "torch.float": "fp32",
    "full": "fp32",
    "half": "fp16",
    "float16": "fp16",
    "torch.float16": "fp16",
    "torch.half": "fp16",
    "bfloat16": "bf16",
    "torch.bfloat16": "bf16",
    # apex's optimisation levels (what O1/O2 make of a given precision: precision.opt_level_form)
    "o0": "fp32",
    "o1": "auto",
    "o2": "o2",
    # Lightning's precision flags (PrecisionRow.lightning_name is the other direction)
    "32": "fp32",
    "32-true": "fp32",
    "16": "fp16",
    "16-mixed": "fp16",
    "bf16-mixed": "bf16",
    "bf16-true": "bf16-pure",
    "16-true": "fp16-pure",
    # Accelerate's mixed_precision (fp16, bf16 and fp8 are ampkit's names too) and other tools
    "no": "fp32",
    "mixed": "auto",
    "tf32-mixed": "tf32",
}
#: The aliases an unknown precision's error lists (a few of each kind; the table has more).
SHOWN_PRECISION_ALIASES = (
    "O0",
    "O1",
    "O2",
    "no",
    "16-mixed",
    "bf16-mixed",
    "bf16-true",
    "16-true",
    "32",
    "half",
    "bfloat16",
    "float16",
    "float32",
)

#: alias -> field. Only unambiguous names: each means exactly the field it maps to.
KEY_ALIASES: dict[str, str] = {
    # loss-scale bounds and window (DeepSpeed, Megatron, the seed guides' AMPConfig)
    "min_loss_scale": "min_scale",
    "max_loss_scale": "max_scale",
    "loss_scale_window": "growth_interval",
    "initial_scale": "init_scale",
    "initial_loss_scale": "init_scale",
    # torch.autocast / the seed guides' mixed_precision_* knobs
    "cache_enabled": "autocast_cache",
    "mixed_precision_autocast_cache_enabled": "autocast_cache",
    "mixed_precision_dtype": "precision",
    "dtype": "precision",
    "mixed_precision": "precision",
    "mixed_precision_grad_scaler_init_scale": "init_scale",
    "mixed_precision_grad_scaler_growth_factor": "growth_factor",
    "mixed_precision_grad_scaler_backoff_factor": "backoff_factor",
    "mixed_precision_grad_scaler_growth_interval": "growth_interval",
    # ampkit train's older flag spellings (cli.flags.ALIASES), so a TOML may use them too
    "grad_scaler_init": "init_scale",
    "grad_scaler_growth_interval": "growth_interval",
    "grad_scaler_backoff": "backoff_factor",
    "grad_accum_steps": "accumulation_steps",
    "gradient_accumulation_steps": "accumulation_steps",
    "max_grad_norm": "clip_grad_norm",
    "fallback_chain": "fallback",
    "automatic_fallback": "fallback",
}

#: The :data:`KEY_ALIASES` that ``ampkit train`` also takes as flags (``--max_grad_norm 1``; each
#: with its hyphen spelling too). The others are config keys only.
FLAG_ALIASES: tuple[str, ...] = (
    "mixed_precision",
    "grad_scaler_init",
    "grad_scaler_growth_interval",
    "grad_scaler_backoff",
    "grad_accum_steps",
    "max_grad_norm",
    "fallback_chain",
)

#: ``scaling_strategy`` (the seed guides' ``ScalingStrategy`` enum) -> the fields it means.
#: ADAPTIVE ("dynamic, but tolerant of a lone overflow") is DeepSpeed's hysteresis: skip every
#: overflowing step, back off only after 2 in a row.
SCALING_STRATEGIES: dict[str, dict[str, Any]] = {
    "constant": {"dynamic_scaling": False},
    "dynamic": {"dynamic_scaling": True},
    "adaptive": {"dynamic_scaling": True, "hysteresis": 2, "consecutive_hysteresis": True},
}
_STRATEGY_KEYS = ("scaling_strategy", "loss_scaling_strategy", "scaler_strategy")

#: The seed guides' on/off switches of mixed precision (``enabled=True``, ``use_mixed_precision=False``):
#: ``True`` keeps the precision (the one given, else ``auto``), ``False`` means fp32 whatever else is given.
SWITCH_KEYS = ("enabled", "use_mixed_precision")
#: Precision aliases that other tools also use as switches: given a bool (``mixed_precision=True``,
#: a YAML's ``mixed_precision: false``) they are read as :data:`SWITCH_KEYS` are; given a name, as
#: the precision.
SWITCH_WHEN_BOOL = ("mixed_precision",)


class UnknownKeyError(ValueError, TypeError):
    """An unknown config key (a ``ConfigError`` subclass wraps it in ``ampkit.step.config``). Also a
    ``TypeError``, what an unexpected keyword argument raised before aliases existed."""


def unknown_key_message(keys: Iterable[str], valid: Iterable[str], what: str = "config key") -> str:
    """``unknown config key 'min_scal' (did you mean 'min_scale'?); valid keys: ...``."""
    valid = list(valid)
    known = valid + list(KEY_ALIASES) + list(_STRATEGY_KEYS) + list(SWITCH_KEYS)
    parts = []
    for k in keys:
        close = difflib.get_close_matches(str(k), known, n=1, cutoff=0.6)
        hint = ""
        if close:
            target = KEY_ALIASES.get(close[0])
            hint = f" (did you mean {close[0]!r}{f', an alias of {target!r}' if target else ''}?)"
        parts.append(f"{k!r}{hint}")
    plural = "s" if len(parts) > 1 else ""
    return f"unknown {what}{plural} {', '.join(parts)}; valid keys: {', '.join(valid)}"


def canonical_keys(data: Mapping[str, Any], valid: Iterable[str]) -> dict[str, Any]:
    """``data`` with aliases renamed to their fields and ``scaling_strategy`` expanded.

    An on/off switch (:data:`SWITCH_KEYS`) set to ``False`` makes ``precision`` fp32; ``True``
    changes nothing.

    Raises :class:`UnknownKeyError` for a key that is neither a field nor an alias (with a "did
    you mean"), and ``ValueError`` when an alias and its field (or two aliases) give different
    values, for an unknown scaling strategy, or for a switch that is not a bool. Same values given
    twice are accepted.
    """
    valid = list(valid)
    out: dict[str, Any] = {}
    given: dict[str, str] = {}  # field -> the key that set it
    unknown = []
    switches = {
        k: v
        for k, v in data.items()
        if (k in SWITCH_KEYS or (k in SWITCH_WHEN_BOOL and isinstance(v, bool)))
        and k not in valid
        and "precision" in valid
    }
    for key, value in data.items():
        if key in switches:
            if value is not True and value is not False:  # `is`: 1, "no" and None are not the bools
                raise ValueError(
                    f"invalid {key}={value!r}: must be true or false (true: mixed "
                    "precision, the precision given or auto; false: fp32)"
                )
            continue
        if key in _STRATEGY_KEYS and key not in valid:
            pairs = list(_strategy(key, value).items())
        elif key in valid:
            pairs = [(key, value)]
        elif key in KEY_ALIASES and KEY_ALIASES[key] in valid:
            pairs = [(KEY_ALIASES[key], value)]
        else:
            unknown.append(key)
            continue
        for name, v in pairs:
            if name in out and not _same(out[name], v):
                raise ValueError(
                    f"{key}={value!r} and {given[name]}={out[name]!r} both set {name}, to different "
                    "values; give one of them"
                )
            out[name], given[name] = v, key
    if unknown:
        raise UnknownKeyError(unknown_key_message(unknown, valid))
    if False in switches.values():
        if True in switches.values():
            both = ", ".join(f"{k}={v}" for k, v in switches.items())
            raise ValueError(f"{both} contradict each other; give one")
        out["precision"] = "fp32"  # switched off: whatever precision or dtype came with it
    return out


def _strategy(key: str, value: Any) -> dict[str, Any]:
    """``"DYNAMIC"``, ``"ScalingStrategy.DYNAMIC"``, ``"dynamic"`` or an enum member -> fields."""
    name = getattr(value, "name", value)  # an enum member
    text = str(name).rsplit(".", 1)[-1].strip().lower()
    if text not in SCALING_STRATEGIES:
        raise ValueError(
            f"invalid {key}={value!r}: must be one of {', '.join(s.upper() for s in SCALING_STRATEGIES)} "
            f"(CONSTANT: dynamic_scaling=False; DYNAMIC: dynamic_scaling=True; ADAPTIVE: "
            "dynamic_scaling=True, hysteresis=2, consecutive_hysteresis=True)"
        )
    return dict(SCALING_STRATEGIES[text])


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # e.g. tensors: ambiguous truth value
        return a is b
