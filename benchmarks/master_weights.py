"""Why O2 needs fp32 master weights: bf16-pure with masters vs without, against fp32.

Trains the built-in GPT (default: small) from the same seed on the same batches in fp32,
``bf16-pure`` (bf16 weights, fp32 masters in the optimizer) and a no-master control (the model
simply cast to bf16 and trained with the same AdamW: what ``model.to(torch.bfloat16)`` does).
Prints the mean of the last 20 losses of each and the gap to fp32.

    python benchmarks/master_weights.py                 # GPT small, 300 steps, batch 8
    python benchmarks/master_weights.py --size tiny --steps 100
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from ampkit import MixedPrecision
from ampkit.models.builtin import builtin
from ampkit.step.hardware import device_info


def train(kind: str, args: argparse.Namespace) -> list[float]:
    torch.manual_seed(args.seed)
    model, batches = builtin("gpt", args.size, batch_size=args.batch_size, seed=args.seed)
    if kind == "no-master":
        model = model.to(torch.bfloat16)
        amp = MixedPrecision("fp32", device="cpu")  # no casts, no masters: plain bf16 weights
    else:
        amp = MixedPrecision(kind, device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    model, opt = amp.setup(model, opt)
    losses = []
    for i in range(args.steps):
        x, y = batches(i)
        if kind == "no-master":
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(x, y)
        else:
            with amp.autocast():
                loss = model(x, y)
        amp.backward(loss)
        amp.step(opt, clip_grad_norm=1.0)
        losses.append(float(loss))
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size", default="small")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    info = device_info("cpu")
    print(
        f"# {info.name} · torch {torch.__version__} · python {platform.python_version()} · GPT {args.size}, "
        f"{args.steps} steps, batch {args.batch_size}, AdamW lr {args.lr}, seed {args.seed}"
    )
    rows = {}
    for kind in ("fp32", "bf16-pure", "no-master"):
        t0 = time.perf_counter()
        losses = train(kind, args)
        rows[kind] = (statistics.mean(losses[-20:]), time.perf_counter() - t0)
        print(
            f"  {kind}: mean of last 20 losses {rows[kind][0]:.4f} ({rows[kind][1]:.0f} s)",
            flush=True,
        )
    ref = rows["fp32"][0]
    print()
    print("| run | mean of last 20 losses | gap to fp32 |")
    print("| --- | ---: | ---: |")
    for kind, (mean, _) in rows.items():
        print(f"| {kind} | {mean:.4f} | {100 * (mean - ref) / ref:+.2f}% |")


if __name__ == "__main__":
    main()
