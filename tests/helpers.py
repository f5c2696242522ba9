"""Shared test helpers."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class SyncCounter(TorchDispatchMode):
    """Counts device->host reads (``aten._local_scalar_dense``: ``.item()``, ``bool(tensor)``, ...)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))
