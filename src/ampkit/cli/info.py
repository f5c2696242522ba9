"""``ampkit info``: the hardware, what each precision does here, and what ``auto`` picks."""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any, Optional

import torch

from .. import __version__
from ..step.hardware import cpu_features, device_info, normalize_device
from ..step.precision import (
    CANONICAL,
    DESCRIPTIONS,
    PrecisionError,
    cpu_emulation_note,
    resolve_precision,
)
from .common import flag
from .invocation import Invocation


def _measure_matmul(device: torch.device, dtype: torch.dtype, n: int, budget_s: float = 0.15) -> float:
    """TFLOP/s of an n x n matmul in ``dtype`` on ``device`` (a rough, quick figure)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    for _ in range(2):
        a @ b
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    reps, t0 = 0, time.perf_counter()
    while True:
        a @ b
        reps += 1
        if reps % 4 == 0:
            sync()
            if time.perf_counter() - t0 > budget_s:
                break
    return 2 * n**3 * reps / (time.perf_counter() - t0) / 1e12


def info_report(device: Optional[str] = None, measure: bool = True) -> dict[str, Any]:
    """Everything ``ampkit info`` shows, as a dict (``--json`` prints exactly this)."""
    dev = normalize_device(device)
    info = device_info(dev)
    auto = resolve_precision("auto", info)
    speeds: dict[str, float] = {}
    if measure:
        n = 2048 if dev.type == "cuda" else 512
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
            with contextlib.suppress(RuntimeError):
                speeds[name] = _measure_matmul(dev, dtype, n)
    precisions = []
    for name in CANONICAL[1:]:
        try:
            p = resolve_precision(name, info)
            row = {"name": name, "runs": True, "reason": p.reason, "what": DESCRIPTIONS[name],
                   "note": cpu_emulation_note(name, info)}
        except PrecisionError as e:
            why = str(e).split(": ", 1)[-1].split(". Choose")[0]
            row = {"name": name, "runs": False, "reason": why, "what": DESCRIPTIONS[name], "note": why}
        key = {"bf16": "bf16", "bf16-pure": "bf16", "fp16": "fp16", "fp16-pure": "fp16"}.get(name)
        if key in speeds and "fp32" in speeds and speeds["fp32"] > 0:
            row["matmul_speedup_vs_fp32"] = round(speeds[key] / speeds["fp32"], 2)
        precisions.append(row)
    devices = [info.to_dict()]
    if dev.type != "cpu":
        devices.append(device_info("cpu").to_dict())
    return {
        "ampkit": __version__, "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "device": str(dev), "devices": devices, "cpu": cpu_features().to_dict(),
        "matmul_tflops": {k: round(v, 3) for k, v in speeds.items()},
        "precisions": precisions,
        "auto": {"precision": auto.name, "reason": auto.reason},
    }


def cmd_info(inv: Invocation) -> int:
    args = inv.args
    report = info_report(args.device, measure=not args.no_measure)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    console = Console()
    console.print(f"[bold]ampkit {report['ampkit']}[/] · torch {report['torch']}")
    for d in report["devices"]:
        extra = f" · compute capability {'.'.join(map(str, d['capability']))}" if d["capability"] else ""
        mem = f" · {d['memory_bytes'] / 2**30:.0f} GiB" if d["memory_bytes"] else ""
        console.print(f"device [bold]{d['type']}[/]: {d['name']}{extra}{mem}")
    cpu = report["cpu"]
    console.print(f"CPU ISA: {', '.join(cpu['flags']) or 'none of interest'} (ATen dispatch: {cpu['capability']}); "
                  f"native bf16: {'yes' if cpu['native_bf16'] else 'no'}, native fp16: {'yes' if cpu['native_fp16'] else 'no'}")
    if report["matmul_tflops"]:
        console.print("matmul TFLOP/s on " + report["device"] + ": "
                      + ", ".join(f"{k} {v:.3g}" for k, v in report["matmul_tflops"].items()))
    table = Table(title=f"precisions on {report['device']}")
    for col in ("precision", "runs here", "matmul vs fp32", "what it is", "here"):
        table.add_column(col)
    for row in report["precisions"]:
        runs = "[green]yes[/]" if row["runs"] else "[red]no[/]"
        speed = f"{row['matmul_speedup_vs_fp32']:.2f}x" if "matmul_speedup_vs_fp32" in row else ""
        table.add_row(row["name"], runs, speed, row["what"], row["note"])
    console.print(table)
    console.print(f"[bold]auto → {report['auto']['precision']}[/]: {report['auto']['reason']}")
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("info", help="hardware, what each precision does here, and what 'auto' picks")
    flag(p, "device", default=None, help="device to describe (default: best available)")
    flag(p, "json", action="store_true", help="print machine-readable JSON")
    flag(p, "no_measure", action="store_true", help="skip the quick matmul speed measurement")
    p.set_defaults(func=cmd_info)
