"""``ampkit bench`` and ``ampkit tune``: every precision side by side, then a recommendation."""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from ..choose.bench import DEFAULT_PRECISIONS
from ..step import tomlio
from ..step.hardware import normalize_device
from .common import (
    bounded,
    flag,
    model_and_data,
    model_label,
    output_file,
    positive_float,
    positive_int,
    seed_int,
    wide_console,
)
from .flags import model_flags, precision_list
from .invocation import Invocation


def _bench_report(args: argparse.Namespace) -> Any:
    from ..choose.bench import compare

    device = normalize_device(args.device)
    precisions = args.precisions  # checked by flags.precision_list
    if getattr(
        args, "rungs", False
    ):  # tune --rungs: every rung of bf16-pure's memory ladder is a candidate
        from ..choose.bench import with_rungs

        precisions = with_rungs(precisions)

    def factory() -> torch.nn.Module:
        return model_and_data(args, device)[0]

    _, batches = model_and_data(args, device)
    return compare(
        factory,
        batches,
        precisions,
        steps=args.steps,
        warmup=args.warmup,
        repeats=args.repeats,
        device=device,
        lr=args.lr,
        accumulation_steps=args.accumulation_steps,
        seed=args.seed,
        model_name=model_label(args),
        **{k: True for k in ("compile", "fp8_emulate") if getattr(args, k, False)},
    )


def cmd_bench(inv: Invocation) -> int:
    args = inv.args
    report = _bench_report(args)
    if args.json:
        tomlio.write(args.json, json.dumps(report.to_dict(), indent=2))  # atomically
    if args.plot:
        report.plot(args.plot)
    console = wide_console()
    console.print(report.table())
    for r in report.results:
        if r.status != "ok":
            console.print(f"[yellow]skipped {r.precision}[/]: {r.reason}")
    if args.json or args.plot:
        console.print("wrote " + " and ".join(x for x in (args.json, args.plot) if x))
    return 0


def cmd_tune(inv: Invocation) -> int:
    args = inv.args
    from ..choose.recommend import tune

    report = _bench_report(args)
    rec = tune(report, tolerance=args.tolerance)
    tomlio.write(args.out, rec.to_toml())
    if args.json:
        print(
            json.dumps(
                {"recommendation": rec.to_dict(), "bench": report.to_dict(losses=False)}, indent=2
            )
        )
        return 0
    console = wide_console()
    console.print(report.table())
    mem = f"{rec.bytes_per_param:.2f} B/param, " if rec.bytes_per_param is not None else ""
    why = "the fewest bytes per parameter" if rec.prefer == "memory" else "the fastest"
    console.print(
        f"[bold green]recommended: {rec.precision}[/] ({why} within the tolerance) — {mem}"
        f"{rec.speedup_vs_fp32:.2f}x fp32's speed, "
        f"final-loss gap {100 * rec.loss_gap:+.2f}% (tolerance {100 * rec.tolerance:g}%), "
        f"batch size {rec.batch_size}, accumulation {rec.accumulation_steps}"
    )
    if rec.note:
        console.print(f"[yellow]{rec.note}[/]")
    for name, why in rec.why_not.items():
        console.print(f"  {name}: {why}")
    console.print(f"timed: {rec.timed}")
    console.print(f"wrote {args.out}: use it with [bold]ampkit train --config {args.out}[/]")
    return 0


def add_parser(sub: Any) -> None:
    for cmd, helptext in (
        ("bench", "every precision side by side: speed, memory, fidelity"),
        ("tune", "measure, then recommend a precision within a fidelity tolerance"),
    ):
        p = sub.add_parser(cmd, help=helptext)
        model_flags(p, size="tiny")
        flag(
            p,
            "precisions",
            type=precision_list,
            default=None,
            help=f"comma-separated precisions (default: {','.join(DEFAULT_PRECISIONS)})",
        )
        flag(
            p,
            "steps",
            type=positive_int,
            default=30,
            help="timed optimizer steps per precision (default: 30)",
        )
        flag(p, "warmup", type=int, default=5, help="untimed steps first (default: 5)")
        flag(
            p,
            "repeats",
            type=positive_int,
            default=5,
            help="interleaved timing blocks (default: 5)",
        )
        flag(p, "batch_size", type=positive_int, default=16, help="micro-batch size (default: 16)")
        flag(
            p,
            "accumulation_steps",
            "grad_accum_steps",
            type=positive_int,
            default=1,
            help="micro-batches per step",
        )
        flag(p, "lr", type=positive_float, default=1e-3, help="AdamW learning rate")
        flag(p, "seed", type=seed_int, default=0, help="random seed")
        flag(
            p,
            "compile",
            action="store_true",
            help="torch.compile each model after setup (measured as such)",
        )
        flag(
            p,
            "fp8_emulate",
            action="store_true",
            help="let fp8 run without fp8 tensor cores (torchao emulation)",
        )
        if cmd == "bench":
            flag(
                p,
                "json",
                type=output_file,
                default=None,
                metavar="FILE",
                help="also write the results as JSON",
            )
            flag(
                p,
                "plot",
                type=output_file,
                default=None,
                metavar="FILE.png",
                help="speed-up and memory bars, loss curves",
            )
            p.set_defaults(func=cmd_bench)
        else:
            flag(
                p,
                "tolerance",
                type=bounded(float, ge=0, name="tolerance"),
                default=0.01,
                help="allowed final-loss gap to fp32, as a fraction of the fp32 loss (default: 0.01)",
            )
            flag(
                p,
                "out",
                type=output_file,
                default="ampkit-tune.toml",
                help="where to write the recommended config",
            )
            flag(
                p,
                "json",
                action="store_true",
                help="print the recommendation and measurements as JSON",
            )
            flag(
                p,
                "rungs",
                action="store_true",
                help="also measure every rung of bf16-pure's memory ladder (fp32, split, kahan, stochastic, "
                "stochastic+bf16 masters/states) and recommend the fewest bytes per parameter within the tolerance",
            )
            p.set_defaults(func=cmd_tune)
