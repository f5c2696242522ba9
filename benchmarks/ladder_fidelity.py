"""bf16-pure's memory ladder: does each rung train like fp32? (too slow for a test on 2 cores)

The built-in GPT (default: small), seed 0, the same batches, fused AdamW lr 1e-4, in fp32 and
in bf16-pure at every rung of the ladder. Prints the mean of the last 20 losses of each and the
gap to fp32 (the issue's bar: within 0.3% for every rung; ``none`` is the stall, shown for contrast).

    OMP_NUM_THREADS=1 python benchmarks/ladder_fidelity.py              # GPT small, 300 steps
    python benchmarks/ladder_fidelity.py --steps 100 --size tiny       # quicker
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
import warnings

import torch

from ampkit import MixedPrecision
from ampkit.models.builtin import builtin
from ampkit.step.hardware import device_info

RUNGS = [
    ("fp32", "fp32", None, None),
    ("bf16-pure fp32 masters", "bf16-pure", "fp32", "fp32"),
    ("split", "bf16-pure", "split", "fp32"),
    ("kahan", "bf16-pure", "kahan", "fp32"),
    ("stochastic", "bf16-pure", "stochastic", "fp32"),
    ("stochastic + bf16 states", "bf16-pure", "stochastic", "bf16"),
    ("none (forced)", "bf16-pure", "none", "fp32"),
]


def train(precision: str, masters, state_dtype, args: argparse.Namespace) -> list[float]:
    torch.manual_seed(args.seed)
    model, batches = builtin("gpt", args.size, batch_size=args.batch_size, seed=args.seed)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, fused=True)
    kw = (
        {}
        if masters is None
        else {"masters": masters, "state_dtype": state_dtype, "allow_stall": masters == "none"}
    )
    amp = MixedPrecision(precision, device="cpu", **kw)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = amp.setup(model, opt)
    losses = []
    for i in range(args.steps):
        x, y = batches(i)
        with amp.autocast():
            loss = model(x, y)
        amp.backward(loss)
        amp.step(opt)
        losses.append(float(loss.detach()))
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--size", default="small")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(
        f"# {device_info('cpu').name} · torch {torch.__version__} · python {platform.python_version()} · "
        f"GPT {args.size}, {args.steps} steps, batch {args.batch_size}, fused AdamW lr {args.lr}, seed {args.seed}"
    )
    print(f"{'run':<26} {'mean last 20':>12} {'vs fp32':>9} {'time s':>7}")
    ref = None
    for label, precision, masters, state_dtype in RUNGS:
        t = time.perf_counter()
        losses = train(precision, masters, state_dtype, args)
        mean = statistics.fmean(losses[-20:])
        ref = mean if ref is None else ref
        print(
            f"{label:<26} {mean:>12.4f} {100 * (mean / ref - 1):>+8.2f}% {time.perf_counter() - t:>7.1f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
