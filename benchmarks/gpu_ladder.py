"""The memory ladder on a GPU: bytes, peak and whole-step time per rung, and the largest GPT per rung.

Part 1 (``--part step``): a GPT-2 124M-shaped model (tied embedding, 50304 tokens, 12 x 768, 1024
positions), batch ``B`` x 1024, fused AdamW, eager. Per rung, alone on the device: bytes per
parameter still allocated after three steps (``torch.cuda.memory_allocated()``: weights, masters,
optimizer state, nothing else held by the script) and the peak of a step. Then every rung's model
at once, timed in interleaved rounds (CUDA events around whole steps), median per rung, relative to
bf16 autocast and to bf16-pure with fp32 masters.

Part 2 (``--part largest``): the deepest stack of GPT-2 blocks (768 wide, 12 heads; 128 tokens,
batch 1, fused AdamW) that really trains two steps on this GPU, per rung. The first depth tried
comes from the rung's measured bytes per parameter; then steps of ``--resolution`` up or down until
one depth trains and the next is out of memory (or the part's time is spent).

    python benchmarks/gpu_ladder.py --part step --batch 8
    python benchmarks/gpu_ladder.py --part largest --seconds 200
    python benchmarks/gpu_ladder.py --device cpu --tiny        # a smoke run of both parts
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import warnings

import torch

from ampkit import MixedPrecision
from ampkit.models.builtin import GPT, GPTConfig
from ampkit.step.hardware import device_info

# (label, precision, masters, state_dtype)
RUNGS = [
    ("bf16 autocast", "bf16", None, None),
    ("bf16-pure, fp32 masters", "bf16-pure", "fp32", "fp32"),
    ("split", "bf16-pure", "split", "fp32"),
    ("kahan", "bf16-pure", "kahan", "fp32"),
    ("stochastic", "bf16-pure", "stochastic", "fp32"),
    ("stochastic + bf16 states", "bf16-pure", "stochastic", "bf16"),
]
#: short names for --rungs, in RUNGS' order
SHORT = ["autocast", "fp32", "split", "kahan", "stochastic", "stochastic-bf16"]
BLOCK_PARAMS = 7_087_872  # one GPT-2 block at 768 wide (attention 2.36M + MLP 4.72M + 2 LayerNorms)


def gpt(cfg: GPTConfig, device: torch.device) -> GPT:
    with torch.device(device):
        model = GPT(cfg)
    model.lm_head.weight = model.wte.weight  # tied, as GPT-2
    return model


class Run:
    """One rung: its model, optimizer and engine, stepping on fixed random tokens."""

    def __init__(
        self, rung: tuple, cfg: GPTConfig, batch: int, device: torch.device, seed: int = 0
    ) -> None:
        self.label, precision, masters, state = rung
        torch.manual_seed(seed)
        self.device = device
        self.model = gpt(cfg, device)
        opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=device.type == "cuda")
        kw = {} if masters is None else {"masters": masters, "state_dtype": state}
        self.amp = MixedPrecision(precision, device=device, **kw)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.model, self.opt = self.amp.setup(self.model, opt)
        g = torch.Generator(device=device).manual_seed(seed + 1)
        self.x = torch.randint(
            0, cfg.vocab_size, (batch, cfg.block_size), device=device, generator=g
        )
        self.y = torch.randint(
            0, cfg.vocab_size, (batch, cfg.block_size), device=device, generator=g
        )
        self.params = sum(p.numel() for p in self.model.parameters())

    def step(self) -> None:
        with self.amp.autocast():
            loss = self.model(self.x, self.y)
        self.amp.backward(loss)
        self.amp.step(self.opt)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def part_step(args: argparse.Namespace, device: torch.device, out: dict) -> None:
    cfg = GPTConfig(
        vocab_size=50304,
        block_size=args.tokens,
        n_layer=args.layers,
        n_head=12 if not args.tiny else 2,
        n_embd=args.width,
    )
    rows = {}
    for rung in RUNGS:  # memory: each rung alone
        free()
        base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        r = Run(rung, cfg, args.batch, device)
        for _ in range(3):
            r.step()
        sync(device)
        row = {"params": r.params}
        if device.type == "cuda":
            row["bytes_per_param"] = (
                torch.cuda.memory_allocated() - base - r.x.nbytes - r.y.nbytes
            ) / r.params
            torch.cuda.reset_peak_memory_stats()
            r.step()
            sync(device)
            row["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        rows[r.label] = row
        print(f"  memory {r.label}: {row}", flush=True)
        del r
    free()
    runs = [Run(rung, cfg, args.batch, device) for rung in RUNGS]
    for r in runs:  # warm-up: optimizer state, kernels, allocator
        for _ in range(2):
            r.step()
    times: dict[str, list[float]] = {r.label: [] for r in runs}
    for _ in range(args.rounds):
        for r in runs:
            sync(device)
            t = time.perf_counter()
            for _ in range(args.steps):
                r.step()
            sync(device)
            times[r.label].append((time.perf_counter() - t) / args.steps * 1e3)
    base_ms = statistics.median(times[RUNGS[0][0]])
    fp32m_ms = statistics.median(times[RUNGS[1][0]])
    print(
        f"\n| rung | B/param after 3 steps | step peak MiB | ms/step (median of {args.rounds} x {args.steps}) "
        "| vs bf16 autocast | vs fp32 masters | spread |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in runs:
        ms = statistics.median(times[r.label])
        spread = (max(times[r.label]) - min(times[r.label])) / ms
        row = rows[r.label]
        row.update(ms=ms, vs_bf16=ms / base_ms, vs_fp32_masters=ms / fp32m_ms, spread=spread)
        print(
            f"| {r.label} | {row.get('bytes_per_param', float('nan')):.2f} | {row.get('peak_mib', float('nan')):,.0f} "
            f"| {ms:.2f} | {ms / base_ms:.2f}x | {ms / fp32m_ms:.2f}x | ±{spread / 2:.1%} |",
            flush=True,
        )
    out["step"] = {"config": vars(cfg), "batch": args.batch, "rows": rows}
    del runs
    free()


def trains(rung: tuple, depth: int, device: torch.device, tiny: bool) -> bool:
    cfg = GPTConfig(
        vocab_size=50304 if not tiny else 256,
        block_size=128,
        n_layer=depth,
        n_head=12 if not tiny else 2,
        n_embd=768 if not tiny else 64,
    )
    r = None
    try:
        r = Run(rung, cfg, 1, device)
        for _ in range(2):
            r.step()
        sync(device)
        return True
    except torch.OutOfMemoryError:
        return False
    finally:
        del r
        free()


def part_largest(args: argparse.Namespace, device: torch.device, out: dict) -> None:
    budget = (
        torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 2**31
    )
    bpp = {
        label: row.get("bytes_per_param")
        for label, row in out.get("step", {}).get("rows", {}).items()
    }
    default_bpp = {
        "bf16 autocast": 16,
        "bf16-pure, fp32 masters": 14,
        "split": 12,
        "kahan": 12,
        "stochastic": 10,
        "stochastic + bf16 states": 6,
    }
    print(
        "\n| rung | largest depth that trained | parameters | next depth tried (out of memory) | attempts | s |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    rows = {}
    chosen = [r for r, short in zip(RUNGS, SHORT) if short in args.rungs.split(",")]
    per_rung = args.seconds / len(chosen)
    for rung in chosen:
        label = rung[0]
        t0 = time.perf_counter()
        # + the gradients (bf16 or fp32) and, under autocast, the forward's bf16 copies of the weights
        b = (bpp.get(label) or default_bpp[label]) + (2 if rung[1] == "bf16-pure" else 4 + 2)
        depth = max(1, int(budget * 0.92 / b / BLOCK_PARAMS)) if not args.tiny else 2
        good, bad, attempts = None, None, 0
        while time.perf_counter() - t0 < per_rung and attempts < args.max_attempts:
            attempts += 1
            if trains(rung, depth, device, args.tiny):
                good = depth
                if bad is not None and bad - good <= max(1, int(good * args.resolution)):
                    break
                depth = (
                    depth + max(1, int(depth * 2 * args.resolution))
                    if bad is None
                    else (good + bad) // 2
                )
            else:
                bad = depth
                if good is not None and bad - good <= max(1, int(good * args.resolution)):
                    break
                depth = (
                    depth - max(1, int(depth * args.resolution))
                    if good is None
                    else (good + bad) // 2
                )
        params = 50304 * 768 + 128 * 768 + 2 * 768 + (good or 0) * BLOCK_PARAMS
        rows[label] = {
            "depth": good,
            "oom_depth": bad,
            "params": params if good else None,
            "attempts": attempts,
        }
        print(
            f"| {label} | {good} | {params / 1e9:.2f} B | {bad} | {attempts} | {time.perf_counter() - t0:.0f} |",
            flush=True,
        )
    out["largest"] = {"budget_bytes": budget, "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--part", default="all", choices=["step", "largest", "all"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument(
        "--seconds", type=float, default=240, help="time for part 2, shared by the rungs"
    )
    ap.add_argument(
        "--resolution", type=float, default=0.03, help="part 2's step, a fraction of the depth"
    )
    ap.add_argument("--max_attempts", type=int, default=5)
    ap.add_argument(
        "--tiny", action="store_true", help="a small model (a smoke run, e.g. on the CPU)"
    )
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--rungs", default=",".join(SHORT), help=f"part 2's rungs, comma-separated from {SHORT}"
    )
    ap.add_argument(
        "--bytes_from", default=None, help="part 1's --json: its bytes per parameter seed part 2"
    )
    args = ap.parse_args()
    unknown = set(args.rungs.split(",")) - set(SHORT)
    if unknown:
        ap.error(f"--rungs: unknown {sorted(unknown)}; choose from {SHORT}")
    args.tokens, args.layers, args.width = (1024, 12, 768) if not args.tiny else (32, 2, 64)
    device = torch.device(args.device)
    print(
        f"# {device_info(args.device).name} · torch {torch.__version__} · GPT-2 124M shape (tied), batch "
        f"{args.batch} x {args.tokens}, fused AdamW, eager",
        flush=True,
    )
    out: dict = {"device": device_info(args.device).name, "torch": torch.__version__}
    if args.bytes_from:
        with open(args.bytes_from) as f:
            out["step"] = json.load(f)["step"]
    if args.part in ("step", "all"):
        part_step(args, device, out)
    if args.part in ("largest", "all"):
        part_largest(args, device, out)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
