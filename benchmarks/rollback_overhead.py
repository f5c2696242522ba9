"""Spike rollback's cost on quiet steps: the same loop with and without an ``ampkit.SpikeGuard``.

Two identical (model, optimizer, engine) triples train on the same batches; blocks of steps
alternate between them (order flipped every block) so machine drift hits both alike. The guarded
one pays the device-side detector on every step and, every ``every`` steps, one read of the
detector plus a snapshot of the model, optimizer and engine state into host memory. The table
shows the median per-step time over whole intervals (snapshots included) and the ratio; a second
line times one snapshot alone.

    python benchmarks/rollback_overhead.py                          # CPU, MLP ~1M parameters
    python benchmarks/rollback_overhead.py --device cuda --width 2048 --every 20 50 100
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
from torch import nn

from ampkit import MixedPrecision, SpikeGuard


def build(width: int, depth: int, precision: str, device: str):
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    model = nn.Sequential(*layers, nn.Linear(width, 16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    amp = MixedPrecision(precision, device=device)
    model, opt = amp.setup(model, opt)
    return model, opt, amp


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(args: argparse.Namespace, precision: str, every: int) -> tuple[float, float, float]:
    plain = build(args.width, args.depth, precision, args.device)
    guarded = build(args.width, args.depth, precision, args.device)
    guard = SpikeGuard(*guarded, every=every, keep=2)
    g = torch.Generator().manual_seed(1)
    batches = [
        (
            torch.randn(args.batch, args.width, generator=g).to(args.device),
            torch.randn(args.batch, 16, generator=g).to(args.device),
        )
        for _ in range(16)
    ]
    pos = {"plain": 0, "guarded": 0}

    def steps(triple, n: int, name: str) -> float:
        model, opt, amp = triple
        sync(args.device)
        t0 = time.perf_counter()
        for _ in range(n):
            x, y = batches[pos[name] % len(batches)]
            with amp.autocast():
                loss = nn.functional.mse_loss(model(x).float(), y)
            amp.backward(loss)
            amp.step(opt)
            pos[name] = guard.check(pos[name] + 1) if name == "guarded" else pos[name] + 1
        sync(args.device)
        return (time.perf_counter() - t0) / n

    steps(plain, every, "plain"), steps(guarded, every, "guarded")  # warm-up: one interval each
    times: dict[str, list[float]] = {"plain": [], "guarded": []}
    for block in range(args.blocks):
        order = [("plain", plain), ("guarded", guarded)]
        for name, triple in order if block % 2 == 0 else order[::-1]:
            times[name].append(steps(triple, every, name))  # whole intervals: a snapshot each
    t0 = time.perf_counter()
    for _ in range(5):
        guard.start(pos["guarded"])
    snap = (time.perf_counter() - t0) / 5
    assert guard.rollbacks == 0, "a quiet run rolled back"
    return statistics.median(times["plain"]), statistics.median(times["guarded"]), snap


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument(
        "--blocks", type=int, default=6, help="alternating blocks (intervals) per configuration"
    )
    p.add_argument("--precisions", nargs="+", default=["bf16", "bf16-pure"])
    p.add_argument("--every", type=int, nargs="+", default=[20, 100])
    args = p.parse_args()
    params = sum(
        q.numel() for q in build(args.width, args.depth, "fp32", args.device)[0].parameters()
    )
    where = (
        torch.cuda.get_device_name()
        if args.device.startswith("cuda")
        else platform.processor() or "cpu"
    )
    print(
        f"# rollback overhead on quiet steps: MLP {params / 1e6:.2f}M params, batch {args.batch}, "
        f"{args.device} ({where}), torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    print(
        f"{'precision':<10} {'every':>5} {'plain ms/step':>14} {'guarded ms/step':>16} {'ratio':>6} "
        f"{'snapshot ms':>12}"
    )
    for precision in args.precisions:
        for every in args.every:
            plain, guarded, snap = run(args, precision, every)
            print(
                f"{precision:<10} {every:>5} {plain * 1e3:>14.3f} {guarded * 1e3:>16.3f} "
                f"{guarded / plain:>6.3f} {snap * 1e3:>12.2f}"
            )


if __name__ == "__main__":
    main()
