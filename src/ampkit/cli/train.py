"""``ampkit train``: train a built-in model on local data, or the user's ``module:factory``."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, Optional

import torch

from ..distributed import broadcast_object, init, is_main, local_device, world_size
from ..loop.seed import seed_everything
from ..step.config import MixedPrecisionConfig
from ..step.engine import MixedPrecision
from ..step.hardware import normalize_device
from ..step.precision import CANONICAL
from . import parallel
from .common import (
    data_flags,
    estimate_inputs,
    flag,
    model_and_data,
    model_label,
    positive_float,
    positive_int,
)
from .interrupts import PeerFailed, sigterm_interrupts
from .resume import apply_resume_flags, resume_hint
from .rundirs import claim_checkpoint_dir, prepare_dir


def _amp_overrides(args: argparse.Namespace, explicit: set[str], file_amp: dict[str, Any]) -> dict[str, Any]:
    """MixedPrecisionConfig fields from the flags: a flag typed on the command line wins over the
    config file, the file wins over a flag's default."""
    overrides: dict[str, Any] = {}

    def put(key: str, dest: str, value: Any) -> None:
        if dest in explicit or key not in file_amp:
            overrides[key] = value

    put("precision", "precision", requested_precision(args, explicit))
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
    for key in ("fp8_recipe", "fp8_emulate", "compile"):
        if getattr(args, key):
            put(key, key, getattr(args, key))
    if args.deterministic:
        put("deterministic", "deterministic", True if args.deterministic == "true" else args.deterministic)
    if args.fallback_chain:
        put("fallback", "fallback_chain", args.fallback_chain)
    elif args.no_fallback:
        put("fallback", "no_fallback", False)
    elif "fallback" not in file_amp:
        overrides["fallback"] = True
    return overrides


def requested_precision(args: argparse.Namespace, explicit: set[str]) -> str:
    if not args.amp_opt_level:
        return str(args.precision)
    level = {"O0": "fp32", "O1": "auto", "O2": "O2"}[args.amp_opt_level]
    if "precision" in explicit and str(args.precision).strip().lower() not in (level.lower(), args.amp_opt_level.lower()):
        raise ValueError(f"conflicting flags: --amp_opt_level {args.amp_opt_level} means precision {level!r} but "
                         f"--precision {args.precision} was given; pass one of them")
    return level


def _batch_size_arg(text: str) -> Any:
    return "auto" if str(text).strip().lower() == "auto" else positive_int(text)


def choose_batch(args: argparse.Namespace, device: torch.device, precision: str) -> Optional[str]:
    """Resolve ``--batch_size auto`` and ``--target_effective_batch_size`` in ``args``; returns why."""
    why = None
    if args.batch_size == "auto":
        from ..loop.estimate import largest_batch, parse_bytes

        if args.memory_budget is None and device.type != "cuda":
            raise ValueError("--batch_size auto needs --memory_budget on this device (e.g. --memory_budget 8GiB); "
                             "only on CUDA is the device's free memory the default budget")
        budget = (parse_bytes(args.memory_budget) if args.memory_budget is not None
                  else torch.cuda.mem_get_info(device)[0])
        factory, batch_of = estimate_inputs(args)
        best, at = largest_batch(factory, batch_of, budget, precision,
                                 device=device if device.type == "cuda" else "cpu")
        if best < 1:
            raise ValueError(f"--memory_budget {args.memory_budget}: not even a batch of 1 fits "
                             f"({at.peak_bytes / 2**20:,.0f} MiB predicted in {precision})")
        args.batch_size = best
        why = (f"batch size {best}: the largest whose predicted peak ({at.peak_bytes / 2**20:,.0f} MiB in "
               f"{precision}) fits {budget / 2**20:,.0f} MiB")
    if args.target_effective_batch_size:
        n = args.target_effective_batch_size
        batch = min(args.batch_size, n)
        while n % batch:
            batch -= 1  # the largest micro-batch <= the chosen one that divides the target
        args.batch_size, args.accumulation_steps = batch, n // batch
        why = (why + "; " if why else "") + (f"effective batch {n} = batch {batch} x accumulation {n // batch}")
    return why


def cmd_train(args: argparse.Namespace) -> int:
    status = parallel.maybe_relaunch(args)  # --nproc_per_node: torchrun runs this command N times
    if status is not None:
        return status
    with sigterm_interrupts():
        return _cmd_train(args)


def _cmd_train(args: argparse.Namespace) -> int:
    from rich.console import Console

    several = init(args.device)  # a worker of several: join the process group
    if several and args.save_model:
        raise ValueError("--save_model writes one process's model; with several processes use --checkpoint_dir, "
                         "then `ampkit export CKPT OUT.pt`")
    console = Console(stderr=args.json, quiet=not is_main())  # keep stdout pure JSON with --json; rank 0 speaks
    seed_everything(args.seed, args.deterministic)
    device = normalize_device(local_device(args.device) if several else args.device)
    explicit: set[str] = getattr(args, "_explicit", set())
    file_amp: dict[str, Any] = getattr(args, "_file_amp", {})
    # What the user chose (command line or config file), as opposed to defaults: on --resume these
    # are compared with the checkpoint's values.
    given = explicit | set(getattr(args, "_file_train", ())) | set(file_amp)
    if args.amp_opt_level:
        given.add("precision")
    base = MixedPrecisionConfig.from_dict(file_amp) if file_amp else None
    amp = MixedPrecision(device=device, config=base, **_amp_overrides(args, explicit, file_amp))
    args._batch_reason = choose_batch(args, device, amp.precision.name)
    if args._batch_reason:
        console.print(args._batch_reason)
        if amp.config.accumulation_steps != args.accumulation_steps:
            amp.set_accumulation_steps(args.accumulation_steps)
    if args.resume and not args.checkpoint_dir:
        raise ValueError("--resume needs --checkpoint_dir DIR (where to look for checkpoints)")
    log_dir = args.log_dir or os.path.join("runs", time.strftime("%Y%m%d-%H%M%S") + f"-{amp.precision.name}")
    locks = []  # the run's directories, checked and locked (by rank 0) before anything is built
    try:
        problem = None
        if is_main():
            try:
                if args.checkpoint_dir:
                    locks.append(prepare_dir(args.checkpoint_dir, "--checkpoint_dir"))
                    claim_checkpoint_dir(args.checkpoint_dir, resume=args.resume, overwrite=args.overwrite)
                if os.path.abspath(log_dir) != os.path.abspath(args.checkpoint_dir or "\0"):
                    locks.append(prepare_dir(log_dir, "--log_dir"))
            except Exception as e:
                problem = e
        # The first collective: every rank learns rank 0's directory checks (and the log dir), so
        # a refused directory ends all of them with status 2 instead of leaving some waiting.
        log_dir, failed = broadcast_object((log_dir, problem is not None))
        if problem is not None:
            raise problem
        if failed:
            raise PeerFailed(2)
        return _train(args, console, device, amp, log_dir, given)
    finally:
        for lock in locks:
            lock.release()


def _train(args: argparse.Namespace, console: Any, device: torch.device, amp: MixedPrecision, log_dir: str,
           given: set[str]) -> int:
    from ..loop.trainer import Trainer

    model, batches = model_and_data(args, device)
    model.to(device)
    several = world_size() > 1
    why = amp.precision.reason
    if not args.resume:  # auto confirmed by measurement on a CPU (as the Trainer would); resuming keeps the checkpoint's
        from ..loop.autoselect import confirm_auto

        why = confirm_auto(amp, model, batches, label=model_label(args), announce=console.print).reason
    _activation_checkpointing(args, model, console)
    model = parallel.wrap(args, model, amp.precision, device)  # several processes: DDP or FSDP2
    fused = device.type in ("cuda", "cpu") and all(p.is_floating_point() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, fused=fused)
    model, optimizer = amp.setup(model, optimizer)
    n_params = sum(p.numel() for p in model.parameters())
    where = f"{device} x {world_size()} processes ({args.parallel})" if several else str(device)
    console.print(f"[bold]ampkit train[/]: {model_label(args)} ({n_params / 1e6:.2f}M params) on {where} "
                  f"in [bold]{amp.precision.name}[/] — {why}")
    if amp.overridden_modules:
        console.print(f"kept in fp32: {', '.join(amp.overridden_modules)}")
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
    from ..loop.trainer_config import CheckpointConfig, EvalConfig, LogConfig

    trainer = Trainer(model, optimizer, amp, batches, diagnose=not args.no_diagnose,
                      fallback=False,  # the engine above is already configured from the flags
                      log=LogConfig(dir=log_dir, every=args.log_every, console=console,
                                    progress=not args.no_progress and not args.json),
                      checkpoint=CheckpointConfig(args.checkpoint_dir, every=args.checkpoint_every,
                                                  keep_last=args.keep_last),
                      evaluation=EvalConfig(eval_batches, every=args.eval_every, precision=args.eval_precision))
    trainer.resume_hint = resume_hint(args)  # printed with a graceful stop's checkpoint
    if args.resume:
        requested = amp.config  # before the checkpoint's config replaces it
        path = trainer.resume()
        if path is None:
            if not args.allow_fresh:
                raise ValueError(f"--resume: no checkpoint in {args.checkpoint_dir!r}; pass --allow_fresh to start "
                                 "from scratch instead")
            console.print(f"no checkpoint in {args.checkpoint_dir}: starting fresh (--allow_fresh)")
        else:
            notes = apply_resume_flags(requested, given, args.lr, amp, optimizer, path)
            console.print(f"resumed from {path} at step {amp.optimizer_steps} in [bold]{amp.precision.name}[/]")
            for note in notes:
                console.print(f"[yellow]note:[/] {note}")
    remaining = args.steps - amp.optimizer_steps
    if remaining < 1:
        raise ValueError(f"nothing to do: already at step {amp.optimizer_steps} of --steps {args.steps}")
    start_skipped = amp.stats()["skipped_steps"]
    summary = trainer.fit(remaining)
    failure = _numerical_failure(summary, remaining, summary.skipped_steps - start_skipped, trainer.diagnosis)
    for note in trainer.notes:
        console.print(f"[yellow]note:[/] {note}")
    model_path = None
    if args.save_model and is_main():
        from ..loop.modelfile import save_model

        model_path = save_model(model, amp, args.save_model, {
            "model": args.model, "size": args.size, "model_config": args.model_config,
            "precision": amp.precision.name, "optimizer_steps": amp.optimizer_steps, "run_id": summary.run_id})
        console.print(f"model saved to [bold]{model_path}[/]")
    if args.json and is_main():
        out = {k: v for k, v in summary.to_dict().items() if k != "losses"}
        out.update(model=args.model, size=args.size, batch_size=args.batch_size, batch_reason=getattr(args, "_batch_reason", None),
                   accumulation_steps=amp.config.accumulation_steps, precision_reason=why, failure=failure,
                   model_path=model_path)
        print(json.dumps(json_safe(out), indent=2, allow_nan=False))
    else:
        for e in amp.events:
            if e.kind == "fallback":
                console.print(f"[yellow]fell back[/] {e.data['from']} → {e.data['to']} at step {e.step}: {e.data['reason']}")
        console.print(f"ms/step {summary.ms_per_step:.1f}"
                      + (f" · tokens/s {summary.tokens_per_s:,.0f}" if summary.tokens_per_s else "")
                      + f" · final loss {summary.final_loss:.4f} · skipped steps {summary.skipped_steps}")
        if summary.eval_losses:
            console.print("eval loss: " + ", ".join(f"step {s}: {v:.4f}" for s, v in summary.eval_losses))
        console.print(f"run written to [bold]{log_dir}[/]; plots: [bold]ampkit report {log_dir}[/]")
    if failure:
        if is_main():
            print(f"ampkit train: training failed numerically: {failure}", file=sys.stderr)
        return 3
    return 0


def _activation_checkpointing(args: argparse.Namespace, model: torch.nn.Module, console: Any) -> None:
    targets = [t.strip() for t in (args.grad_ckpt_modules or "").split(",") if t.strip()]
    if args.grad_ckpt and not targets:
        from ..loop.hf import is_hf

        if is_hf(args.model):  # the layers: the elements of every ModuleList
            targets = [f"{n}.*" for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)]
        elif args.model != "gpt":
            raise ValueError("--grad_ckpt needs --grad_ckpt_modules for this model (module types or name globs, "
                             "e.g. 'TransformerBlock' or 'layers.*'); the built-in GPT checkpoints its blocks")
        else:
            targets = ["blocks.*"]
    if not targets:
        return
    from ..step.activation_checkpointing import apply_activation_checkpointing

    try:
        done = apply_activation_checkpointing(model, targets)
    except (ValueError, TypeError) as e:
        raise ValueError(f"--grad_ckpt_modules {args.grad_ckpt_modules or ','.join(targets)!r}: {e}") from None
    console.print(f"activation checkpointing: {len(done)} module(s) ({', '.join(done[:4])}"
                  f"{', ...' if len(done) > 4 else ''})")


def _numerical_failure(summary: Any, steps: int, skipped: int, diagnosis: Any) -> Optional[str]:
    """Why this run cannot count as a success (every step skipped, or a non-finite final loss)."""
    problem = None
    if steps and skipped >= steps:
        problem = f"all {steps} optimizer steps of this run were skipped (non-finite gradients)"
    elif not math.isfinite(summary.final_loss):
        problem = f"the final loss is {summary.final_loss} after {summary.optimizer_steps} steps"
    if problem and diagnosis:
        problem += f"; diagnosis: {diagnosis}"
    elif problem:
        problem += "; run with the diagnosis on (no --no_diagnose) or `ampkit audit` to find the layer"
    return problem


def json_safe(value: Any) -> Any:
    """JSON has no NaN/inf: they become null (``json.dumps(allow_nan=False)`` then guards it)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


def add_parser(sub: Any) -> None:
    p = sub.add_parser("train", help="train a built-in model on local data, or yours (module:factory)")
    flag(p, "precision", "mixed_precision", default="auto",
          help=f"precision or alias: {', '.join(CANONICAL)} (default: auto)")
    flag(p, "model", default="gpt", help="built-in model (gpt, mlp, cnn), a Hugging Face config (gpt2, "
         "transformers.GPT2Config) or package.module:factory (default: gpt)")
    data_flags(p)
    flag(p, "size", default="small", choices=["tiny", "small", "medium", "large"], help="model size preset")
    flag(p, "steps", type=positive_int, default=100, help="optimizer steps; with --resume, the total to reach (default: 100)")
    flag(p, "batch_size", type=_batch_size_arg, default=16,
         help="micro-batch size, or 'auto': the largest that fits --memory_budget by the estimate (default: 16)")
    flag(p, "memory_budget", default=None,
         help="with --batch_size auto: the memory to fit, e.g. 8GiB (default on CUDA: the device's free memory)")
    flag(p, "target_effective_batch_size", type=positive_int, default=None,
         help="derive --accumulation_steps so that batch_size x accumulation_steps equals this")
    flag(p, "accumulation_steps", "grad_accum_steps", type=positive_int, default=1,
          help="micro-batches per optimizer step (default: 1)")
    flag(p, "clip_grad_norm", "max_grad_norm", type=positive_float, default=1.0,
          help="clip the unscaled gradient norm to this (default: 1.0)")
    flag(p, "lr", type=positive_float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    flag(p, "seed", type=int, default=0, help="seed of every generator the run uses: torch (CPU and CUDA), "
         "Python's random, numpy (default: 0)")
    flag(p, "deterministic", nargs="?", const="true", default=None, choices=["true", "warn"],
         help="deterministic kernels: torch.use_deterministic_algorithms(True) and the cuDNN flags; "
              "'warn' only warns for ops without a deterministic kernel (default: off)")
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
    flag(p, "fp8_recipe", default=None, choices=["tensorwise", "rowwise", "rowwise_with_gw_hp"],
         help="torchao float8 recipe for --precision fp8 (default: tensorwise)")
    flag(p, "fp8_emulate", action="store_true", help="run fp8 without fp8 tensor cores (torchao emulation; for tests)")
    flag(p, "compile", action="store_true", help="torch.compile the model after setup")
    flag(p, "no_fallback", action="store_true", help="do not fall back (fp16 -> bf16 -> fp32) on numerical trouble")
    flag(p, "fallback_chain", default=None, help="explicit fallback chain, e.g. 'fp16,bf16,fp32'")
    flag(p, "no_diagnose", action="store_true", help="do not localize the first skipped step")
    flag(p, "checkpoint_dir", default=None, help="write checkpoints here (atomically)")
    flag(p, "checkpoint_every", type=positive_int, default=None, help="checkpoint every N optimizer steps")
    flag(p, "keep_last", type=positive_int, default=3, help="checkpoints to keep (default: 3)")
    flag(p, "resume", action="store_true", help="continue from the newest good checkpoint in --checkpoint_dir "
                                                  "(--steps is the total to reach)")
    flag(p, "allow_fresh", action="store_true", help="with --resume: start fresh when there is no checkpoint")
    flag(p, "overwrite", action="store_true", help="start a new run in a --checkpoint_dir that holds another run's "
                                                    "checkpoints, deleting them")
    flag(p, "config", default=None, metavar="FILE.toml",
          help="read settings from TOML: an [amp] table (MixedPrecisionConfig fields) and a [train] table "
               "(these flags' names); flags given on the command line override the file")
    flag(p, "log_dir", default=None, help="run directory for logs (default: runs/<timestamp>-<precision>)")
    flag(p, "json", action="store_true", help="print the summary as JSON")
    flag(p, "save_model", default=None, metavar="DIR",
         help="save the trained weights (fp32) to DIR at the end: save_pretrained for Hugging Face models, "
              "else DIR/model.pt")
    parallel.add_flags(p)
    p.set_defaults(func=cmd_train)
