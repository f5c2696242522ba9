"""One policy per precision family; :func:`policy_for` picks it for a :class:`~ampkit.step.precision.Precision`.

=========  ===================  ======================================================
family     precisions           file
=========  ===================  ======================================================
full       fp32, tf32           :mod:`.full` (the fp32 matmul precision)
autocast   bf16, fp16           :mod:`.autocast` (``torch.autocast``)
pure       bf16-pure, fp16-pure :mod:`.pure` (half weights, fp32 masters)
fp8        fp8, fp8-rowwise     :mod:`.fp8` (torchao float8 modules + bf16 autocast)
=========  ===================  ======================================================
"""

from __future__ import annotations

import torch

from ..config import MixedPrecisionConfig
from ..precision import Precision
from .autocast import AutocastPolicy
from .base import PrecisionPolicy
from .fp8 import Fp8Policy
from .full import FullPolicy
from .pure import PurePolicy

__all__ = ["policy_for"]

_FAMILIES: dict[str, type[PrecisionPolicy]] = {
    "full": FullPolicy, "autocast": AutocastPolicy, "pure": PurePolicy, "fp8": Fp8Policy,
}


def policy_for(precision: Precision, config: MixedPrecisionConfig, device: torch.device, *,
               shards_params: bool = False) -> PrecisionPolicy:
    """The policy that runs ``precision`` (a resolved :class:`Precision`) on ``device``.

    ``shards_params``: the model's parameters are FSDP2 fp32 shards (no masters for pure forms).
    Nothing is changed until the policy's ``prepare``.
    """
    return _FAMILIES[precision.family](precision, config, device, shards_params=shards_params)
