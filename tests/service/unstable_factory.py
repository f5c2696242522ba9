"""A ``module:factory`` for the service tests: the engineered model that cannot train in fp16
(tests/support/unstable_model.py), so an fp16 run with a fallback chain falls back to bf16."""

from ..support.unstable_model import Unstable, data


def make(batch_size: int = 32, seed: int = 0):
    import torch

    torch.manual_seed(seed)
    batches = data(16, seed=1)
    return Unstable(), lambda i: batches[i % len(batches)]
