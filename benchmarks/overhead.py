"""ampkit vs the hand-written torch.amp loop: per-step overhead, alternating in one process.

For each model and precision, two identical (model, optimizer) pairs are trained side by side:
one by the nanoGPT-style loop (torch.autocast + torch.amp.GradScaler, unscale, clip, step,
update), one by ampkit (autocast / backward / step). ``--mode default`` compares ampkit with
its *default* settings (no clipping, non-finite steps skipped in every precision) against the
plain loop users write without clipping: autocast, backward, ``opt.step()`` (a GradScaler only
for fp16) -- the loop does no finite check at all, so the ratio is the check's whole cost. Blocks
of steps alternate between the two
(order flipped every block) so machine drift hits both alike; the table shows the median
per-step time of each and their ratio. A last table gives the bf16-vs-fp32 speed-up of the GPT.

    python benchmarks/overhead.py                      # CPU defaults
    python benchmarks/overhead.py --device cuda --gpt-size medium --mlp-size medium
    python benchmarks/overhead.py --cpu-check          # bf16 step cost: clip/no clip x 1/2 threads

``--cpu-check`` records the CPU step's cost (issue 34 §6; targets ampkit/raw <= 1.03 without
clipping, <= 1.01 with it): bf16, without and with clipping, on 1 and 2 threads, for an MLP of
width 512 at batch 64 and the built-in mlp/small at batch 128, fused AdamW, each against the
hand-written loop; without clipping it also times ampkit with ``skip_nonfinite=False``, so the
finite check's own share shows (the raw loop checks nothing without clipping; with clipping both
compute the norm, the raw loop checks nothing and ampkit skips a step whose norm is inf/NaN). The
machine is named by ``ampkit info``'s CPU line.
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time

import torch

from ampkit import MixedPrecision
from ampkit.models.builtin import MLP, MLPConfig, build
from ampkit.models.data import ClassificationBatches, TextBatches
from ampkit.step.hardware import cpu_features, device_info

DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def raw_stepper(model, opt, precision, device, clip):
    dtype = DTYPES[precision]
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    def step(batch):
        with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = model(*batch)
        scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)

    return step


def ampkit_stepper(model, opt, precision, device, clip, **overrides):
    amp = MixedPrecision(precision, device=device, clip_grad_norm=clip, **overrides)
    model, opt = amp.setup(model, opt)

    def step(batch):
        with amp.autocast():
            loss = model(*batch)
        amp.backward(loss)
        amp.step(opt)

    return step


#: what a block is timed by: wall time, or with ``--clock cpu`` this process's CPU time (on a loaded
#: machine it leaves out the time the process waits for a core; CPU only)
CLOCK = {"clock": time.perf_counter}


def time_block(step, batches, start, n, device):
    clock = CLOCK["clock"]
    sync(device)
    t0 = clock()
    for i in range(n):
        step(batches[(start + i) % len(batches)])
    sync(device)
    return (clock() - t0) / n


def measure(model_name, size, precision, device, args):
    torch.manual_seed(0)
    if model_name == "mlp" and args.mlp_width:
        base = MLP(MLPConfig(in_features=args.mlp_width, hidden=args.mlp_width, n_layer=3)).to(
            device
        )
    else:
        base = build(model_name, size).to(device)
    if model_name == "gpt":
        data = TextBatches(
            batch_size=args.batch_size, block_size=base.config.block_size, device=device
        )
    else:
        data = ClassificationBatches(
            batch_size=args.mlp_batch, in_features=base.config.in_features, device=device
        )
    batches = [data(i) for i in range(16)]
    fused = device.type in ("cpu", "cuda")
    steppers = {}
    clip = 1.0 if args.mode == "clip" else None
    kinds = [("raw", raw_stepper, {}), ("ampkit", ampkit_stepper, {})]
    if getattr(args, "no_check_too", False) and clip is None and precision != "fp16":
        kinds.append(("nocheck", ampkit_stepper, {"skip_nonfinite": False}))
    for kind, make, overrides in kinds:
        m = copy.deepcopy(base)
        o = torch.optim.AdamW(m.parameters(), lr=1e-4, fused=fused)
        steppers[kind] = make(m, o, precision, device, clip, **overrides)
    for s in steppers.values():  # warm-up
        time_block(s, batches, 0, args.warmup, device)
    times = {kind: [] for kind in steppers}
    order = list(steppers)
    for b in range(args.blocks):
        for kind in order if b % 2 == 0 else order[::-1]:
            times[kind].append(
                time_block(steppers[kind], batches, b * args.steps, args.steps, device)
            )
    raw, amp = statistics.median(times["raw"]), statistics.median(times["ampkit"])
    # Adjacent blocks form pairs; the median of the paired ratios is robust to slow drift.
    ratios = sorted(a / r for a, r in zip(times["ampkit"], times["raw"]))
    label = (
        f"mlp/w{args.mlp_width}"
        if model_name == "mlp" and args.mlp_width
        else f"{model_name}/{size}"
    )
    row = {
        "model": label,
        "precision": precision,
        "raw_ms": raw * 1e3,
        "ampkit_ms": amp * 1e3,
        "ratio": statistics.median(ratios),
        "ratio_p10": ratios[len(ratios) // 10],
        "ratio_p90": ratios[(9 * len(ratios)) // 10],
        "ratio_min": min(times["ampkit"]) / min(times["raw"]),
    }
    for kind in ("nocheck",):
        if kind in times:
            row[f"{kind}_ratio"] = statistics.median(
                sorted(a / r for a, r in zip(times[kind], times["raw"]))
            )
    return row


def machine_line(device):
    """The machine, as ``ampkit info`` names it: the device and its CPU line."""
    info = device_info(device)
    cpu = cpu_features()
    return (
        f"{info.name} ({device}) · CPU ISA: {', '.join(cpu.flags) or 'none of interest'} "
        f"(ATen dispatch: {cpu.capability}) · torch {torch.__version__} · python {platform.python_version()}"
    )


def cpu_check(args):
    """bf16, clip and no clip, 1 and 2 threads, MLP w512/b64 and mlp/small/b128 (module doc)."""
    device = torch.device("cpu")
    print(f"# {machine_line(device)} · clock: {args.clock}")
    cases = [("mlp/w512, batch 64", 512, 64), ("mlp/small, batch 128", 0, 128)]
    rows = []
    for threads in [int(t) for t in args.check_threads.split(",")]:
        torch.set_num_threads(threads)
        for label, width, batch in cases:
            for mode in ("default", "clip"):
                sub = argparse.Namespace(
                    **{
                        **vars(args),
                        "mode": mode,
                        "mlp_width": width,
                        "mlp_batch": batch,
                        "no_check_too": True,
                    }
                )
                r = measure("mlp", "small", "bf16", device, sub)
                r.update(
                    case=label, threads=threads, mode="clip 1.0" if mode == "clip" else "no clip"
                )
                rows.append(r)
                print(
                    f"  measured {label:<22} {r['mode']:<8} {threads} thread(s): ratio {r['ratio']:.3f}",
                    flush=True,
                )
    print()
    print(
        "| case | threads | clipping | raw ms/step | ampkit/raw (median of paired blocks) | p10–p90 | "
        "min/min | skip_nonfinite=False / raw | target |"
    )
    print("| --- | ---: | --- | ---: | ---: | --- | ---: | ---: | ---: |")
    for r in rows:
        target = "≤ 1.01" if r["mode"].startswith("clip") else "≤ 1.03"
        nocheck = f"{r['nocheck_ratio']:.3f}" if "nocheck_ratio" in r else "—"
        print(
            f"| {r['case']} | {r['threads']} | {r['mode']} | {r['raw_ms']:.2f} | {r['ratio']:.3f} | "
            f"{r['ratio_p10']:.3f}–{r['ratio_p90']:.3f} | {r['ratio_min']:.3f} | {nocheck} | {target} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_line(device), "rows": rows}, f, indent=2)


def main():
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--precisions", default="fp32,bf16,fp16")
    ap.add_argument("--mlp-size", default="small")
    ap.add_argument("--gpt-size", default="tiny")
    ap.add_argument("--batch-size", type=int, default=16, help="GPT batch size")
    ap.add_argument("--mlp-batch", type=int, default=128, help="MLP batch size")
    ap.add_argument(
        "--mlp-width",
        type=int,
        default=0,
        help="MLP in/hidden width instead of --mlp-size (e.g. 512)",
    )
    ap.add_argument(
        "--mode",
        choices=["clip", "default"],
        default="default",
        help="clip: both loops clip to 1.0; default: ampkit's defaults vs the plain loop (no clipping)",
    )
    ap.add_argument("--models", default="mlp,gpt", help="which of mlp,gpt to measure")
    ap.add_argument("--steps", type=int, default=10, help="steps per timed block")
    ap.add_argument("--blocks", type=int, default=10, help="timed blocks per side")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads on CPU (0: leave)")
    ap.add_argument("--json", default=None, help="also write results to this file")
    ap.add_argument(
        "--cpu-check",
        action="store_true",
        help="bf16 without/with clipping on 1 and 2 threads, MLP w512/b64 and mlp/small (module doc)",
    )
    ap.add_argument("--check-threads", default="1,2", help="--cpu-check: the thread counts")
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="time blocks by wall time or by this process's CPU time (a loaded machine, CPU only)",
    )
    args = ap.parse_args()
    if args.clock == "cpu":
        CLOCK["clock"] = time.process_time
    if args.cpu_check:
        return cpu_check(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    info = device_info(device)
    print(
        f"# {info.name} ({device}) · torch {torch.__version__} · python {platform.python_version()} · "
        f"threads {torch.get_num_threads()} · mode {args.mode}"
    )
    rows = []
    for model_name, size in (("mlp", args.mlp_size), ("gpt", args.gpt_size)):
        if model_name not in args.models.split(","):
            continue
        for precision in args.precisions.split(","):
            rows.append(measure(model_name, size, precision, device, args))
            r = rows[-1]
            print(
                f"  measured {r['model']:<12} {r['precision']:<5} ratio {r['ratio']:.3f}",
                flush=True,
            )
    print()
    print(
        "| model | precision | raw ms/step | ampkit ms/step | ampkit/raw (median of paired blocks) "
        "| p10–p90 of paired ratios |"
    )
    print("| --- | --- | ---: | ---: | ---: | --- |")
    for r in rows:
        print(
            f"| {r['model']} | {r['precision']} | {r['raw_ms']:.2f} | {r['ampkit_ms']:.2f} | "
            f"{r['ratio']:.3f} | {r['ratio_p10']:.3f}–{r['ratio_p90']:.3f} |"
        )
    gpt = {r["precision"]: r for r in rows if r["model"].startswith("gpt")}
    if "fp32" in gpt:
        print()
        print("| GPT speed-up vs fp32 | raw loop | ampkit |")
        print("| --- | ---: | ---: |")
        for p, r in gpt.items():
            print(
                f"| {p} | {gpt['fp32']['raw_ms'] / r['raw_ms']:.2f}x "
                f"| {gpt['fp32']['ampkit_ms'] / r['ampkit_ms']:.2f}x |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"device": info.to_dict(), "torch": torch.__version__, "rows": rows}, f, indent=2
            )


if __name__ == "__main__":
    main()
