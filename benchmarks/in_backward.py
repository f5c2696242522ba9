"""The optimizer stepping in backward (``optimizer_in_backward``): the training step's peak memory
and time, with and without it, on a model whose largest tensor is an embedding (+ an MLP).

Per configuration (precision/rung x ordinary/in backward), interleaved round by round in one
process: the whole step's CPU time (forward, backward, ``amp.step``; CPU time rather than wall
time, which a shared machine's waits disturb more), median per step; and, from one
step run under the planner's ``StepTracker`` (every storage, counted once), the step's
peak live bytes and the gradient bytes held at the end of the backward. ``--rss`` also runs each
configuration in a fresh process and reports its peak RSS (``VmHWM``: the allocator's view, noisier).

    OMP_NUM_THREADS=1 python benchmarks/in_backward.py --rss            # 34.1M params (25.7M embedding)
    python benchmarks/in_backward.py --vocab 8192 --blocks 8            # an MLP-heavy model
    python benchmarks/in_backward.py --configs 0 --rounds 2 --steps 2   # bf16 only, quicker
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from ampkit import MixedPrecision

try:  # the planner's tracker: ampkit.plan after issue 35's split of loop/, ampkit.loop before
    from ampkit.plan.tracker import StepTracker
except ImportError:
    from ampkit.loop.tracker import StepTracker

CONFIGS = [("bf16", {}), ("bf16-pure", {}), ("bf16-pure", {"masters": "split"})]


class EmbeddingMLP(torch.nn.Module):
    def __init__(self, vocab: int, dim: int, hidden: int, blocks: int, classes: int) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, dim)
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(
                torch.nn.LayerNorm(dim),
                torch.nn.Linear(dim, hidden),
                torch.nn.GELU(),
                torch.nn.Linear(hidden, dim),
            )
            for _ in range(blocks)
        )
        self.head = torch.nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h.mean(1))


class Run:
    def __init__(self, precision: str, rung: dict, inb: bool, args: argparse.Namespace) -> None:
        torch.manual_seed(0)
        self.model = EmbeddingMLP(args.vocab, args.dim, args.hidden, args.blocks, args.classes)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, fused=True)
        self.amp = MixedPrecision(precision, device="cpu", optimizer_in_backward=inb, **rung)
        self.amp.setup(self.model, self.opt)
        g = torch.Generator().manual_seed(1)
        self.x = torch.randint(0, args.vocab, (args.batch, args.tokens), generator=g)
        self.y = torch.randint(0, args.classes, (args.batch,), generator=g)
        self.label = f"{precision}{':' + rung['masters'] if rung else ''}, {'in backward' if inb else 'ordinary'}"

    def step(self, tracker: StepTracker | None = None) -> int:
        with self.amp.autocast():
            loss = F.cross_entropy(self.model(self.x).float(), self.y)
        if tracker is not None:
            tracker.backward()
        self.amp.backward(loss)
        held = sum(
            t.grad.nbytes
            for t in [*self.model.parameters(), *self.amp.master_params()]
            if t.grad is not None
        )
        if tracker is not None:
            tracker.optimizer()
        self.amp.step(self.opt)
        return held

    def tracked(self) -> tuple[int, int]:
        """The second of two tracked steps: the first makes every storage the step touches known to
        the tracker (the ladder's reusable chunk buffers, which no tensor of the model names)."""
        tracker = StepTracker()
        tracker.track_external(self.model, self.opt, *self.amp.master_params())
        with tracker:
            self.step(tracker)
            mark = len(tracker.timeline)
            held = self.step(tracker)
        return max(tracker.timeline[mark:]), held


def rss_child(args: argparse.Namespace) -> None:
    precision, rung, inb = CONFIGS[args.child][0], CONFIGS[args.child][1], bool(args.inb)
    run = Run(precision, rung, inb, args)
    for _ in range(3):
        run.step()
    # VmHWM, not getrusage's ru_maxrss: Linux keeps ru_maxrss across fork + exec, so a child would
    # report its parent's peak
    with open("/proc/self/status") as fh:
        hwm = next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmHWM:"))
    print(json.dumps({"rss": hwm}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--classes", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument(
        "--rss", action="store_true", help="also each configuration's peak RSS in a fresh process"
    )
    ap.add_argument(
        "--configs", default="0,1,2", help="which of bf16, bf16-pure, bf16-pure:split (indices)"
    )
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--inb", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        rss_child(args)
        return
    chosen = [CONFIGS[int(i)] for i in args.configs.split(",")]
    rss = {}
    if args.rss:  # first: the children's own peaks, each in a fresh process
        for i in args.configs.split(","):
            for inb in (0, 1):
                cmd = [
                    sys.executable,
                    __file__,
                    "--child",
                    i,
                    "--inb",
                    str(inb),
                    *[
                        f"--{k}={getattr(args, k)}"
                        for k in ("vocab", "dim", "hidden", "blocks", "classes", "batch", "tokens")
                    ],
                ]
                out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
                rss[(int(i), inb)] = json.loads(out.strip().splitlines()[-1])["rss"]
    runs = [Run(p, r, inb, args) for p, r in chosen for inb in (False, True)]
    params = sum(p.numel() for p in runs[0].model.parameters())
    print(
        f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s); {params / 1e6:.1f}M parameters "
        f"({runs[0].model.emb.weight.numel() / 1e6:.1f}M in the embedding), batch {args.batch}x{args.tokens}"
    )
    mem = {}
    for r in runs:
        r.step()  # the optimizer state exists
        mem[r.label] = r.tracked()
    times: dict[str, list[float]] = {r.label: [] for r in runs}
    for _ in range(args.rounds):
        for r in runs:
            t0 = (
                time.process_time()
            )  # CPU time: less sensitive than wall time to a shared machine's waits
            for _ in range(args.steps):
                r.step()
            times[r.label].append((time.process_time() - t0) / args.steps)
    print(
        "| configuration | step peak (MiB) | gradients held after backward (MiB) | step CPU time (ms) | time ratio |"
        + (" peak RSS (MiB) |" if rss else "")
    )
    print("| --- | ---: | ---: | ---: | ---: |" + (" ---: |" if rss else ""))
    for i, r in enumerate(runs):
        base = runs[i - i % 2].label
        med, ref = statistics.median(times[r.label]), statistics.median(times[base])
        peak, held = mem[r.label]
        line = f"| {r.label} | {peak / 2**20:.1f} | {held / 2**20:.1f} | {med * 1e3:.1f} | {med / ref:.3f} |"
        if rss:
            idx = int(args.configs.split(",")[i // 2])
            line += f" {rss[(idx, i % 2)] / 2**20:.0f} |"
        print(line)


if __name__ == "__main__":
    main()
