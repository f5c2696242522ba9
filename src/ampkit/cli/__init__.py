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

from .. import __version__
from ..loop.checkpoint import CheckpointError
from ..step.config import ConfigError, MixedPrecisionConfig
from ..step.engine import MixedPrecision
from ..step.fallback import NumericsError
from ..step.hardware import cpu_features, device_info, normalize_device
from ..step.precision import (
    CANONICAL,
    DESCRIPTIONS,
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
            row = {"name": name, "runs": True, "reason": p.reason, "what": DESCRIPTIONS[name],
                   "note": cpu_emulation_note(name, info)}
        except PrecisionError as e:
            why = str(e).split(": ", 1)[-1].split(". Choose")[0]
            row = {"name": name, "runs": False, "reason": why, "what": DESCRIPTIONS[name], "note": why}
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
    from ..loop.models import MODELS, builtin, user_model

    if args.model not in MODELS:
        return user_model(args.model, batch_size=args.batch_size, seed=args.seed, size=args.size, device=device)
    return builtin(args.model, args.size, batch_size=args.batch_size, seed=args.seed, device=device)


def _cmd_train(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..loop.trainer import Trainer

    console = Console(stderr=args.json)  # keep stdout pure JSON with --json
    torch.manual_seed(args.seed)
    device = normalize_device(args.device)
    explicit: set[str] = getattr(args, "_explicit", set())
    file_amp: dict[str, Any] = getattr(args, "_file_amp", {})
    overrides: dict[str, Any] = {}

    def put(key: str, dest: str, value: Any) -> None:
        # a flag given on the command line wins; otherwise the file; otherwise the flag's default
        if dest in explicit or key not in file_amp:
            overrides[key] = value

    precision = args.precision
    if args.amp_opt_level:
        level = {"O0": "fp32", "O1": "auto", "O2": "O2"}[args.amp_opt_level]
        if "precision" in explicit and str(args.precision).strip().lower() not in (level.lower(), args.amp_opt_level.lower()):
            raise ValueError(f"conflicting flags: --amp_opt_level {args.amp_opt_level} means precision {level!r} but "
                             f"--precision {args.precision} was given; pass one of them")
        precision = level
        explicit = explicit | {"precision"}
    put("precision", "precision", precision)
    if args.grad_scaler_growth_interval is not None:
        put("growth_interval", "grad_scaler_growth_interval", args.grad_scaler_growth_interval)
    if args.grad_scaler_backoff is not None:
        put("backoff_factor", "grad_scaler_backoff", args.grad_scaler_backoff)
    put("accumulation_steps", "accumulation_steps", args.accumulation_steps)
    put("clip_grad_norm", "clip_grad_norm", args.clip_grad_norm)
    if args.init_scale is not None:
        put("init_scale", "init_scale", args.init_scale)
    if args.keep_fp32:
        put("keep_fp32", "keep_fp32", tuple(p for p in args.keep_fp32.split(",") if p.strip()))
    if args.fallback_chain:
        put("fallback", "fallback_chain", args.fallback_chain)
    elif args.no_fallback:
        put("fallback", "no_fallback", False)
    elif "fallback" not in file_amp:
        overrides["fallback"] = True
    base = MixedPrecisionConfig.from_dict(file_amp) if file_amp else None
    amp = MixedPrecision(device=device, config=base, **overrides)
    model, batches = _model_and_data(args, device)
    model.to(device)
    ckpt_targets = [t for t in (args.grad_ckpt_modules or "").split(",") if t.strip()]
    if args.grad_ckpt and not ckpt_targets:
        if args.model != "gpt":
            raise ValueError("--grad_ckpt needs --grad_ckpt_modules for this model (module types or name globs, "
                             "e.g. 'TransformerBlock' or 'layers.*'); the built-in GPT checkpoints its blocks")
        ckpt_targets = ["blocks.*"]
    if ckpt_targets:
        from ..loop.activation_checkpointing import apply_activation_checkpointing

        checkpointed = apply_activation_checkpointing(model, ckpt_targets)
        console.print(f"activation checkpointing: {len(checkpointed)} module(s) ({', '.join(checkpointed[:4])}"
                      f"{', ...' if len(checkpointed) > 4 else ''})")
    fused = device.type in ("cuda", "cpu") and all(p.is_floating_point() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, fused=fused)
    model, optimizer = amp.setup(model, optimizer)
    n_params = sum(p.numel() for p in model.parameters())
    console.print(f"[bold]ampkit train[/]: {args.model}/{args.size} ({n_params / 1e6:.2f}M params) on {device} "
                  f"in [bold]{amp.precision.name}[/] — {amp.precision.reason}")
    if amp.overridden_modules:
        console.print(f"kept in fp32: {', '.join(amp.overridden_modules)}")
    log_dir = args.log_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S") + f"-{amp.precision.name}")
    eval_batches = None
    if args.eval_every:
        from ..loop.models import MODELS

        if args.model in MODELS and hasattr(batches, "split"):
            import dataclasses

            eval_batches = dataclasses.replace(batches, split="val")
        else:
            eval_batches = lambda i: batches(10_000_000 + i)  # noqa: E731 - batches the run never trains on
    if args.epochs is not None:
        per_epoch = getattr(batches, "batches_per_epoch", None)
        if per_epoch is None:
            raise ValueError("--epochs needs data with a batches_per_epoch attribute; use --steps for this model")
        args.steps = max(1, args.epochs * per_epoch // args.accumulation_steps)
    trainer = Trainer(model, optimizer, amp, batches, log_every=args.log_every,
                      progress=not args.no_progress and not args.json, log_dir=log_dir, console=console,
                      diagnose=not args.no_diagnose, checkpoint_dir=args.checkpoint_dir,
                      checkpoint_every=args.checkpoint_every, keep_last=args.keep_last,
                      eval_batches=eval_batches, eval_every=args.eval_every, eval_precision=args.eval_precision,
                      fallback=False)  # the engine above is already configured from the flags
    if args.resume:
        if not args.checkpoint_dir:
            raise ValueError("--resume needs --checkpoint_dir DIR (where to look for checkpoints)")
        path = trainer.resume()
        if path is None:
            if not args.allow_fresh:
                raise ValueError(f"--resume: no checkpoint in {args.checkpoint_dir!r}; pass --allow_fresh to start "
                                 "from scratch instead")
            console.print(f"no checkpoint in {args.checkpoint_dir}: starting fresh (--allow_fresh)")
        else:
            console.print(f"resumed from {path} at step {amp.optimizer_steps} in {amp.precision.name}")
    remaining = args.steps - amp.optimizer_steps
    if remaining < 1:
        raise ValueError(f"nothing to do: already at step {amp.optimizer_steps} of --steps {args.steps}")
    summary = trainer.fit(remaining)
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
    from ..observe.numerics import audit

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
    console = _wide_console()
    console.print(report.table(limit=args.top))
    keep = ", ".join(report.recommended_keep_fp32) or "none"
    console.print(f"[bold]keep in fp32:[/] {keep}")
    if report.recommended_init_scale:
        console.print(f"[bold]recommended init_scale:[/] {report.recommended_init_scale:g} "
                      f"(largest reference gradient {report.max_grad:.3g})")
    for note in report.notes:
        console.print(f"note: {note}")
    return 0


def _bench_report(args: argparse.Namespace) -> Any:
    from ..loop.bench import compare

    device = normalize_device(args.device)
    precisions = [x.strip() for x in args.precisions.split(",") if x.strip()] if args.precisions else None

    def factory() -> torch.nn.Module:
        return _model_and_data(args, device)[0]

    _, batches = _model_and_data(args, device)
    return compare(factory, batches, precisions, steps=args.steps, warmup=args.warmup, repeats=args.repeats,
                   device=device, lr=args.lr, accumulation_steps=args.accumulation_steps, seed=args.seed,
                   model_name=f"{args.model}/{args.size}")


def _wide_console() -> Any:
    """Wide tables stay readable when stdout is not a terminal (rich would fall back to 80 columns)."""
    from rich.console import Console

    c = Console()
    return c if c.is_terminal else Console(width=160)


def _cmd_bench(args: argparse.Namespace) -> int:
    report = _bench_report(args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report.to_dict(), f, indent=2)
    if args.plot:
        report.plot(args.plot)
    console = _wide_console()
    console.print(report.table())
    for r in report.results:
        if r.status != "ok":
            console.print(f"[yellow]skipped {r.precision}[/]: {r.reason}")
    if args.json or args.plot:
        console.print("wrote " + " and ".join(x for x in (args.json, args.plot) if x))
    return 0


def _cmd_tune(args: argparse.Namespace) -> int:
    from ..loop.bench import tune

    report = _bench_report(args)
    rec = tune(report, tolerance=args.tolerance)
    with open(args.out, "w", encoding="utf-8") as f:
        f.write(rec.to_toml())
    if args.json:
        print(json.dumps({"recommendation": rec.to_dict(), "bench": report.to_dict(losses=False)}, indent=2))
        return 0
    console = _wide_console()
    console.print(report.table())
    console.print(f"[bold green]recommended: {rec.precision}[/] — {rec.speedup_vs_fp32:.2f}x fp32's speed, "
                  f"final-loss gap {100 * rec.loss_gap:+.2f}% (tolerance {100 * rec.tolerance:g}%), "
                  f"batch size {rec.batch_size}, accumulation {rec.accumulation_steps}")
    for name, why in rec.why_not.items():
        console.print(f"  {name}: {why}")
    console.print(f"wrote {args.out}: use it with [bold]ampkit train --config {args.out}[/]")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from ..report import make_report

    metrics = args.metrics.split(",") if args.metrics else None
    out = make_report(args.run_dir, compare=args.compare or (), out_dir=args.out, metrics=metrics)
    if args.json:
        print(json.dumps(out, indent=2, default=str))
        return 0
    from rich.console import Console

    from ..observe.monitor import summary_table

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

    p = sub.add_parser("train", help="train a built-in model on local data, or yours (module:factory)")
    _flag(p, "precision", "mixed_precision", default="auto",
          help=f"precision or alias: {', '.join(CANONICAL)} (default: auto)")
    _flag(p, "model", default="gpt", help="built-in model (gpt, mlp, cnn) or package.module:factory (default: gpt)")
    _flag(p, "size", default="small", choices=["tiny", "small", "medium", "large"], help="model size preset")
    _flag(p, "steps", type=_positive_int, default=100, help="optimizer steps; with --resume, the total to reach (default: 100)")
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
    _flag(p, "amp_opt_level", default=None, choices=["O0", "O1", "O2"],
          help="apex-style level: O0 = fp32, O1 = auto mixed, O2 = pure half weights (conflicts with --precision)")
    _flag(p, "init_scale", "grad_scaler_init", type=_positive_float, default=None,
          help="initial loss scale for fp16 (default: 65536, as torch.amp.GradScaler)")
    _flag(p, "grad_scaler_growth_interval", type=_positive_int, default=None,
          help="finite steps before the loss scale grows (default: 2000)")
    _flag(p, "grad_scaler_backoff", type=float, default=None, help="loss-scale backoff factor (default: 0.5)")
    _flag(p, "grad_ckpt", action="store_true", help="activation checkpointing (the built-in GPT's blocks)")
    _flag(p, "grad_ckpt_modules", default=None,
          help="activation-checkpoint these module types / name globs (comma-separated); implies --grad_ckpt")
    _flag(p, "epochs", type=_positive_int, default=None, help="train this many epochs instead of --steps")
    _flag(p, "eval_every", type=_positive_int, default=None, help="evaluate on held-out batches every N steps")
    _flag(p, "eval_precision", default="train", choices=["train", "fp32"],
          help="evaluate in the training precision or strict fp32 (default: train)")
    _flag(p, "keep_fp32", default=None, help="comma-separated module globs/types to keep in fp32, e.g. 'lm_head,*.ln_*'")
    _flag(p, "no_fallback", action="store_true", help="do not fall back (fp16 -> bf16 -> fp32) on numerical trouble")
    _flag(p, "fallback_chain", default=None, help="explicit fallback chain, e.g. 'fp16,bf16,fp32'")
    _flag(p, "no_diagnose", action="store_true", help="do not localize the first skipped step")
    _flag(p, "checkpoint_dir", default=None, help="write checkpoints here (atomically)")
    _flag(p, "checkpoint_every", type=_positive_int, default=None, help="checkpoint every N optimizer steps")
    _flag(p, "keep_last", type=_positive_int, default=3, help="checkpoints to keep (default: 3)")
    _flag(p, "resume", action="store_true", help="continue from the newest good checkpoint in --checkpoint_dir "
                                                  "(--steps is the total to reach)")
    _flag(p, "allow_fresh", action="store_true", help="with --resume: start fresh when there is no checkpoint")
    _flag(p, "config", default=None, metavar="FILE.toml",
          help="read settings from TOML: an [amp] table (MixedPrecisionConfig fields) and a [train] table "
               "(these flags' names); flags given on the command line override the file")
    _flag(p, "log_dir", default=None, help="run directory for logs (default: runs/<timestamp>-<precision>)")
    _flag(p, "json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=_cmd_train)

    p = sub.add_parser("audit", help="per-layer numerics: what breaks in fp16/bf16 and why")
    _flag(p, "model", default="gpt", help="built-in model (gpt, mlp, cnn) or package.module:factory (default: gpt)")
    _flag(p, "size", default="tiny", choices=["tiny", "small", "medium", "large"], help="model size preset")
    _flag(p, "precision", default="fp16", help="precision to audit against the fp64/fp32 reference (default: fp16)")
    _flag(p, "batch_size", type=_positive_int, default=4, help="example batch size (default: 4)")
    _flag(p, "seed", type=int, default=0, help="random seed")
    _flag(p, "device", default=None, help="cpu, cuda, ... (default: best available)")
    _flag(p, "top", type=_positive_int, default=25, help="rows to show (default: 25)")
    _flag(p, "json", action="store_true", help="print the full report as JSON")
    p.set_defaults(func=_cmd_audit)

    for cmd, helptext in (("bench", "every precision side by side: speed, memory, fidelity"),
                          ("tune", "measure, then recommend a precision within a fidelity tolerance")):
        p = sub.add_parser(cmd, help=helptext)
        _flag(p, "model", default="gpt", help="built-in model (gpt, mlp, cnn) or package.module:factory")
        _flag(p, "size", default="tiny", choices=["tiny", "small", "medium", "large"], help="model size preset (default: tiny)")
        _flag(p, "precisions", default=None, help="comma-separated precisions (default: fp32,tf32,bf16,fp16)")
        _flag(p, "steps", type=_positive_int, default=30, help="timed optimizer steps per precision (default: 30)")
        _flag(p, "warmup", type=int, default=5, help="untimed steps first (default: 5)")
        _flag(p, "repeats", type=_positive_int, default=5, help="interleaved timing blocks (default: 5)")
        _flag(p, "batch_size", type=_positive_int, default=16, help="micro-batch size (default: 16)")
        _flag(p, "accumulation_steps", "grad_accum_steps", type=_positive_int, default=1, help="micro-batches per step")
        _flag(p, "lr", type=_positive_float, default=1e-3, help="AdamW learning rate")
        _flag(p, "seed", type=int, default=0, help="random seed")
        _flag(p, "device", default=None, help="cpu, cuda, ... (default: best available)")
        if cmd == "bench":
            _flag(p, "json", default=None, metavar="FILE", help="also write the results as JSON")
            _flag(p, "plot", default=None, metavar="FILE.png", help="speed-up and memory bars, loss curves")
            p.set_defaults(func=_cmd_bench)
        else:
            _flag(p, "tolerance", type=float, default=0.01,
                  help="allowed final-loss gap to fp32, as a fraction of the fp32 loss (default: 0.01)")
            _flag(p, "out", default="ampkit-tune.toml", help="where to write the recommended config")
            _flag(p, "json", action="store_true", help="print the recommendation and measurements as JSON")
            p.set_defaults(func=_cmd_tune)

    p = sub.add_parser("report", help="plots and a Markdown summary from a run's logs")
    p.add_argument("run_dir", help="a run directory written by `ampkit train` (or its log.jsonl)")
    _flag(p, "compare", nargs="+", default=None, metavar="RUN_DIR", help="overlay these runs (e.g. fp32 vs bf16)")
    _flag(p, "out", default=None, help="where to write (default: RUN_DIR/report)")
    _flag(p, "metrics", default=None, help="comma-separated subset of: loss, scale, speed, memory")
    _flag(p, "json", action="store_true", help="print paths and summaries as JSON")
    p.set_defaults(func=_cmd_report)
    return parser


def _explicit_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> set[str]:
    """Destinations of the options actually typed on the command line (to let them win over a file)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
    by_option = {o: a for a in sub._actions for o in a.option_strings}
    return {by_option[t.split("=", 1)[0]].dest for t in argv if t.split("=", 1)[0] in by_option}


def _apply_config_file(parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str]) -> None:
    """Merge ``--config FILE.toml`` into ``args``: ``[train]`` keys fill flags not given on the
    command line; ``[amp]`` goes to MixedPrecisionConfig. Unknown keys and wrong types are errors."""
    from ..step.config import read_toml

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[args.command]
    explicit = args._explicit
    data = read_toml(args.config)
    unknown = [k for k in data if k not in ("amp", "train")]
    if unknown:
        raise ConfigError(f"config file {args.config!r}: unknown table(s) {', '.join(map(repr, unknown))}; "
                          "expected [amp] and/or [train]")
    amp = data.get("amp", {})
    MixedPrecisionConfig.from_dict(amp)  # validate now: unknown keys and wrong types name the key
    dests = {a.dest: a for a in sub._actions if a.option_strings and a.dest not in ("help", "config", "json")}
    for key, value in data.get("train", {}).items():
        action = dests.get(key)
        if action is None:
            raise ConfigError(f"config file {args.config!r}: unknown [train] key {key!r}; valid keys: "
                              f"{', '.join(sorted(dests))}")
        if isinstance(action, argparse._StoreTrueAction):
            if not isinstance(value, bool):
                raise ConfigError(f"config file {args.config!r}: [train] {key} = {value!r} must be true or false")
        elif action.type is not None:
            try:
                if isinstance(value, bool):
                    raise ValueError
                value = action.type(str(value))
            except (ValueError, TypeError, argparse.ArgumentTypeError):
                raise ConfigError(f"config file {args.config!r}: [train] {key} = {value!r} is not a valid "
                                  f"{getattr(action.type, '__name__', 'value').strip('_')}") from None
        elif not isinstance(value, str):
            raise ConfigError(f"config file {args.config!r}: [train] {key} = {value!r} must be a string")
        if action.choices is not None and value not in action.choices:
            raise ConfigError(f"config file {args.config!r}: [train] {key} = {value!r}; choose one of {list(action.choices)}")
        if action.dest not in explicit:
            setattr(args, action.dest, value)
    args._file_amp = amp


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    try:
        raw = list(sys.argv[1:] if argv is None else argv)
        args._explicit = _explicit_flags(parser, args, raw)
        if getattr(args, "config", None):
            _apply_config_file(parser, args, raw)
        return int(args.func(args) or 0)
    except NumericsError as e:
        print(f"ampkit {args.command}: training failed numerically: {e}", file=sys.stderr)
        return 3
    except (PrecisionError, ConfigError, ValueError, FileNotFoundError, ImportError, CheckpointError) as e:
        print(f"ampkit {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
