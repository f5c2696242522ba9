"""``fp32`` and ``tf32``: fp32 weights and compute; only the fp32 matmul internals differ.

``fp32`` turns reduced-precision matmul internals off for the forward and backward
(``torch.set_float32_matmul_precision("highest")``, cuDNN TF32 off); ``tf32`` turns them on
("high": TF32 on CUDA Ampere+; "medium" on CPUs, where oneDNN may use bf16 internals on AMX).
The setting is process-global, so it is applied around each forward and backward and restored
after (:class:`~ampkit.step.contexts.MatmulPrecision`), never left changed behind the user's back.
"""

from __future__ import annotations

from typing import Any, Optional

from ..contexts import MatmulPrecision
from .base import PrecisionPolicy

__all__ = ["FullPolicy"]


class FullPolicy(PrecisionPolicy):
    """fp32 / tf32: no casts, no autocast; the matmul precision around forward and backward."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.precision.reduced_matmul:
            self._matmul = MatmulPrecision("high" if self.device.type == "cuda" else "medium", True)
        else:
            self._matmul = MatmulPrecision("highest", False)

    def forward_context(self) -> MatmulPrecision:
        return self._matmul

    def backward_context(self) -> Optional[MatmulPrecision]:
        return self._matmul

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "matmul_internals": self._matmul.level}
