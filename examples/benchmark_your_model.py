"""Measure every precision on your own model, then let `tune` pick one.

The same works from the shell: `ampkit bench --model examples.benchmark_your_model:factory`.
"""

import torch
import torch.nn.functional as F
from torch import nn

from ampkit import compare, tune


class MyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(128, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 10)
        )

    def forward(self, x, y):
        return F.cross_entropy(self.net(x), y)  # model(*batch) returns the loss


def factory(batch_size: int = 32, seed: int = 0):
    """(model, batch_fn): what `ampkit bench/tune/train --model module:factory` expects."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.randn(128, 10, generator=g)

    def batch(i: int):
        gi = torch.Generator().manual_seed(seed * 7919 + i)
        x = torch.randn(batch_size, 128, generator=gi)
        return x, (x @ teacher).argmax(1)

    batch.samples_per_batch = batch_size
    return MyModel(), batch


def main(steps: int = 6) -> str:
    _, batches = factory()
    report = compare(
        lambda: factory()[0],
        batches,
        ["fp32", "bf16", "fp16"],
        steps=steps,
        warmup=2,
        repeats=2,
        device="cpu",
        model_name="MyModel",
    )
    from rich.console import Console

    Console(width=160).print(report.table())
    rec = tune(report, tolerance=0.01)
    print("recommended:", rec.precision, rec.why_not)
    return rec.precision


if __name__ == "__main__":
    main()
