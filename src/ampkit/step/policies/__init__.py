"""One policy per precision family; :func:`policy_for` picks it for a :class:`~ampkit.step.precision.Precision`.

=========  ===================  ======================================================
family     precisions           file
=========  ===================  ======================================================
full       fp32, tf32           :mod:`.full` (the fp32 matmul precision)
autocast   bf16, fp16           :mod:`.autocast` (``torch.autocast``)
pure       bf16-pure, fp16-pure :mod:`.pure` (half weights, fp32 masters, the ladder)
fp8        fp8, fp8-rowwise     :mod:`.fp8` (torchao float8 modules + bf16 autocast)
=========  ===================  ======================================================
"""

from __future__ import annotations

import torch

from ..config import ConfigError, MixedPrecisionConfig
from ..precision import REGISTRY, Precision, parse_precision
from ..rung import ladder_names
from .autocast import AutocastPolicy
from .base import PrecisionPolicy
from .fp8 import Fp8Policy
from .full import FullPolicy
from .pure.policy import PurePolicy

__all__ = ["policy_for"]

_FAMILIES: dict[str, type[PrecisionPolicy]] = {
    "full": FullPolicy,
    "autocast": AutocastPolicy,
    "pure": PurePolicy,
    "fp8": Fp8Policy,
}


def policy_for(
    precision: Precision,
    config: MixedPrecisionConfig,
    device: torch.device,
    *,
    shards_params: bool = False,
    asked: bool = False,
) -> PrecisionPolicy:
    """The policy that runs ``precision`` (a resolved :class:`Precision`) on ``device``.

    ``shards_params``: the model's parameters are FSDP2 fp32 shards (no masters for pure forms).
    ``asked``: ``precision`` is the one the engine is built for (not one a fallback moved to
    later), so a memory-ladder rung it cannot use is refused (:func:`refuse_stray_rung`).
    Nothing is changed until the policy's ``prepare``.
    """
    if asked:
        refuse_stray_rung(precision, config)
    return _FAMILIES[precision.family](precision, config, device, shards_params=shards_params)


def refuse_stray_rung(precision: Precision, config: MixedPrecisionConfig) -> None:
    """Raise :class:`ConfigError` when ``config`` asks for a memory-ladder rung (``masters`` or
    ``state_dtype`` other than fp32) that neither the precision asked for nor the one it resolved
    to applies: silently training with fp32 masters instead would be a different run."""
    if config.rung.plain or precision.row.has_ladder:
        return
    name = config.precision if isinstance(config.precision, str) else str(config.precision)
    asked = parse_precision(name)
    if asked == "o2" or (asked in REGISTRY and REGISTRY[asked].has_ladder):
        return  # (asked for a laddered form; a device fallback moved it: the chain's business)
    ladders = ", ".join(ladder_names())
    raise ConfigError(
        f"masters={config.masters!r}, state_dtype={config.state_dtype!r} is a memory-ladder rung, "
        f"which precision {precision.name!r} does not use; the ladder belongs to {ladders} "
        f"(e.g. precision='bf16-pure', masters={config.masters!r}, or 'bf16-pure:split' in a "
        f"list of precisions), or leave masters and state_dtype at 'fp32'"
    )
