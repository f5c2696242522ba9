"""``ampkit explain``: the precision manifest of a model -- what dtype each thing is actually in."""

from __future__ import annotations

import json
from typing import Any

import torch

from ..loop.steps import Steps
from ..step.engine import MixedPrecision
from ..step.hardware import normalize_device
from ..step.precision import PrecisionError
from .common import flag, model_and_data, positive_int, seed_int
from .flags import model_flags, precision_help
from .invocation import Invocation


def explain(args: Any) -> tuple[MixedPrecision, list[dict[str, Any]]]:
    """Set the model up in ``args.precision`` with fused AdamW, take one optimizer step on its data
    (so the optimizer state exists), and return the engine and the ``manifest_violation`` events its
    setup check found (none: the run is clean)."""
    torch.manual_seed(args.seed)
    device = normalize_device(args.device)
    model, batches = model_and_data(args, device)
    keep = tuple(k for k in (args.keep_fp32 or "").split(",") if k.strip())
    try:
        amp = MixedPrecision(
            args.precision,
            device=device,
            accumulation_steps=args.accumulation_steps,
            keep_fp32=keep,
            **({"fp8_emulate": True} if args.fp8_emulate else {}),
        )
    except PrecisionError as e:  # the library's spelling of the way out, as the flag
        raise PrecisionError(str(e).replace("fp8_emulate=True", "--fp8_emulate")) from None
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=device.type in ("cuda", "cpu"))
    model, optimizer = amp.setup(model, optimizer)
    run = Steps(model, optimizer, amp)
    run.optimizer_step(batches, 0, count=args.accumulation_steps)
    return amp, [e.to_dict() for e in amp.events if e.kind == "manifest_violation"]


def cmd_explain(inv: Invocation) -> int:
    args = inv.args
    amp, violations = explain(args)
    manifest = amp.manifest()
    if args.json:
        print(json.dumps({**manifest.to_dict(), "violations": violations}, indent=2))
        return 0
    print(manifest.table(collapse=not args.all))
    if not violations:
        print("checks: no silent downgrade found")
    for v in violations:
        print(f"VIOLATION {v['param']} [{v['component']}]: {v['detail']}")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "explain",
        help="the precision manifest: each parameter's storage, compute, gradient, "
        "accumulation, reduce, master and optimizer-state dtypes, and the loss scaling",
    )
    model_flags(p, size="tiny")
    flag(p, "precision", default="bf16", help="the precision to explain: " + precision_help("bf16"))
    flag(
        p,
        "keep_fp32",
        default=None,
        metavar="GLOBS",
        help="modules to keep in fp32, comma-separated "
        "qualified-name globs, e.g. '*.ln*,lm_head' (default: none)",
    )
    flag(
        p,
        "accumulation_steps",
        type=positive_int,
        default=1,
        help="micro-steps per optimizer step (default: 1)",
    )
    flag(
        p,
        "batch_size",
        type=positive_int,
        default=2,
        help="batch size of the one step taken (default: 2)",
    )
    flag(p, "seed", type=seed_int, default=0, help="random seed")
    flag(
        p,
        "all",
        action="store_true",
        help="one row per parameter (default: a module's agreeing rows merged)",
    )
    flag(
        p,
        "fp8_emulate",
        action="store_true",
        help="let fp8 run without fp8 tensor cores (torchao emulation): see its Linears converted",
    )
    flag(p, "json", action="store_true", help="print the manifest and the violations as JSON")
    p.set_defaults(func=cmd_explain)
