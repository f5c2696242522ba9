"""Deterministic kernels: the one switch behind ``MixedPrecisionConfig.deterministic``.

On CPU PyTorch's kernels are deterministic already; on GPUs some are not (atomics in
scatter/index_add backward, some cuBLAS and cuDNN algorithms), so two runs from one seed drift
apart in the last bits. :func:`apply_determinism` sets every flag PyTorch reads for this.
"""

from __future__ import annotations

import os
from typing import Union

import torch

from .config import check_deterministic

__all__ = ["apply_determinism"]


def apply_determinism(mode: Union[bool, str]) -> None:
    """Ask PyTorch for deterministic kernels. Changes process-wide state; nothing is undone.

    ``False``: does nothing (torch's flags stay as they are). ``True``:
    ``torch.use_deterministic_algorithms(True)`` (ops without a deterministic kernel raise),
    ``torch.backends.cudnn.deterministic = True``, ``torch.backends.cudnn.benchmark = False``, and
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` unless the environment sets it already (cuBLAS needs it for
    reproducible matmuls since CUDA 10.2; it reads it when a cuBLAS handle is created, so set it
    before the first CUDA matmul for it to count). ``"warn"``: the same, but ops without a
    deterministic kernel only warn (``warn_only=True``). Any other value raises
    :class:`~ampkit.step.config.ConfigError`. No device sync.
    """
    check_deterministic(mode)
    if mode is False:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=mode == "warn")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
