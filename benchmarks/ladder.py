"""bf16-pure's memory ladder: optimizer-step time of each rung vs fp32 masters and torch's fused fp32 AdamW.

One model per rung (4 x Linear(1024, 1024): 4.2M parameters), fused AdamW, the same fixed random
gradients every step. Timed: ``amp.step(opt)`` (finite check, the optimizer step, the masters into
the model, zero_grad) -- for the torch row ``opt.step(); opt.zero_grad()`` on the fp32 model. The
half gradients are absorbed by ``amp.backward`` outside the timed region (the same for every
rung). Rungs are interleaved round by round in one process; the table gives the median per step.

    OMP_NUM_THREADS=1 python benchmarks/ladder.py                  # 4.2M params, 7 rounds x 10 steps
    python benchmarks/ladder.py --width 512 --rounds 3 --steps 5   # quicker
    python benchmarks/ladder.py --rungs split,kahan                # torch, fp32 masters and these
    python benchmarks/ladder.py --rungs split,kahan --eager        # + each with AMPKIT_NO_NATIVE=1

``--eager`` adds a row per split/kahan rung that steps with the eager passes (``AMPKIT_NO_NATIVE=1``
set around its steps) next to the native one-pass kernels (step/policies/native.py), interleaved.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
import warnings

import torch

from ampkit import MixedPrecision
from ampkit.observe.memory import breakdown
from ampkit.step.hardware import device_info
from ampkit.step.policies import native

RUNGS = [
    ("torch fused fp32 AdamW", None, None),
    ("fp32 masters", "fp32", "fp32"),
    ("split", "split", "fp32"),
    ("kahan", "kahan", "fp32"),
    ("stochastic", "stochastic", "fp32"),
    ("stochastic + bf16 states", "stochastic", "bf16"),
    ("none (forced)", "none", "fp32"),
]


class Rung:
    def __init__(
        self, label: str, masters, state_dtype, args: argparse.Namespace, eager: bool = False
    ) -> None:
        torch.manual_seed(args.seed)
        self.label, self.eager = label + (" (eager)" if eager else ""), eager
        self.dev = torch.device(args.device)
        self.model = torch.nn.Sequential(
            *[torch.nn.Linear(args.width, args.width) for _ in range(args.layers)]
        ).to(self.dev)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=True)
        self.amp = None
        if masters is not None:
            self.amp = MixedPrecision(
                "bf16-pure",
                device=self.dev,
                masters=masters,
                state_dtype=state_dtype,
                allow_stall=masters == "none",
            )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.model, self.opt = self.amp.setup(self.model, self.opt)
        g = torch.Generator().manual_seed(args.seed + 1)
        self.grads = [
            (torch.randn(p.shape, generator=g) * 1e-2).to(self.dev, p.dtype)
            for p in self.model.parameters()
        ]
        self.times: list[float] = []
        self.cpu: list[
            float
        ] = []  # this thread's CPU time per step: blind to time slices lost to other load
        self.step()  # creates the optimizer state
        self.bytes = self._bytes()

    def _prime(self) -> None:
        """Gradients in place for the next step (untimed)."""
        if self.amp is None:
            for p, g in zip(self.model.parameters(), self.grads):
                p.grad = g.clone()
            return
        params = list(self.model.parameters())
        loss = sum((p * g).sum() for p, g in zip(params, self.grads))  # d loss / d p = g
        self.amp.backward(loss)

    def step(self) -> float:
        self._prime()
        if self.eager:
            os.environ["AMPKIT_NO_NATIVE"] = "1"
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
        c, t = time.thread_time(), time.perf_counter()
        if self.amp is None:
            self.opt.step()
            self.opt.zero_grad(set_to_none=True)
        else:
            self.amp.step(self.opt)
        if self.dev.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter() - t
        self.cpu.append(time.thread_time() - c)
        if self.eager:
            del os.environ["AMPKIT_NO_NATIVE"]
        return t

    def _bytes(self) -> float:
        cats = breakdown(self.model, self.opt, self.amp).by_category
        n = sum(p.numel() for p in self.model.parameters())
        return (cats["parameters"] + cats["optimizer_state"] + cats["master_weights"]) / n


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--width", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--rungs",
        default="",
        help="comma-separated labels to time besides the first two "
        "(e.g. 'split,kahan'); default all",
    )
    ap.add_argument(
        "--device",
        default="cpu",
        help="cpu (default) or cuda (the eager passes: the C kernels are CPU-only)",
    )
    ap.add_argument(
        "--eager", action="store_true", help="also time split/kahan with AMPKIT_NO_NATIVE=1"
    )
    args = ap.parse_args()
    want = {w.strip() for w in args.rungs.split(",") if w.strip()}
    rungs = []
    for i, (label, m, s) in enumerate(RUNGS):
        if i < 2 or not want or label in want:
            rungs.append(Rung(label, m, s, args))
            if args.eager and m in ("split", "kahan"):
                rungs.append(Rung(label, m, s, args, eager=True))
    n = sum(p.numel() for p in rungs[0].model.parameters())
    print(
        f"# {device_info(args.device).name} · torch {torch.__version__} · python {platform.python_version()} · "
        f"{torch.get_num_threads()} thread(s) · {n / 1e6:.2f}M params · fused AdamW · {args.rounds} rounds x "
        f"{args.steps} steps, interleaved · native split/kahan kernels: {'on' if native.enabled() else 'off'}"
    )
    for _ in range(args.rounds):
        for r in rungs:
            r.times += [r.step() for _ in range(args.steps)]
    torch_ms = statistics.median(rungs[0].times) * 1e3
    master_ms = statistics.median(rungs[1].times) * 1e3
    torch_cpu, master_cpu = (statistics.median(r.cpu) * 1e3 for r in rungs[:2])
    print(
        f"{'rung':<26} {'B/param':>8} {'step ms':>8} {'vs fp32 masters':>16} {'vs torch fp32':>14} "
        f"{'CPU ms':>8} {'CPU vs masters':>15} {'CPU vs torch':>13}"
    )
    for r in rungs:
        ms, cpu = statistics.median(r.times) * 1e3, statistics.median(r.cpu) * 1e3
        print(
            f"{r.label:<26} {r.bytes:>8.2f} {ms:>8.2f} {ms / master_ms:>15.2f}x {ms / torch_ms:>13.2f}x "
            f"{cpu:>8.2f} {cpu / master_cpu:>14.2f}x {cpu / torch_cpu:>12.2f}x"
        )


if __name__ == "__main__":
    main()
