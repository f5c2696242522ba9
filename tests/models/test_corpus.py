"""The stdlib corpus is cached once per process: a first use under a fake-tensor mode (``ampkit
plan`` shapes its batches inside the estimate's FakeTensorMode) must not cache a fake tensor that
every later real run of the process would then train on."""

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from ampkit.models.data import TextBatches, stdlib_corpus


def test_a_first_use_under_fake_tensors_caches_real_data():
    stdlib_corpus.cache_clear()
    with FakeTensorMode(allow_non_fake_inputs=True):
        stdlib_corpus()
    real = stdlib_corpus()
    assert type(real) is torch.Tensor and not isinstance(real, FakeTensor)
    assert real.dtype == torch.uint8 and real.numel() > 10_000
    x, y = TextBatches(block_size=16, batch_size=4, seed=0)(0)
    assert type(x) is torch.Tensor and torch.equal(
        x[:, 1:], y[:, :-1]
    )  # real tokens, shifted by one
