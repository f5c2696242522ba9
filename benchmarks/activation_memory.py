"""Activation memory of the built-in GPT under fp32 / bf16 / fp16, plus the static memory breakdown.

Bytes saved for backward during one forward (exact, via saved-tensor hooks; each storage once),
for each GPT size preset. Also the parameter / gradient / AdamW-state breakdown by dtype.

    python benchmarks/activation_memory.py --sizes tiny,small,medium --batch-size 8
"""

from __future__ import annotations

import argparse

import torch

from ampkit.models.builtin import build
from ampkit.models.data import TextBatches
from ampkit.observe.memory import activations, breakdown


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", default="tiny,small,medium")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--precisions", default="fp32,bf16,fp16")
    args = ap.parse_args()
    precisions = args.precisions.split(",")
    print(
        f"# torch {torch.__version__} · batch {args.batch_size} · activations saved for backward (MiB)"
    )
    print()
    print(
        "| GPT size | params | tokens/batch | "
        + " | ".join(precisions)
        + " | "
        + " | ".join(f"{p}/fp32" for p in precisions if p != "fp32")
        + " |"
    )
    print("| --- | ---: | ---: |" + " ---: |" * (2 * len(precisions) - 1))
    for size in args.sizes.split(","):
        torch.manual_seed(0)
        model = build("gpt", size)
        x, y = TextBatches(batch_size=args.batch_size, block_size=model.config.block_size)(0)
        totals = {p: activations(model, (x, y), p).total for p in precisions}
        n = sum(p.numel() for p in model.parameters())
        cells = " | ".join(f"{totals[p] / 2**20:,.2f}" for p in precisions)
        ratios = " | ".join(f"{totals[p] / totals['fp32']:.3f}" for p in precisions if p != "fp32")
        print(f"| {size} | {n / 1e6:.2f}M | {x.numel():,} | {cells} | {ratios} |")
    print()
    model = build("gpt", "small")
    opt = torch.optim.AdamW(model.parameters())
    x, y = TextBatches(batch_size=args.batch_size, block_size=model.config.block_size)(0)
    model(x, y).backward()
    opt.step()
    bd = breakdown(model, opt)
    print("GPT small after one AdamW step (MiB):")
    print()
    print("| category | bytes | MiB |")
    print("| --- | ---: | ---: |")
    for cat, b in bd.by_category.items():
        print(f"| {cat} | {b:,} | {b / 2**20:.3f} |")
    print(f"| total | {bd.total:,} | {bd.total / 2**20:.3f} |")


if __name__ == "__main__":
    main()
