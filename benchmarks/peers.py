"""ampkit vs the tools users would pick instead: a hand-written torch.amp loop, Hugging Face
Accelerate (``mixed_precision=``) and Lightning Fabric (``precision=``). Needs ``ampkit[bench]``.

Same model, same initial weights, same batches, fused AdamW, clipping at 1.0, for fp32 / bf16 /
fp16 where each tool supports it on the device. Blocks of steps rotate through the tools (order
shifted every round) so machine drift hits all alike. Prints ms/step, speed-up vs the tool's own
fp32, overhead vs the hand-written loop (median of paired block ratios), and final loss.

    python benchmarks/peers.py                         # CPU, gpt/tiny and mlp/small
    python benchmarks/peers.py --device cuda --gpt-size large --mlp-size large --batch-size 8
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time
import warnings

import torch
from overhead import ampkit_stepper, raw_stepper

from ampkit.models.builtin import builtin
from ampkit.step.hardware import device_info
from ampkit.step.precision import precision_row

warnings.filterwarnings("ignore")


def accelerate_stepper(model, opt, precision, device, clip):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    # Accelerate keeps one process-wide state; a new mixed_precision needs it reset first.
    AcceleratorState._reset_state(True)
    mp = precision_row(precision).accelerate_name  # fp32 -> "no": the precision row's column
    acc = Accelerator(mixed_precision=mp, cpu=device.type == "cpu")
    model, opt = acc.prepare(model, opt)

    def step(batch):
        loss = model(*batch)  # the prepared model autocasts its forward
        acc.backward(loss)
        acc.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def fabric_stepper(model, opt, precision, device, clip):
    from lightning.fabric import Fabric

    prec = precision_row(precision).lightning_name  # fp16 -> "16-mixed"
    fabric = Fabric(
        accelerator="cuda" if device.type == "cuda" else "cpu", devices=1, precision=prec
    )
    model, opt = fabric.setup(model, opt)

    def step(batch):
        loss = model(*batch)  # the wrapped module runs its forward in the precision's context
        fabric.backward(loss)
        fabric.clip_gradients(model, opt, max_norm=clip)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


TOOLS = {
    "raw": raw_stepper,
    "ampkit": ampkit_stepper,
    "accelerate": accelerate_stepper,
    "fabric": fabric_stepper,
}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(model_name, size, precision, device, args, base_ms):
    torch.manual_seed(0)
    base, data = builtin(
        model_name,
        size,
        batch_size=args.batch_size * (8 if model_name == "mlp" else 1),
        device=device,
    )
    base = base.to(device)
    batches = [data(i) for i in range(args.warmup + args.rounds * args.steps)]
    steppers, unsupported, losses = {}, {}, {}
    for tool, make in TOOLS.items():
        m = copy.deepcopy(base)
        o = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=device.type in ("cpu", "cuda"))
        try:
            steppers[tool] = make(m, o, precision, device, 1.0)
            losses[tool] = (m, data)
        except Exception as e:  # a tool that does not support this precision on this device
            unsupported[tool] = f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"
    for tool, step in list(steppers.items()):
        try:
            for i in range(args.warmup):
                step(batches[i])
        except Exception as e:
            unsupported[tool] = f"{type(e).__name__}: {str(e).splitlines()[0][:90]}"
            del steppers[tool]
    names = list(steppers)
    times = {t: [] for t in names}
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for t in order:
            sync(device)
            t0 = time.perf_counter()
            for i in range(args.steps):
                steppers[t](batches[args.warmup + r * args.steps + i])
            sync(device)
            times[t].append((time.perf_counter() - t0) / args.steps * 1e3)
    rows = []
    for t in TOOLS:
        if t in unsupported:
            rows.append({"tool": t, "precision": precision, "unsupported": unsupported[t]})
            continue
        ms = statistics.median(times[t])
        ratio = (
            statistics.median(a / b for a, b in zip(times[t], times["raw"]))
            if "raw" in times
            else None
        )
        m, data = losses[t]
        with torch.no_grad():
            evals = [
                float(m(*data(10_000 + k))) for k in range(3)
            ]  # held-out batches, the tool's own context
        rows.append(
            {
                "tool": t,
                "precision": precision,
                "ms": ms,
                "vs_raw": ratio,
                "speedup": (base_ms.get((t, model_name)) or ms) / ms
                if precision != "fp32"
                else 1.0,
                "final_loss": statistics.mean(evals),
            }
        )
        if precision == "fp32":
            base_ms[(t, model_name)] = ms
    return rows


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precisions", default="fp32,bf16,fp16")
    ap.add_argument("--gpt-size", default="tiny")
    ap.add_argument("--mlp-size", default="small")
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=5, help="steps per timed block")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    import accelerate
    import lightning

    device = torch.device(args.device)
    info = device_info(device)
    print(
        f"# {info.name} ({device}) · torch {torch.__version__} · accelerate {accelerate.__version__} · "
        f"lightning {lightning.__version__} · python {platform.python_version()} · threads {torch.get_num_threads()}"
    )
    base_ms: dict = {}
    all_rows = []
    for model_name, size in (("mlp", args.mlp_size), ("gpt", args.gpt_size)):
        for precision in args.precisions.split(","):
            for row in run(model_name, size, precision, device, args, base_ms):
                row["model"] = f"{model_name}/{size}"
                all_rows.append(row)
            print(f"  measured {model_name}/{size} {precision}", flush=True)
    print()
    print(
        "| model | precision | tool | ms/step | speed-up vs its fp32 | vs hand-written loop | final loss (held-out) |"
    )
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for r in all_rows:
        if "unsupported" in r:
            print(
                f"| {r['model']} | {r['precision']} | {r['tool']} | not supported: {r['unsupported']} | | | |"
            )
        else:
            print(
                f"| {r['model']} | {r['precision']} | {r['tool']} | {r['ms']:.2f} | {r['speedup']:.2f}x | "
                f"{r['vs_raw']:.3f} | {r['final_loss']:.4f} |"
            )


if __name__ == "__main__":
    main()
