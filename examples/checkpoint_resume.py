"""Train, checkpoint atomically, resume in a fresh Trainer, and check the result is bit-identical."""

import sys
import tempfile

import torch

import ampkit
from ampkit.models.builtin import builtin
from ampkit.train.trainer import Trainer


def make(checkpoint_dir: str, seed: int = 0) -> Trainer:
    torch.manual_seed(seed)
    model, batches = builtin("gpt", "tiny", batch_size=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    amp = ampkit.MixedPrecision("fp16", device="cpu", accumulation_steps=2, init_scale=2.0**12)
    model, optimizer = amp.setup(model, optimizer)
    return Trainer(
        model,
        optimizer,
        amp,
        batches,
        progress=False,
        checkpoint_dir=checkpoint_dir,
        checkpoint_every=3,
        keep_last=2,
    )


def main(steps: int = 6) -> bool:
    with tempfile.TemporaryDirectory() as d1, tempfile.TemporaryDirectory() as d2:
        straight = make(d1)
        straight.fit(steps)
        first = make(d2)
        first.fit(steps // 2)  # checkpoints every 3 steps on its own, atomically
        first.save_checkpoint()  # and here explicitly
        resumed = make(d2, seed=123)  # a fresh process would start here
        print("resumed from", resumed.resume())
        resumed.fit(steps - steps // 2)
        same = all(
            torch.equal(a, b)
            for a, b in zip(straight.model.parameters(), resumed.model.parameters())
        )
        print("bit-identical to the uninterrupted run:", same)
        return same


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
