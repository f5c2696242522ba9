"""``ampkit info``: the hardware, what each precision does here, and what ``auto`` picks."""

from __future__ import annotations

import contextlib
import json
import statistics
import time
from typing import Any, Optional

import torch

from .. import __version__
from ..choose.speed import Timing, paired_ratio, speed_words
from ..step.hardware import cpu_features, device_info, normalize_device
from ..step.precision import (
    CANONICAL,
    DESCRIPTIONS,
    REFERENCE,
    REGISTRY,
    PrecisionError,
    cpu_emulation_note,
    parse_precision,
    resolve_precision,
)
from .common import flag
from .invocation import Invocation

MATMUL_REPEATS = 5


def _matmul_seconds(
    device: torch.device,
    dtypes: dict[str, torch.dtype],
    n: int,
    repeats: int = MATMUL_REPEATS,
    budget_s: float = 0.03,
) -> dict[str, list[float]]:
    """Seconds per n x n matmul for each dtype that runs here, one figure per repeat, the dtypes
    interleaved repeat by repeat (drift hits all alike); a rough, quick measurement."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    pairs = {}
    for name, dtype in dtypes.items():
        with contextlib.suppress(RuntimeError):
            a = torch.randn(n, n, device=device).to(dtype)
            b = torch.randn(n, n, device=device).to(dtype)
            for _ in range(2):
                a @ b
            pairs[name] = (a, b)
    out: dict[str, list[float]] = {name: [] for name in pairs}
    for _ in range(repeats):
        for name, (a, b) in pairs.items():
            sync()
            reps, t0 = 0, time.perf_counter()
            while True:
                a @ b
                reps += 1
                if reps % 4 == 0:
                    sync()
                    if time.perf_counter() - t0 > budget_s:
                        break
            out[name].append((time.perf_counter() - t0) / reps)
    return out


def info_report(device: Optional[str] = None, measure: bool = True) -> dict[str, Any]:
    """Everything ``ampkit info`` shows, as a dict (``--json`` prints exactly this)."""
    dev = normalize_device(device)
    info = device_info(dev)
    auto = resolve_precision("auto", info)
    speeds: dict[str, float] = {}
    ratios: dict[str, tuple[float, float]] = {}  # dtype -> (speed-up vs fp32, spread)
    timed = ""
    if measure:
        n = 2048 if dev.type == "cuda" else 512
        dtypes = {parse_precision(d): d for d in (torch.float32, torch.bfloat16, torch.float16)}
        secs = _matmul_seconds(dev, dtypes, n)
        speeds = {k: 2 * n**3 / statistics.median(v) / 1e12 for k, v in secs.items()}
        ratios = {k: paired_ratio(secs[REFERENCE], v) for k, v in secs.items() if REFERENCE in secs}
        spread = max((s for k, (_, s) in ratios.items() if k != REFERENCE), default=0.0)
        timed = Timing(
            f"one {n}x{n} matmul (not a training step)",
            torch.get_num_threads(),
            MATMUL_REPEATS,
            spread,
        ).describe()
    precisions = []
    for name in CANONICAL[1:]:
        try:
            p = resolve_precision(name, info)
            row = {
                "name": name,
                "runs": True,
                "reason": p.reason,
                "what": DESCRIPTIONS[name],
                "note": cpu_emulation_note(name, info),
            }
        except PrecisionError as e:
            why = str(e).split(": ", 1)[-1].split(". Choose")[0]
            row = {
                "name": name,
                "runs": False,
                "reason": why,
                "what": DESCRIPTIONS[name],
                "note": why,
            }
        # a half dtype's plain matmul speed-up says something about it (not about fp8 or tf32)
        spec = REGISTRY[name]
        plain = spec.hardware is None and not spec.reduced_matmul
        key = parse_precision(spec.compute_dtype) if plain else None
        key = None if key == REFERENCE else key
        if key in ratios:
            row["matmul_speedup_vs_fp32"] = round(ratios[key][0], 2)
            row["matmul_speedup_words"] = speed_words(*ratios[key])
        precisions.append(row)
    devices = [info.to_dict()]
    if dev.type != "cpu":
        devices.append(device_info("cpu").to_dict())
    return {
        "ampkit": __version__,
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "device": str(dev),
        "devices": devices,
        "cpu": cpu_features().to_dict(),
        "matmul_tflops": {k: round(v, 3) for k, v in speeds.items()},
        "matmul_timed": timed,
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
        extra = (
            f" · compute capability {'.'.join(map(str, d['capability']))}"
            if d["capability"]
            else ""
        )
        mem = f" · {d['memory_bytes'] / 2**30:.0f} GiB" if d["memory_bytes"] else ""
        console.print(f"device [bold]{d['type']}[/]: {d['name']}{extra}{mem}")
    cpu = report["cpu"]
    console.print(
        f"CPU ISA: {', '.join(cpu['flags']) or 'none of interest'} (ATen dispatch: {cpu['capability']}); "
        f"native bf16: {'yes' if cpu['native_bf16'] else 'no'}, native fp16: {'yes' if cpu['native_fp16'] else 'no'}"
    )
    if report["matmul_tflops"]:
        console.print(
            "matmul TFLOP/s on "
            + report["device"]
            + ": "
            + ", ".join(f"{k} {v:.3g}" for k, v in report["matmul_tflops"].items())
            + f" (timed: {report['matmul_timed']}; "
            "`ampkit bench` times whole training steps)"
        )
    table = Table(title=f"precisions on {report['device']}")
    for col in ("precision", "runs here", "matmul vs fp32", "what it is", "here"):
        table.add_column(col)
    for row in report["precisions"]:
        runs = "[green]yes[/]" if row["runs"] else "[red]no[/]"
        speed = row.get("matmul_speedup_words", "").replace(" fp32's speed", "")
        table.add_row(row["name"], runs, speed, row["what"], row["note"])
    console.print(table)
    auto = report["auto"]["precision"]
    console.print(f"[bold]auto → {auto}[/]: {report['auto']['reason']}")
    if report["device"] == "cpu" and auto != REFERENCE:
        console.print(
            f"(the hardware's pick: `ampkit train` confirms it by timing a few steps of the model "
            f"against fp32 and trains in fp32 where {auto} is slower; MixedPrecision('auto') "
            "keeps the hardware's pick)"
        )
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "info", help="hardware, what each precision does here, and what 'auto' picks"
    )
    flag(p, "device", default=None, help="device to describe (default: best available)")
    flag(p, "json", action="store_true", help="print machine-readable JSON")
    flag(p, "no_measure", action="store_true", help="skip the quick matmul speed measurement")
    p.set_defaults(func=cmd_info)
