"""A user model that fails on one rank, for the multi-process failure tests.

``AMPKIT_TEST_FAIL_RANK`` names the rank; ``AMPKIT_TEST_FAIL_AT`` says where: ``build`` (in the
factory, before any collective of the run) or ``step:N`` (in the forward of micro-batch N).
"""

import os

import torch
import torch.nn.functional as F
from torch import nn


class Faulty(nn.Module):
    def __init__(self, fail_at_forward: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 4)
        self.fail_at_forward, self.forwards = fail_at_forward, 0

    def forward(self, x, y):
        self.forwards += 1
        if self.forwards == self.fail_at_forward:
            raise RuntimeError(
                f"user model failed on rank {os.environ.get('RANK')} at forward {self.forwards}"
            )
        return F.cross_entropy(self.fc2(F.gelu(self.fc1(x))), y)


def factory(seed=0):
    me = os.environ.get("RANK", "0") == os.environ.get("AMPKIT_TEST_FAIL_RANK", "-1")
    where = os.environ.get("AMPKIT_TEST_FAIL_AT", "build")
    if me and where == "build":
        raise RuntimeError(f"user factory failed on rank {os.environ.get('RANK')}")
    at = int(where.split(":")[1]) if me and where.startswith("step:") else -1
    torch.manual_seed(seed)
    model = Faulty(at)
    g = torch.Generator().manual_seed(seed + 1)
    w = torch.randn(16, 4, generator=g)

    def batch(i):
        gi = torch.Generator().manual_seed(seed * 1000 + i)
        x = torch.randn(8, 16, generator=gi)
        return x, (x @ w).argmax(1)

    return model, batch
