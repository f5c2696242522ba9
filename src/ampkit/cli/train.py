"""``ampkit train``: train a built-in model on local data, or the user's ``module:factory``."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

from ..step.config import MixedPrecisionConfig
from ..step.engine import MixedPrecision
from ..step.hardware import normalize_device
from ..step.precision import CANONICAL
from .common import flag, model_and_data, positive_float, positive_int


def cmd_train(args: argparse.Namespace) -> int:
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
    model, batches = model_and_data(args, device)
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


def add_parser(sub: Any) -> None:
    p = sub.add_parser("train", help="train a built-in model on local data, or yours (module:factory)")
    flag(p, "precision", "mixed_precision", default="auto",
          help=f"precision or alias: {', '.join(CANONICAL)} (default: auto)")
    flag(p, "model", default="gpt", help="built-in model (gpt, mlp, cnn) or package.module:factory (default: gpt)")
    flag(p, "size", default="small", choices=["tiny", "small", "medium", "large"], help="model size preset")
    flag(p, "steps", type=positive_int, default=100, help="optimizer steps; with --resume, the total to reach (default: 100)")
    flag(p, "batch_size", type=positive_int, default=16, help="micro-batch size (default: 16)")
    flag(p, "accumulation_steps", "grad_accum_steps", type=positive_int, default=1,
          help="micro-batches per optimizer step (default: 1)")
    flag(p, "clip_grad_norm", "max_grad_norm", type=positive_float, default=1.0,
          help="clip the unscaled gradient norm to this (default: 1.0)")
    flag(p, "lr", type=positive_float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    flag(p, "seed", type=int, default=0, help="random seed (default: 0)")
    flag(p, "device", default=None, help="cpu, cuda, cuda:1, mps (default: best available)")
    flag(p, "log_every", type=positive_int, default=10, help="read metrics to the host every N steps")
    flag(p, "no_progress", action="store_true", help="no progress bar")
    flag(p, "amp_opt_level", default=None, choices=["O0", "O1", "O2"],
          help="apex-style level: O0 = fp32, O1 = auto mixed, O2 = pure half weights (conflicts with --precision)")
    flag(p, "init_scale", "grad_scaler_init", type=positive_float, default=None,
          help="initial loss scale for fp16 (default: 65536, as torch.amp.GradScaler)")
    flag(p, "grad_scaler_growth_interval", type=positive_int, default=None,
          help="finite steps before the loss scale grows (default: 2000)")
    flag(p, "grad_scaler_backoff", type=float, default=None, help="loss-scale backoff factor (default: 0.5)")
    flag(p, "grad_ckpt", action="store_true", help="activation checkpointing (the built-in GPT's blocks)")
    flag(p, "grad_ckpt_modules", default=None,
          help="activation-checkpoint these module types / name globs (comma-separated); implies --grad_ckpt")
    flag(p, "epochs", type=positive_int, default=None, help="train this many epochs instead of --steps")
    flag(p, "eval_every", type=positive_int, default=None, help="evaluate on held-out batches every N steps")
    flag(p, "eval_precision", default="train", choices=["train", "fp32"],
          help="evaluate in the training precision or strict fp32 (default: train)")
    flag(p, "keep_fp32", default=None, help="comma-separated module globs/types to keep in fp32, e.g. 'lm_head,*.ln_*'")
    flag(p, "no_fallback", action="store_true", help="do not fall back (fp16 -> bf16 -> fp32) on numerical trouble")
    flag(p, "fallback_chain", default=None, help="explicit fallback chain, e.g. 'fp16,bf16,fp32'")
    flag(p, "no_diagnose", action="store_true", help="do not localize the first skipped step")
    flag(p, "checkpoint_dir", default=None, help="write checkpoints here (atomically)")
    flag(p, "checkpoint_every", type=positive_int, default=None, help="checkpoint every N optimizer steps")
    flag(p, "keep_last", type=positive_int, default=3, help="checkpoints to keep (default: 3)")
    flag(p, "resume", action="store_true", help="continue from the newest good checkpoint in --checkpoint_dir "
                                                  "(--steps is the total to reach)")
    flag(p, "allow_fresh", action="store_true", help="with --resume: start fresh when there is no checkpoint")
    flag(p, "config", default=None, metavar="FILE.toml",
          help="read settings from TOML: an [amp] table (MixedPrecisionConfig fields) and a [train] table "
               "(these flags' names); flags given on the command line override the file")
    flag(p, "log_dir", default=None, help="run directory for logs (default: runs/<timestamp>-<precision>)")
    flag(p, "json", action="store_true", help="print the summary as JSON")
    p.set_defaults(func=cmd_train)
