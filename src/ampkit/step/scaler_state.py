"""A :class:`~ampkit.step.scaler.LossScaler`'s state as host data: the state dict it saves, the one
it loads (its own or a ``torch.amp.GradScaler``'s, validated before anything changes), and the
form it pickles to.

Each state-dict key maps to one scaler attribute. The device tensors (scale, growth tracker,
hysteresis budget, overflow count) travel as the host values they are lazily re-created from
(``_init_scale``, ...), as ``GradScaler`` pickles: a scaler saved on a GPU loads anywhere.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Optional

from .scale_rules import SCALE_FLOOR

__all__ = [
    "FIELDS",
    "GRADSCALER_KEYS",
    "host_state",
    "load_into",
    "loaded_attributes",
    "saved_state",
]

#: state-dict key -> (LossScaler attribute, cast); the first five are ``GradScaler.state_dict()``'s.
FIELDS: dict[str, tuple[str, Optional[Callable[[Any], Any]]]] = {
    "scale": ("_init_scale", float),
    "growth_factor": ("_growth_factor", float),
    "backoff_factor": ("_backoff_factor", float),
    "growth_interval": ("_growth_interval", int),
    "_growth_tracker": ("_init_growth_tracker", int),
    "hysteresis": ("_hysteresis", int),
    "consecutive_hysteresis": ("_consecutive_hysteresis", bool),
    "_hysteresis_left": ("_init_hysteresis_left", int),
    "min_scale": ("_min_scale", None),
    "max_scale": ("_max_scale", None),
    "dynamic": ("_dynamic", bool),
    "overflows": ("_init_overflows", int),
    "updates": ("_updates", int),
}
GRADSCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_DEVICE_STATE = (
    ("_scale", float),
    ("_growth_tracker", int),
    ("_hysteresis_left", int),
    ("_overflows", int),
)


def host_state(attributes: dict[str, Any]) -> dict[str, Any]:
    """A copy of a scaler's attributes with its device state read into host values (**syncs**) and
    what cannot travel dropped: the cached 1.0, the last ``found_inf``, the ``found_inf_hook``
    (a process-local all-reduce)."""
    state = dict(attributes)
    for name, cast in _DEVICE_STATE:
        tensor = state.get(name)
        if tensor is not None:
            state["_init" + name] = cast(tensor.item())
        state[name] = None
    state.pop("_one", None)
    state.update(_last_found_inf=None, found_inf_hook=None)
    return state


def saved_state(attributes: dict[str, Any]) -> dict[str, Any]:
    """The state dict of a scaler with these attributes: a superset of ``GradScaler``'s. **Syncs**."""
    host = host_state(attributes)
    return {key: host[attr] for key, (attr, _) in FIELDS.items()}


def loaded_attributes(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The scaler attributes ``state_dict`` sets (keys it lacks are absent: the scaler keeps those
    settings; the overflow and update counts restart at 0). Raises before anything changes: an
    empty dict (saved from a disabled scaler), a missing ``GradScaler`` key, a scale that is not
    finite and > 0. A ``GradScaler``'s subnormal scale resumes at :data:`SCALE_FLOOR`."""
    if not state_dict:
        raise RuntimeError(
            "the scaler state dict is empty: it was probably saved from a disabled "
            "GradScaler/LossScaler (e.g. a bf16 or fp32 run)"
        )
    missing = [k for k in GRADSCALER_KEYS if k not in state_dict]
    if missing:
        raise KeyError(
            f"scaler state dict lacks {missing}; expected a LossScaler or torch.amp.GradScaler state dict"
        )
    scale = float(state_dict["scale"])
    if not (scale > 0 and math.isfinite(scale)):
        raise ValueError(f"scaler state dict holds an invalid scale {scale!r}")
    attributes = {
        attr: state_dict[key] if cast is None else cast(state_dict[key])
        for key, (attr, cast) in FIELDS.items()
        if key in state_dict
    }
    attributes["_init_scale"] = max(scale, SCALE_FLOOR)
    attributes.setdefault("_init_overflows", 0)
    attributes.setdefault("_updates", 0)
    return attributes


def load_into(attributes: dict[str, Any], state_dict: dict[str, Any]) -> None:
    """Load ``state_dict`` into a scaler's ``attributes`` (its ``__dict__``): the settings and
    host values (:func:`loaded_attributes`; without a saved hysteresis budget, a full one) and,
    where the device state exists, its tensors filled in place. Raises before anything changes."""
    loaded = loaded_attributes(state_dict)
    loaded.setdefault("_init_hysteresis_left", loaded.get("_hysteresis", attributes["_hysteresis"]))
    attributes.update(loaded)
    for name, _ in _DEVICE_STATE:
        tensor = attributes.get(name)
        if tensor is not None:
            tensor.fill_(attributes["_init" + name])
