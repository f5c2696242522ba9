"""``ampkit audit``: per-layer numerics against an fp64/fp32 reference."""

from __future__ import annotations

import json
import re
from typing import Any

import torch
from rich.markup import escape

from ..step.hardware import normalize_device
from ..step.precision import PrecisionError
from .common import flag, model_and_data, positive_int, seed_int, wide_console
from .flags import model_flags, precision_help
from .invocation import Invocation


def cmd_audit(inv: Invocation) -> int:
    args = inv.args
    from ..observe.numerics import audit

    torch.manual_seed(args.seed)
    device = normalize_device(args.device)
    model, batches = model_and_data(args, device)
    model.to(device)
    batch = batches(0)
    inputs = batch if isinstance(batch, (tuple, list, dict)) else (batch,)
    try:
        report = audit(model, inputs, args.precision)
    except PrecisionError as e:  # audit has no fp8 emulation: leave out the hint to one
        raise PrecisionError(re.sub(r" \(or fp8_emulate=True[^)]*\)", "", str(e))) from None
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    console = wide_console()
    console.print(report.table(limit=args.top))
    keep = ", ".join(report.recommended_keep_fp32) or "none"
    console.print(f"[bold]keep in fp32:[/] {keep}")
    if report.recommended_init_scale:
        console.print(
            f"[bold]recommended init_scale:[/] {report.recommended_init_scale:g} "
            f"(largest reference gradient {report.max_grad:.3g})"
        )
    for note in report.notes:
        console.print(f"note: {escape(note)}")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("audit", help="per-layer numerics: what breaks in fp16/bf16 and why")
    model_flags(p, size="tiny")
    flag(
        p,
        "precision",
        default="fp16",
        help="the precision to audit against the fp64/fp32 reference: " + precision_help("fp16"),
    )
    flag(p, "batch_size", type=positive_int, default=4, help="example batch size (default: 4)")
    flag(p, "seed", type=seed_int, default=0, help="random seed")
    flag(p, "top", type=positive_int, default=25, help="rows to show (default: 25)")
    flag(p, "json", action="store_true", help="print the full report as JSON")
    p.set_defaults(func=cmd_audit)
