"""The ``ampkit`` command: ``info`` and ``train``.

Every ``--flag_name`` also answers to ``--flag-name``. The CLI only composes: it parses, builds
the pieces (model, data, engine, trainer) and prints; no feature lives only here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Sequence
from typing import Any, Optional

import torch

from . import __version__
from .config import ConfigError
from .engine import MixedPrecision
from .fallback import NumericsError
from .hardware import cpu_features, device_info, normalize_device
from .precision import (
    _DESCRIPTIONS,
    CANONICAL,
    PrecisionError,
    cpu_emulation_note,
    resolve_precision,
)

__all__ = ["main"]


def _flag(parser: argparse.ArgumentParser, name: str, *aliases: str, **kwargs: Any) -> None:
    """Add ``--name`` with its hyphen spelling (and any aliases) as one option."""
    spellings = [f"--{name}"]
    for n in (name, *aliases):
        for s in (f"--{n}", f"--{n.replace('_', '-')}"):
            if s not in spellings:
                spellings.append(s)
    parser.add_argument(*spellings, dest=name, **kwargs)


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"{v} must be >= 1")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"{v} must be > 0")
    return v


# ---------------------------------------------------------------------------- info

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
            row = {"name": name, "runs": True, "reason": p.reason, "what": _DESCRIPTIONS[name],
                   "note": cpu_emulation_note(name, info)}
        except PrecisionError as e:
            why = str(e).split(": ", 1)[-1].split(". Choose")[0]
            row = {"name": name, "runs": False, "reason": why, "what": _DESCRIPTIONS[name], "note": why}
        key = {"bf16": "bf16", "bf16-pure": "bf16", "fp16": "fp16", "fp16-pure": "fp16"}.get(name)
        if key in speeds and "fp32" in speeds and speeds["fp32"] > 0:
            row["matmul_speedup_vs_fp32"] = round(speeds[key] / speeds["fp32"], 2)
        row["engine_ready"] = name in ("fp32", "tf32", "bf16", "fp16")
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


def _cmd_info(args: argparse.Namespace) -> int:
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
        runs = ("[green]yes[/]" if row["engine_ready"] else "[yellow]yes (engine: later)[/]") if row["runs"] else "[red]no[/]"
        speed = f"{row['matmul_speedup_vs_fp32']:.2f}x" if "matmul_speedup_vs_fp32" in row else ""
        table.add_row(row["name"], runs, speed, row["what"], row["note"])
    console.print(table)
    console.print(f"[bold]auto → {report['auto']['precision']}[/]: {report['auto']['reason']}")
    return 0


# ---------------------------------------------------------------------------- train

def _model_and_data(args: argparse.Namespace, device: torch.device) -> tuple[torch.nn.Module, Any]:
    """A built-in model with its local data, or a user's ``module:factory``."""
    from .data import ClassificationBatches, TextBatches
    from .models import MODELS, build, user_model

    if args.model not in MODELS:
        model, batch_fn = user_model(args.model, batch_size=args.batch_size, seed=args.seed, size=args.size,
                                     device=device)
        return model, batch_fn
    model = build(args.model, args.size)
    if args.model == "gpt":
        return model, TextBatches(batch_size=args.batch_size, block_size=model.config.block_size,
                                  seed=args.seed, device=device)
    return model, ClassificationBatches(batch_size=args.batch_size, in_features=model.config.in_features,
                                        n_classes=model.config.n_classes, seed=args.seed, device=device)


def _cmd_train(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .trainer import Trainer

    console = Console(stderr=args.json)  # keep stdout pure JSON with --json
    torch.manual_seed(args.seed)
    device = normalize_device(args.device)
    overrides: dict[str, Any] = {"accumulation_steps": args.accumulation_steps, "clip_grad_norm": args.clip_grad_norm}
    if args.init_scale is not None:
        overrides["init_scale"] = args.init_scale
    if args.keep_fp32:
        overrides["keep_fp32"] = tuple(p for p in args.keep_fp32.split(",") if p.strip())
    if args.fallback_chain:
        overrides["fallback"] = args.fallback_chain
    elif not args.no_fallback:
        overrides["fallback"] = True
    amp = MixedPrecision(args.precision, device=device, **overrides)
    model, batches = _model_and_data(args, device)
    model.to(device)
    fused = device.type in ("cuda", "cpu") and all(p.is_floating_point() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, fused=fused)
    model, optimizer = amp.setup(model, optimizer)
    n_params = sum(p.numel() for p in model.parameters())
    console.print(f"[bold]ampkit train[/]: {args.model}/{args.size} ({n_params / 1e6:.2f}M params) on {device} "
                  f"in [bold]{amp.precision.name}[/] — {amp.precision.reason}")
    if amp.overridden_modules:
        console.print(f"kept in fp32: {', '.join(amp.overridden_modules)}")
    log_dir = args.log_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S") + f"-{amp.precision.name}")
    trainer = Trainer(model, optimizer, amp, batches, log_every=args.log_every,
                      progress=not args.no_progress and not args.json, log_dir=log_dir, console=console,
                      diagnose=not args.no_diagnose)
    summary = trainer.fit(args.steps)
    for note in trainer.notes:
        console.print(f"[yellow]note:[/] {note}")
    if args.json:
        print(json.dumps({k: v for k, v in summary.to_dict().items() if k != "losses"}, indent=2))
        return 0
    for e in amp.events:
        if e.kind == "fallback":
            console.print(f"[yellow]fell back[/] {e.data['from']} → {e.data['to']} at step {e.step}: {e.data['reason']}")
    console.print(f"ms/step {summary.ms_per_step:.1f}"
                  + (f" · tokens/s {summary.tokens_per_s:,.0f}" if summary.tokens_per_s else "")
                  + f" · final loss {summary.final_loss:.4f} · skipped steps {summary.skipped_steps}")
    console.print(f"run written to [bold]{log_dir}[/]; plots: [bold]ampkit report {log_dir}[/]")
    return 0


def _cmd_audit(args: argparse.Namespace) -> int:
    from .numerics import audit

    torch.manual_seed(args.seed)
    device = normalize_device(args.device)
    model, batches = _model_and_data(args, device)
    model.to(device)
    batch = batches(0)
    inputs = batch if isinstance(batch, (tuple, list, dict)) else (batch,)
    report = audit(model, inputs, args.precision)
    if args.json:
        print(json.dumps(report.to_dict(), indent=2))
        return 0
    from rich.console import Console

    console = Console()
    console.print(report.table(limit=args.top))
    keep = ", ".join(report.recommended_keep_fp32) or "none"
    console.print(f"[bold]keep in fp32:[/] {keep}")
    if report.recommended_init_scale:
        console.print(f"[bold]recommended init_scale:[/] {report.recommended_init_scale:g} "
                      f"(largest reference gradient {report.max_grad:.3g})")
    for note in report.notes:
        console.print(f"note: {note}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from .report import make_report

    metrics = args.metrics.split(",") if args.metrics else None
    out = make_report(args.run_dir, compare=args.compare or (), out_dir=args.out, metrics=metrics)
    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return 0
    from rich.console import Console

    from .monitor import summary_table

    console = Console()
    for label, s in out["summaries"].items():
        console.print(summary_table(s, title=label))
    console.print(f"wrote {len(out['pngs'])} plots and {out['markdown']}")
    return 0


# ---------------------------------------------------------------------------- parser

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ampkit", description="Mixed-precision training for PyTorch: fast, safe and visible.")
    parser.add_argument("--version", action="version", version=f"ampkit {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("info", help="hardware, what each precision does here, and what 'auto' picks")
    _flag(p, "device", default=None, help="device to describe (default: best available)")
    _flag(p, "json", action="store_true", help="print machine-readable JSON")
    _flag(p, "no_measure", action="store_true", help="skip the quick matmul speed measurement")
    p.set_defaults(func=_cmd_info)

    p = sub.add_parser("train", help="train the built-in tiny GPT (or MLP) on local data")
    _flag(p, "precision", "mixed_precision", default="auto",
          help=f"precision or alias: {', '.join(CANONICAL)} (default: auto)")
    _flag(p, "model", default="gpt", help="built-in model (gpt, mlp) or package.module:factory (default: gpt)")
    _flag(p, "size", default="small", choices=["tiny", "small", "medium", "large"], help="model size preset")
    _flag(p, "steps", type=_positive_int, default=100, help="optimizer steps (default: 100)")
    _flag(p, "batch_size", type=_positive_int, default=16, help="micro-batch size (default: 16)")
    _flag(p, "accumulation_steps", "grad_accum_steps", type=_positive_int, default=1,
          help="micro-batches per optimizer step (default: 1)")
    _flag(p, "clip_grad_norm", "max_grad_norm", type=_positive_float, default=1.0,
          help="clip the unscaled gradient norm to this (default: 1.0)")
    _flag(p, "lr", type=_positive_float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    _flag(p, "seed", type=int, default=0, help="random seed (default: 0)")
    _flag(p, "device", default=None, help="cpu, cuda, cuda:1, mps (default: best available)")
    _flag(p, "log_every", type=_positive_int, default=10, help="read metrics to the host every N steps")
    _flag(p, "no_progress", action="store_true", help="no progress bar")
    _flag(p, "init_scale", "grad_scaler_init", type=_positive_float, default=None,
          help="initial loss scale for fp16 (default: 65536, as torch.amp.GradScaler)")
    _flag(p, "keep_fp32", default=None, help="comma-separated module globs/types to keep in fp32, e.g. 'lm_head,*.ln_*'")
    _flag(p, "no_fallback", action="store_true", help="do not fall back (fp16 -> bf16 -> fp32) on numerical trouble")
    _flag(p, "fallback_chain", default=None, help="explicit fallback chain, e.g. 'fp16,bf16,fp32'")
    _flag(p, "no_diagnose", action="store_true", help="do not localize the first skipped step")
    _flag(p, "log_dir", default=None, help="run directory for logs (default: runs/<timestamp>-<precision>)")
    _flag(p, "json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("audit", help="per-layer numerics: what breaks in fp16/bf16 and why")
    _flag(p, "model", default="gpt", help="built-in model (gpt, mlp) or package.module:factory (default: gpt)")
    _flag(p, "size", default="tiny", choices=["tiny", "small", "medium", "large"], help="model size preset")
    _flag(p, "precision", default="fp16", help="precision to audit against the fp64/fp32 reference (default: fp16)")
    _flag(p, "batch_size", type=_positive_int, default=4, help="example batch size (default: 4)")
    _flag(p, "seed", type=int, default=0, help="random seed")
    _flag(p, "device", default=None, help="cpu, cuda, ... (default: best available)")
    _flag(p, "top", type=_positive_int, default=25, help="rows to show (default: 25)")
    _flag(p, "json", action="store_true", help="print the full report as JSON")
    p.set_defaults(func=_cmd_audit)

    p = sub.add_parser("report", help="plots and a Markdown summary from a run's logs")
    p.add_argument("run_dir", help="a run directory written by `ampkit train` (or its log.jsonl)")
    _flag(p, "compare", nargs="+", default=None, metavar="RUN_DIR", help="overlay these runs (e.g. fp32 vs bf16)")
    _flag(p, "out", default=None, help="where to write (default: RUN_DIR/report)")
    _flag(p, "metrics", default=None, help="comma-separated subset of: loss, scale, speed, memory")
    _flag(p, "json", action="store_true", help="print paths and summaries as JSON")
    p.set_defaults(func=_cmd_report)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except NumericsError as e:
        print(f"ampkit {args.command}: training failed numerically: {e}", file=sys.stderr)
        return 3
    except (PrecisionError, ConfigError, ValueError, FileNotFoundError, ImportError) as e:
        print(f"ampkit {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
