"""Process-global numeric settings applied for the duration of a block."""

from __future__ import annotations

import torch

__all__ = ["MatmulPrecision"]


class MatmulPrecision:
    """Set fp32 matmul internals for the duration of a block (tf32 on; fp32 strictly off).

    ``torch.set_float32_matmul_precision`` is process-global, so it is set on entry and restored
    on exit rather than left changed behind the user's back.
    """

    __slots__ = ("level", "cudnn_tf32", "_prev", "_prev_cudnn")

    def __init__(self, level: str, cudnn_tf32: bool) -> None:
        self.level, self.cudnn_tf32 = level, cudnn_tf32

    def __enter__(self) -> None:
        self._prev = torch.get_float32_matmul_precision()
        self._prev_cudnn = torch.backends.cudnn.allow_tf32
        if self._prev != self.level:
            torch.set_float32_matmul_precision(self.level)
        if self._prev_cudnn != self.cudnn_tf32:
            torch.backends.cudnn.allow_tf32 = self.cudnn_tf32

    def __exit__(self, *exc: object) -> None:
        if self._prev != self.level:
            torch.set_float32_matmul_precision(self._prev)
        if self._prev_cudnn != self.cudnn_tf32:
            torch.backends.cudnn.allow_tf32 = self._prev_cudnn
