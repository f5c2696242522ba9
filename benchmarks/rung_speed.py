"""Whole-step time of each memory-ladder rung relative to bf16-pure with fp32 masters (issue 36 item 2).

Each (optimizer, rung) pair gets its own model (the embedding-heavy model of
``benchmarks/ladder_bytes.py``, smaller by default), the same batch every step. Timed: the whole
training step -- forward under autocast, ``amp.backward``, ``amp.step``, ``zero_grad``. Rungs are
interleaved block by block in one process; the table gives, per optimizer, the median over blocks
of each rung's step time over the fp32-masters step time of the same round (and the ratio of the
medians in brackets). Run with one torch thread on a quiet machine:

    OMP_NUM_THREADS=1 python benchmarks/rung_speed.py                      # AdamW fused/foreach, SGD
    python benchmarks/rung_speed.py --optimizers adamw-fused --rounds 9 --steps 2
    python benchmarks/rung_speed.py --profile bf16-pure:stochastic+bf16     # where one rung's time goes
    python benchmarks/rung_speed.py --fp32-grads-too   # each rung also with fp32 gradients (before)

``--fp32-grads-too`` adds, for each rung that keeps bf16 gradients (``split``, ``kahan``,
``stochastic``: :mod:`ampkit.step.policies.pure.grads`), a row run with the fp32 gradients kept
before (``grads.HALF_GRADS = False`` around its steps), interleaved with the others.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import torch

import ampkit
from ampkit.step.hardware import device_info
from ampkit.step.policies.pure import grads as kept_grads

RUNGS = (
    "bf16-pure:fp32",
    "bf16-pure:split",
    "bf16-pure:kahan",
    "bf16-pure:stochastic",
    "bf16-pure:fp32+bf16",
    "bf16-pure:split+bf16",
    "bf16-pure:stochastic+bf16",
)
OPTIMIZERS = {
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, fused=True),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True),
    "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, foreach=True),
}


class Model(torch.nn.Module):
    """An embedding (the largest tensor: stepped in pieces) and two linear layers."""

    def __init__(self, vocab: int, width: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.a, self.b = torch.nn.Linear(width, width), torch.nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.nn.functional.gelu(self.a(self.emb(x)))).float().pow(2).mean()


class MLP(torch.nn.Module):
    """``layers`` x (Linear(width, width), GELU): every parameter in a matmul (more compute per
    parameter than the embedding model, whose step the optimizer dominates)."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(
            *[m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.GELU())]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).float().pow(2).mean()


class Run:
    def __init__(
        self, spec: str, optimizer: str, args: argparse.Namespace, half: bool = True
    ) -> None:
        self.half = half
        torch.manual_seed(0)
        model = Model(args.vocab, args.width) if args.model == "embedding" else MLP(args.width, 4)
        self.amp = ampkit.MixedPrecision(spec, device="cpu", ladder_scratch_mib=args.scratch_mib)
        self.model, self.opt = self.amp.setup(model, OPTIMIZERS[optimizer](model.parameters()))
        self.times: list[float] = []

    def step(self, x: torch.Tensor) -> None:
        kept_grads.HALF_GRADS = self.half
        with self.amp.autocast():
            loss = self.model(x)
        self.amp.backward(loss)
        self.amp.step(self.opt)
        self.opt.zero_grad(set_to_none=True)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--model",
        choices=["embedding", "mlp"],
        default="embedding",
        help="embedding: an embedding (the largest tensor) + 2 linear layers, batch x tokens ids; "
        "mlp: 4 x (Linear(width, width), GELU) on batch*tokens rows",
    )
    ap.add_argument("--vocab", type=int, default=16_000)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=2, help="steps per block")
    ap.add_argument("--optimizers", default=",".join(OPTIMIZERS))
    ap.add_argument("--rungs", default=",".join(RUNGS))
    ap.add_argument("--scratch-mib", type=int, default=16, help="ladder_scratch_mib")
    ap.add_argument("--profile", default="", help="profile this rung's steps (torch.profiler)")
    ap.add_argument(
        "--fp32-grads-too",
        action="store_true",
        help="each rung keeping bf16 gradients also run with fp32 ones (module doc)",
    )
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(1)
    if args.model == "embedding":
        x = torch.randint(0, args.vocab, (args.batch, args.tokens), generator=gen)
    else:
        x = torch.randn(args.batch * args.tokens, args.width, generator=gen)
    rungs = [r.strip() for r in args.rungs.split(",") if r.strip()]
    if RUNGS[0] not in rungs:
        rungs.insert(0, RUNGS[0])
    optimizers = [o.strip() for o in args.optimizers.split(",") if o.strip()]
    if args.profile:
        run = Run(args.profile, optimizers[0], args)
        for _ in range(2):
            run.step(x)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps * 3):
                run.step(x)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
        return
    runs = {(o, r): Run(r, o, args) for o in optimizers for r in rungs}
    if args.fp32_grads_too:
        rungs = [
            x
            for r in rungs
            for x in ([r, f"{r} fp32-grads"] if r.split(":")[1].split("+")[0] != "fp32" else [r])
        ]
        for o in optimizers:
            for r in rungs:
                if r.endswith(" fp32-grads"):
                    runs[(o, r)] = Run(r.split()[0], o, args, half=False)
    for run in runs.values():  # warm: states made, kernels compiled
        for _ in range(2):
            run.step(x)
    for _ in range(args.rounds):
        for run in runs.values():
            t = time.perf_counter()
            for _ in range(args.steps):
                run.step(x)
            run.times.append((time.perf_counter() - t) / args.steps)
    n = sum(p.numel() for p in next(iter(runs.values())).model.parameters())
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"# {device_info('cpu').name} · torch {torch.__version__} · python {platform.python_version()}"
        f" · {torch.get_num_threads()} thread(s) · load {load:.1f} · {n / 1e6:.1f}M params"
        f" · {args.model} model · batch {args.batch}x{args.tokens}"
        f" · {args.rounds} rounds x {args.steps} steps"
    )
    print("| optimizer | rung | step (ms) | vs fp32 masters |")
    print("| --- | --- | ---: | ---: |")
    for o in optimizers:
        base = runs[(o, RUNGS[0])].times
        for r in rungs:
            ts = runs[(o, r)].times
            ratio = statistics.median(t / b for t, b in zip(ts, base))
            print(
                f"| {o} | `{r}` | {statistics.median(ts) * 1e3:.1f} | {ratio:.2f}x "
                f"({statistics.median(ts) / statistics.median(base):.2f}) |"
            )


if __name__ == "__main__":
    main()
