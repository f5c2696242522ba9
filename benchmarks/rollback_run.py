"""A spike-rollback training run for the kill campaign (``kill_campaign.py --configs rollback``).

``ampkit train`` has no spike-rollback flag, so the campaign starts this script with the same
flags it gives ``ampkit train`` (``--steps``, ``--checkpoint_every``, ``--checkpoint_dir``,
``--log_dir``, ``--resume``; the others are ignored): a small MLP in bf16 under
``Trainer(spike_rollback={"every": 4})``, on batches whose 14th (data index 13) has its targets
x1000 -- optimizer step 14, caught at step 16's read and rolled back to step 12's snapshot. Logs a
step record per step (``log.jsonl``); a graceful stop exits 130/143 with the trainer's message.

    python benchmarks/rollback_run.py --steps 20 --checkpoint_every 1 --checkpoint_dir ck --log_dir log
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import ampkit

SPIKE = 13  # the data index with targets x1000


def batches(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + i)
    x = torch.randn(32, 16, generator=g)
    y = x @ torch.randn(16, 4, generator=torch.Generator().manual_seed(1))
    return x, y * 1000 if i == SPIKE else y


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--checkpoint_every", type=int, required=True)
    ap.add_argument("--checkpoint_dir", required=True)
    ap.add_argument("--log_dir", required=True)
    ap.add_argument("--resume", action="store_true")
    args, _ = ap.parse_known_args()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    amp = ampkit.MixedPrecision("bf16", device="cpu")
    model, opt = amp.setup(model, opt)
    trainer = ampkit.Trainer(
        model,
        opt,
        amp,
        batches,
        loss_fn=lambda m, b: nn.functional.mse_loss(m(b[0]).float(), b[1]),
        spike_rollback={"every": 4},
        fallback=False,
        progress=False,
        log_every=1,
        log_dir=args.log_dir,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        keep_last=None,
    )
    if args.resume:
        path = trainer.resume()
        print(f"resumed from {path} at step {amp.optimizer_steps}", flush=True)
    if amp.optimizer_steps < args.steps:
        trainer.fit(args.steps - amp.optimizer_steps)  # a graceful stop exits 130/143 by itself


if __name__ == "__main__":
    main()
