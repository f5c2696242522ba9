"""Predicted vs measured training memory on a GPU, and the largest batch that really fits.

For each GPT size and precision: ``ampkit.plan.estimate.estimate`` (fake tensors, nothing allocated) vs
``torch.cuda.max_memory_allocated()`` over the second real training step (AdamW fused; the first
step creates the optimizer state, as in the estimate). Then, under a memory cap
(``torch.cuda.set_per_process_memory_fraction``), the largest batch found by real trial steps
(binary search on ``torch.OutOfMemoryError``) vs the estimate's ``largest_batch`` for that budget.

    python benchmarks/fit.py --sizes small,medium,large --precisions fp32,bf16,fp16,bf16-pure \
        --batch_size 8 --budget 8GiB
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from ampkit import MixedPrecision
from ampkit.models.builtin import builtin
from ampkit.plan.estimate import estimate, largest_batch, parse_bytes


def real_peak(size: str, precision: str, batch: int, dev: torch.device) -> int:
    """Peak bytes allocated during the second training step of a real run (raises on OOM)."""
    torch.manual_seed(0)
    model, data = builtin("gpt", size, batch_size=batch, device=dev)
    amp = MixedPrecision(precision, device=dev)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    model, opt = amp.setup(model, opt)
    try:
        for i in range(2):
            x, y = data(i)
            if i == 1:
                torch.cuda.synchronize(dev)
                torch.cuda.reset_peak_memory_stats(dev)
            with amp.autocast():
                loss = model(x, y)
            amp.backward(loss)
            amp.step(opt)
        torch.cuda.synchronize(dev)
        return torch.cuda.max_memory_allocated(dev)
    finally:
        del model, opt, amp, data
        gc.collect()
        torch.cuda.empty_cache()


def fits(size: str, precision: str, batch: int, dev: torch.device) -> bool:
    try:
        real_peak(size, precision, batch, dev)
        return True
    except torch.OutOfMemoryError:
        return False


def real_largest(
    size: str, precision: str, dev: torch.device, guess: int, limit: int = 4096
) -> int:
    """The largest batch whose two real steps run under the memory cap (binary search)."""
    lo, hi = 0, None
    b = max(1, guess)
    while hi is None or hi - lo > 1:
        if fits(size, precision, b, dev):
            lo = b
            b = min(limit, 2 * b) if hi is None else (lo + hi) // 2
            if lo >= limit:
                return lo
        else:
            hi = b
            b = (lo + hi) // 2
            if b == 0:
                return 0
    return lo


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", default="small,medium,large")
    ap.add_argument("--precisions", default="fp32,bf16,fp16,bf16-pure")
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--budget", default="8GiB", help="memory cap for the largest-batch search")
    ap.add_argument("--search_sizes", default="large", help="sizes to search the largest batch for")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(
        f"# {torch.cuda.get_device_name(dev)} · torch {torch.__version__} · batch {args.batch_size}"
    )
    rows = []
    print("| GPT | precision | predicted | measured | predicted/measured | estimate s |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for size in args.sizes.split(","):
        for p in args.precisions.split(","):
            model, data = builtin("gpt", size, batch_size=args.batch_size)
            t0 = time.perf_counter()
            est = estimate(
                lambda s=size: builtin("gpt", s, batch_size=1)[0], data(0), precision=p, device=dev
            )
            secs = time.perf_counter() - t0
            measured = real_peak(size, p, args.batch_size, dev)
            rows.append(
                {
                    "size": size,
                    "precision": p,
                    "batch": args.batch_size,
                    "predicted": est.peak_bytes,
                    "measured": measured,
                    "parts": est.parts,
                    "estimate_s": secs,
                }
            )
            print(
                f"| {size} | {p} | {est.peak_bytes / 2**20:,.0f} MiB | {measured / 2**20:,.0f} MiB | "
                f"{est.peak_bytes / measured:.3f} | {secs:.1f} |",
                flush=True,
            )
    budget = parse_bytes(args.budget)
    total = torch.cuda.get_device_properties(dev).total_memory
    torch.cuda.set_per_process_memory_fraction(budget / total, torch.cuda.current_device())
    print(f"\n# largest batch under a {args.budget} cap (set_per_process_memory_fraction)")
    print("| GPT | precision | estimate's largest | real largest |")
    print("| --- | --- | ---: | ---: |")
    search = []
    for size in args.search_sizes.split(","):
        for p in args.precisions.split(","):
            best, _ = largest_batch(
                lambda s=size: builtin("gpt", s, batch_size=1)[0],
                lambda b, s=size: builtin("gpt", s, batch_size=b)[1](0),
                budget,
                p,
                device=dev,
            )
            real = real_largest(size, p, dev, best)
            search.append({"size": size, "precision": p, "estimate": best, "real": real})
            print(f"| {size} | {p} | {best} | {real} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "device": torch.cuda.get_device_name(dev),
                    "torch": torch.__version__,
                    "peaks": rows,
                    "largest": search,
                },
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
