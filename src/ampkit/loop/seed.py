"""Same seed, same run: seed every random generator a training run reads, and optionally ask
PyTorch for deterministic kernels.

A run reads torch's generators (parameter init, dropout, data order; CUDA's for dropout on the
GPU), and its checkpoints carry Python's and numpy's states too (user data pipelines draw from
them). :func:`seed_everything` seeds all of them, so two fresh runs with one seed start from the
same state and -- on CPU, where kernels are deterministic -- stay bitwise equal. On GPUs some
kernels (atomics in scatter/index_add backward, some cuBLAS/cuDNN algorithms) are not
deterministic; ``deterministic=True`` makes PyTorch pick deterministic ones or raise for ops that
have none, ``"warn"`` only warns for those (see
:func:`ampkit.step.determinism.apply_determinism`).
"""

from __future__ import annotations

import random
from typing import Union

import torch

__all__ = ["SEED_RANGE", "seed_everything"]

#: The seeds a run takes: a signed 64-bit integer (torch takes -2**63 .. 2**64-1, but a seed
#: travels in TOML files -- run.toml, --print_config -- whose integers are signed 64-bit).
SEED_RANGE = (-(2**63), 2**63 - 1)


def seed_everything(seed: int, deterministic: Union[bool, str, None] = False) -> None:
    """Seed torch (CPU and every CUDA device), Python's ``random`` and numpy (when installed) with
    ``seed``; with ``deterministic`` (``True``/``"true"`` or ``"warn"``) also switch PyTorch to
    deterministic algorithms. numpy takes ``seed mod 2**32`` (its range)."""
    random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device
    try:
        import numpy as np

        np.random.seed(int(seed) % 2**32)
    except ImportError:
        pass
    mode: Union[bool, str] = {None: False, "true": True, "false": False}.get(
        deterministic, deterministic
    )  # type: ignore[arg-type]
    if mode:
        from ..step.determinism import apply_determinism

        apply_determinism(mode)
