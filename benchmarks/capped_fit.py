"""A bigger model under a real memory cap: fp32 masters do not fit, a memory-ladder rung trains.

Each configuration runs in its own process under ``RLIMIT_DATA`` (the kernel's cap on a process's
data segment, which every CPU tensor allocation counts against: a refused ``mmap`` is torch's
"DefaultCPUAllocator: can't allocate memory"). The cap is the process's own data size once torch
is loaded and the batches exist, plus ``--budget`` bytes per parameter (14: between the rung's
~8 and fp32 masters' ~20 at AdamW's step). Reference: the same fp32-masters run with no cap.

    python benchmarks/capped_fit.py                       # the table (8.4M-parameter MLP, 300 steps)
    python benchmarks/capped_fit.py --width 512 --json    # smaller, one JSON line (the slow test runs this)

Every run (the reference too) gets the same fixed glibc mmap threshold: with glibc's dynamic one,
blocks of a MiB or more that were freed stay in the heap, and the data size of either configuration
wanders by tens of MiB from step to step (measured: 72-136 MiB above the set-up model for the rung,
37 MiB flat with the fixed threshold) -- the cap would measure the allocator, not the training.

Prints: per configuration, whether it fit, the step it stopped at, and the mean of its last 20
losses relative to the uncapped fp32-masters run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys

RUNGS = {  # name: MixedPrecision keyword arguments (all bf16-pure)
    "fp32 masters": {},
    "split": {"masters": "split"},
    "stochastic+bf16 states": {"masters": "stochastic", "state_dtype": "bf16"},
}


def _data_bytes() -> int:
    with open(f"/proc/{os.getpid()}/status") as f:
        for line in f:
            if line.startswith("VmData:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmData in /proc/self/status (Linux only)")


def _steps(amp, model, opt, batches) -> list[float]:
    import torch

    losses = []
    for x, y in batches:
        with amp.autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        amp.backward(loss)
        amp.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _warm_up(rung: str) -> None:
    import torch

    import ampkit

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8))
    amp = ampkit.MixedPrecision("bf16-pure", **RUNGS[rung])
    model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    _steps(amp, model, opt, [(torch.randn(4, 8), torch.randn(4, 8))] * 2)


def child(args: argparse.Namespace) -> dict:
    import torch

    import ampkit

    torch.set_num_threads(1)
    torch.manual_seed(0)
    w, n = args.width, args.layers
    teacher = torch.nn.Sequential(torch.nn.Linear(w, w), torch.nn.Tanh(), torch.nn.Linear(w, w))
    gen = torch.Generator().manual_seed(1)

    def batch() -> tuple[
        torch.Tensor, torch.Tensor
    ]:  # a fresh batch each step, the same in every run
        x = torch.randn(args.batch, w, generator=gen)
        with torch.no_grad():
            return x, teacher(x) + args.noise * torch.randn(args.batch, w, generator=gen)

    layers = []
    for _ in range(n):
        layers += [torch.nn.Linear(w, w), torch.nn.Tanh()]
    params = n * (w * w + w)
    batch()
    _warm_up(args.rung)  # every lazy import and kernel loaded before the reading
    base = _data_bytes()
    cap = base + args.budget * params if args.cap else None
    if cap is not None:
        resource.setrlimit(resource.RLIMIT_DATA, (cap, cap))
    torch.manual_seed(2)
    model = torch.nn.Sequential(*layers[:-1])
    amp = ampkit.MixedPrecision("bf16-pure", **RUNGS[args.rung])
    model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), lr=args.lr))
    losses: list[float] = []
    error = None
    try:
        for _ in range(args.steps):
            losses += _steps(amp, model, opt, [batch()])
    except (RuntimeError, MemoryError) as e:
        if isinstance(e, RuntimeError) and "can't allocate memory" not in str(e):
            raise
        error = (str(e).splitlines() or [type(e).__name__])[0][:160]
    return {
        "rung": args.rung,
        "params": params,
        "cap_mib": None if cap is None else round(cap / 2**20, 1),
        "base_mib": round(base / 2**20, 1),
        "steps_done": len(losses),
        "stopped": error,
        "last20": sum(losses[-20:]) / max(1, len(losses[-20:])) if losses else None,
    }


def run(args: argparse.Namespace, rung: str, cap: bool) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--child",
        "--rung",
        rung,
        "--width",
        str(args.width),
        "--layers",
        str(args.layers),
        "--batch",
        str(args.batch),
        "--steps",
        str(args.steps),
        "--lr",
        str(args.lr),
        "--noise",
        str(args.noise),
        "--budget",
        str(args.budget),
    ] + (["--cap"] if cap else [])
    env = dict(os.environ)
    if args.mmap_threshold:
        env["MALLOC_MMAP_THRESHOLD_"] = str(args.mmap_threshold)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{rung} (cap={cap}) failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument(
        "--noise", type=float, default=0.3, help="std of the noise on the teacher's targets"
    )
    p.add_argument(
        "--budget", type=int, default=14, help="bytes per parameter above the process's own data"
    )
    p.add_argument(
        "--mmap_threshold",
        type=int,
        default=262144,
        help="glibc's MALLOC_MMAP_THRESHOLD_ for every run (0: glibc's dynamic threshold, which keeps "
        "freed MiB-sized blocks in the heap: the data size then wanders by ~60 MiB from step to step)",
    )
    p.add_argument("--json", action="store_true", help="one JSON line instead of the table")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rung", default="fp32 masters", choices=sorted(RUNGS), help=argparse.SUPPRESS)
    p.add_argument("--cap", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return
    reference = run(args, "fp32 masters", cap=False)
    rows = [dict(reference, capped=False)] + [
        dict(run(args, r, cap=True), capped=True) for r in RUNGS
    ]
    for row in rows:
        ok = row["last20"] is not None and row["steps_done"] == args.steps
        row["vs_reference"] = row["last20"] / reference["last20"] - 1 if ok else None
    if args.json:
        print(json.dumps({"rows": rows, "steps": args.steps, "budget": args.budget}))
        return
    print(
        f"MLP {args.layers}x{args.width} ({reference['params'] / 1e6:.1f}M params) fitting a noisy teacher "
        f"(noise std {args.noise}), AdamW lr {args.lr}, "
        f"{args.steps} steps, batch {args.batch}, 1 thread; cap = own data + {args.budget} B/param"
    )
    print(
        f"{'bf16-pure rung':<24} {'cap MiB':>8} {'steps':>6} {'last-20 loss':>12}  {'vs uncapped fp32 masters':<25}"
    )
    for row in rows:
        cap = "none" if row["cap_mib"] is None else f"{row['cap_mib']:.0f}"
        vs = "out of memory" if row["stopped"] else f"{100 * row['vs_reference']:+.3f}%"
        last = "-" if row["stopped"] else f"{row['last20']:.5f}"
        print(f"{row['rung']:<24} {cap:>8} {row['steps_done']:>6} {last:>12}  {vs:<25}")


if __name__ == "__main__":
    main()
