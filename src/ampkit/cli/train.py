"""``ampkit train``: train a built-in model on local data, or the user's ``module:factory``.

The engine's flags are generated from MixedPrecisionConfig (:mod:`ampkit.cli.flags`); the command
receives one :class:`~ampkit.cli.invocation.Invocation` and resolves it into a
:class:`~ampkit.cli.invocation.TrainInvocation` before anything is built.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
import warnings
from typing import Any, Optional

import torch
from rich.markup import escape

from ..distributed import broadcast_object, init, is_main, local_device, world_size
from ..loop.seed import seed_everything
from ..step.engine import MixedPrecision
from ..step.hardware import normalize_device
from ..step.logs import enable_debug
from ..step.precision import PrecisionError
from ..step.rung import Rung
from ..step.settings_diff import CheckpointSettingsWarning
from ..train.summary import opt_level
from . import parallel, train_flags
from .common import (
    estimate_inputs,
    model_and_data,
    model_label,
)
from .config_file import resolved_toml
from .flags import add_engine_flags, debug_flags, engine_config, model_flags
from .interrupts import PeerFailed, sigterm_interrupts
from .invocation import Invocation, TrainInvocation
from .resume import apply_resume_flags, resume_hint
from .rundirs import RUNS, RunDir, check_writable, claim_checkpoint_dir, prepare_dir
from .train_summary import EpochLines, numerical_failure, print_summary, running


def choose_batch(
    args: argparse.Namespace, accumulation: int, device: torch.device, precision: str
) -> tuple[int, int, Optional[str]]:
    """``(batch_size, accumulation_steps, why)`` after ``--batch_size auto`` and
    ``--target_effective_batch_size``; ``why`` is None when neither applies."""
    why, batch = None, args.batch_size
    if batch == "auto":
        from ..plan.estimate import largest_batch, parse_bytes

        if args.memory_budget is None and device.type != "cuda":
            raise ValueError(
                "--batch_size auto needs --memory_budget on this device (e.g. --memory_budget 8GiB); "
                "only on CUDA is the device's free memory the default budget"
            )
        budget = (
            parse_bytes(args.memory_budget)
            if args.memory_budget is not None
            else torch.cuda.mem_get_info(device)[0]
        )
        factory, batch_of = estimate_inputs(args)
        batch, at = largest_batch(
            factory, batch_of, budget, precision, device=device if device.type == "cuda" else "cpu"
        )
        if batch < 1:
            raise ValueError(
                f"--memory_budget {args.memory_budget}: not even a batch of 1 fits "
                f"({at.peak_bytes / 2**20:,.0f} MiB predicted in {precision})"
            )
        why = (
            f"batch size {batch}: the largest whose predicted peak ({at.peak_bytes / 2**20:,.0f} MiB in "
            f"{precision}) fits {budget / 2**20:,.0f} MiB"
        )
    if args.target_effective_batch_size:
        n = args.target_effective_batch_size
        batch = min(batch, n)
        while n % batch:
            batch -= 1  # the largest micro-batch <= the chosen one that divides the target
        accumulation = n // batch
        why = (why + "; " if why else "") + (
            f"effective batch {n} = batch {batch} x accumulation {accumulation}"
        )
    return batch, accumulation, why


def cmd_train(inv: Invocation) -> int:
    if inv.args.print_config:
        print(resolved_toml(inv), end="")
        return 0
    status = parallel.maybe_relaunch(
        inv.args, inv.argv
    )  # --nproc_per_node: torchrun runs this command N times
    if status is not None:
        return status
    with sigterm_interrupts():
        return _cmd_train(inv)


def _cmd_train(inv: Invocation) -> int:
    from rich.console import Console

    args = inv.args
    if {"steps", "epochs"} <= inv.explicit and args.epochs is not None:
        raise ValueError(
            f"--steps {args.steps} and --epochs {args.epochs} both say how long to train "
            "(--epochs trains whole passes over the data instead of --steps); give one"
        )
    several = init(args.device)  # a worker of several: join the process group
    if several and args.save_model:
        raise ValueError(
            "--save_model writes one process's model; with several processes use --checkpoint_dir, "
            "then `ampkit export CKPT OUT.pt`"
        )
    console = Console(
        stderr=args.json, quiet=not is_main()
    )  # keep stdout pure JSON with --json; rank 0 speaks
    notes: list[str] = []
    config = engine_config(args, inv.flags_given, inv.file.amp, notes)
    if args.debug:
        enable_debug(anomaly=False)  # before the engine: it logs its precision choice
    seed_everything(args.seed, config.deterministic)
    device = normalize_device(local_device(args.device) if several else args.device)
    try:
        amp = MixedPrecision(device=device, config=config)
    except PrecisionError as e:  # the library's spelling of the way out, as the flag
        raise PrecisionError(str(e).replace("fp8_emulate=True", "--fp8_emulate")) from None
    for note in notes:
        console.print(f"[yellow]note:[/] {escape(note)}")
    if args.debug:
        console.print(debug_mode(amp))
    batch, accumulation, why = choose_batch(
        args, config.accumulation_steps, device, amp.precision.name
    )
    if why:
        console.print(why)
        if accumulation != amp.config.accumulation_steps:
            amp.set_accumulation_steps(accumulation)
    resolved = argparse.Namespace(
        **{**vars(args), "batch_size": batch, "accumulation_steps": accumulation}
    )
    run = TrainInvocation(resolved, inv.argv, amp.config, inv.given, why)
    if args.resume and not args.checkpoint_dir:
        raise ValueError("--resume needs --checkpoint_dir DIR (where to look for checkpoints)")
    if args.checkpoint_every and not args.checkpoint_dir:
        raise ValueError(
            "--checkpoint_every needs --checkpoint_dir DIR (where to write the checkpoints)"
        )
    log_dir = args.log_dir  # None: runs/<stamp>-<precision>, once the precision that runs is known
    locks: list[
        Any
    ] = []  # the run's directories, checked and locked (rank 0) before anything is built
    try:
        problem = None
        if is_main():
            try:
                if args.checkpoint_dir:
                    locks.append(prepare_dir(args.checkpoint_dir, "--checkpoint_dir"))
                    claim_checkpoint_dir(
                        args.checkpoint_dir, resume=args.resume, overwrite=args.overwrite
                    )
                if log_dir is None:
                    check_writable(
                        RUNS, "--log_dir"
                    )  # the default's parent; the run's own dir comes later
                elif os.path.abspath(log_dir) != os.path.abspath(args.checkpoint_dir or "\0"):
                    locks.append(prepare_dir(log_dir, "--log_dir"))
            except Exception as e:
                problem = e
        # The first collective: every rank learns rank 0's directory checks (and the run's time
        # stamp), so a refused directory ends all of them with status 2 instead of leaving some waiting.
        stamp, failed = broadcast_object((time.strftime("%Y%m%d-%H%M%S"), problem is not None))
        if problem is not None:
            raise problem
        if failed:
            raise PeerFailed(2)
        return _train(run, console, device, amp, RunDir(log_dir, stamp, locks))
    finally:
        for lock in locks:
            lock.release()


def _train(
    run: TrainInvocation, console: Any, device: torch.device, amp: MixedPrecision, where: RunDir
) -> int:
    """Build, train, report: the run's steps top to bottom."""
    args = run.args
    model, batches, amp, why = _model_and_engine(args, console, device, amp)
    model, optimizer, setup_lines = _setup(args, device, model, amp)
    trainer = _trainer(args, console, model, optimizer, amp, batches)
    resumed = _resume(run, trainer, amp, optimizer) if args.resume else []
    # Now the precision that runs is known (auto measured, a checkpoint's fallback restored): the
    # header and the run directory's name say it.
    log_dir = where.settle(running(amp))
    trainer.resume_hint = resume_hint(args, run.argv, log_dir)  # with a graceful stop's checkpoint
    console.print(_header(args, device, model, amp, amp.precision.reason if args.resume else why))
    for line in setup_lines + resumed:
        console.print(line)
    trackers = _trackers(args, amp, log_dir) if is_main() else []
    settings = trainer.settings  # the trackers are the monitor's sinks beside log.jsonl, in-process
    trainer.settings = dataclasses.replace(
        settings, log=dataclasses.replace(settings.log, dir=log_dir, sinks=trackers)
    )
    steps = _total_steps(args, batches, amp)
    remaining = steps - amp.optimizer_steps
    if remaining < 1:
        raise ValueError(f"nothing to do: already at step {amp.optimizer_steps} of --steps {steps}")
    start_skipped = amp.stats()["skipped_steps"]
    trainer.callbacks.append(EpochLines(console, args.epochs))
    started = time.perf_counter()
    try:
        summary = trainer.fit(remaining)
    finally:
        for sink in trackers:
            sink.close()  # (the monitor closed them unless fit failed before opening it: no-op)
    failure = numerical_failure(
        summary, remaining, summary.skipped_steps - start_skipped, trainer.diagnosis
    )
    for note in trainer.notes:
        console.print(f"[yellow]note:[/] {escape(note)}")
    seconds = time.perf_counter() - started
    model_path = _save_model(args, console, model, amp, summary)
    print_summary(run, console, amp, summary, log_dir, why, failure, model_path, seconds)
    if failure:
        if is_main():
            print(f"ampkit train: training failed numerically: {failure}", file=sys.stderr)
        return 3
    return 0


def _model_and_engine(
    args: argparse.Namespace, console: Any, device: torch.device, amp: MixedPrecision
) -> tuple[torch.nn.Module, Any, MixedPrecision, str]:
    """The model and its data on ``device``, and the engine after ``auto``'s measured check."""
    model, batches = model_and_data(args, device)
    model.to(device)
    why = amp.precision.reason
    # auto confirmed by measurement on a CPU (as the Trainer would); resuming keeps the checkpoint's
    if not args.resume:
        from ..choose.autoselect import confirm_auto

        why = confirm_auto(
            amp, model, batches, label=model_label(args), announce=console.print
        ).reason
    return model, batches, amp, why


def _setup(
    args: argparse.Namespace, device: torch.device, model: torch.nn.Module, amp: MixedPrecision
) -> tuple[torch.nn.Module, torch.optim.Optimizer, list[str]]:
    """Activation checkpointing, DDP/FSDP2, the optimizer, ``amp.setup``; the lines saying what it built."""
    lines = _activation_checkpointing(args, model)
    model = parallel.wrap(args, model, amp.precision, device)  # several processes: DDP or FSDP2
    fused = device.type in ("cuda", "cpu") and all(
        p.is_floating_point() for p in model.parameters()
    )
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, weight_decay=args.weight_decay, fused=fused
    )
    model, optimizer = amp.setup(model, optimizer)
    if amp.overridden_modules:
        lines.append(f"kept in fp32: {', '.join(amp.overridden_modules)}")
    for e in amp.events:
        if e.kind == "memory_efficient":
            lines.append("memory_efficient: " + "; ".join(e.data["levers"]))
    return model, optimizer, lines


def _header(
    args: argparse.Namespace,
    device: torch.device,
    model: torch.nn.Module,
    amp: MixedPrecision,
    why: str,
) -> str:
    """The run's first line: the model, where, and the precision that runs (after a resume: the
    checkpoint's, after its fallbacks) with why."""
    n_params = sum(p.numel() for p in model.parameters())
    where = (
        f"{device} x {world_size()} processes ({args.parallel})"
        if world_size() > 1
        else str(device)
    )
    rung = Rung.of(amp.config)
    return (
        f"[bold]ampkit train[/]: {model_label(args)} ({n_params / 1e6:.2f}M params) on {where} "
        f"in [bold]{running(amp)}[/] (opt level {opt_level(amp.precision.name)}) — "
        f"{rung.describe(why)}"
    )


def _trainer(
    args: argparse.Namespace,
    console: Any,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    amp: MixedPrecision,
    batches: Any,
) -> Any:
    """The Trainer, its log directory still unset (:meth:`RunDir.settle` names it after a resume)."""
    from ..train.trainer import Trainer

    eval_batches = None
    if args.eval_every:
        from ..models.builtin import MODELS

        if args.model in MODELS and hasattr(batches, "split"):
            eval_batches = dataclasses.replace(batches, split="val")
        else:
            eval_batches = lambda i: batches(10_000_000 + i)  # noqa: E731 - batches the run never trains on
    from ..train.trainer_config import CheckpointConfig, EvalConfig, LogConfig

    trainer = Trainer(
        model,
        optimizer,
        amp,
        batches,
        diagnose=not args.no_diagnose,
        fallback=False,  # the engine above is already configured from the flags
        log=LogConfig(
            dir=None,
            every=args.log_every,
            console=console,
            progress=not args.no_progress and not args.json,
        ),
        checkpoint=CheckpointConfig(
            args.checkpoint_dir, every=args.checkpoint_every, keep_last=args.keep_last
        ),
        evaluation=EvalConfig(eval_batches, every=args.eval_every, precision=args.eval_precision),
    )
    return trainer


def _trackers(args: argparse.Namespace, amp: MixedPrecision, log_dir: str) -> list[Any]:
    """--mlflow URI / --wandb PROJECT: the tracker sinks the Trainer's monitor writes to."""
    from ..observe.monitor import MLflowSink, WandbSink

    sinks: list[Any] = []
    name = os.path.basename(os.path.normpath(log_dir))
    if args.mlflow:
        sinks.append(MLflowSink(args.mlflow, run_name=name, params=amp.config.to_dict()))
    if args.wandb:
        sinks.append(WandbSink(args.wandb, run_name=name, dir=log_dir, config=amp.config.to_dict()))
    return sinks


def _total_steps(args: argparse.Namespace, batches: Any, amp: MixedPrecision) -> int:
    """``--steps``, or ``--epochs`` in optimizer steps."""
    if args.epochs is None:
        return int(args.steps)
    per_epoch = getattr(batches, "batches_per_epoch", None)
    if per_epoch is None:
        raise ValueError(
            "--epochs needs data with a batches_per_epoch attribute; use --steps for this model"
        )
    return max(1, args.epochs * per_epoch // amp.config.accumulation_steps)


def _resume(
    run: TrainInvocation, trainer: Any, amp: MixedPrecision, optimizer: torch.optim.Optimizer
) -> list[str]:
    """Load the newest good checkpoint, then apply the settings given for this run (or start
    fresh); the lines saying what it did."""
    args = run.args
    requested = amp.config  # before the checkpoint's config replaces it
    seed = torch.initial_seed()  # --seed's (the checkpoint's random state replaces it)
    with warnings.catch_warnings():  # each flag's fate is said below (apply_resume_flags)
        warnings.simplefilter("ignore", CheckpointSettingsWarning)
        path = trainer.resume()
    if path is None:
        if not args.allow_fresh:
            raise ValueError(
                f"--resume: no checkpoint in {args.checkpoint_dir!r}; pass --allow_fresh to start "
                "from scratch instead"
            )
        return [f"no checkpoint in {args.checkpoint_dir}: starting fresh (--allow_fresh)"]
    hyper = {"lr": args.lr, "weight_decay": args.weight_decay}
    notes = apply_resume_flags(
        requested, set(run.given), hyper, amp, optimizer, path, seed, data=trainer.source
    )
    return [f"resumed from {path} at step {amp.optimizer_steps} in [bold]{running(amp)}[/]"] + [
        f"[yellow]note:[/] {escape(note)}" for note in notes
    ]


def _save_model(
    args: argparse.Namespace,
    console: Any,
    model: torch.nn.Module,
    amp: MixedPrecision,
    summary: Any,
) -> Optional[str]:
    if not args.save_model or not is_main():
        return None
    from ..models.modelfile import save_model

    path = save_model(
        model,
        amp,
        args.save_model,
        {
            "model": args.model,
            "size": args.size,
            "model_config": args.model_config,
            "precision": amp.precision.name,
            "optimizer_steps": amp.optimizer_steps,
            "run_id": summary.run_id,
        },
    )
    console.print(f"model saved to [bold]{path}[/]")
    return path


def _activation_checkpointing(args: argparse.Namespace, model: torch.nn.Module) -> list[str]:
    targets = [t.strip() for t in (args.grad_ckpt_modules or "").split(",") if t.strip()]
    if args.grad_ckpt and not targets:
        from ..models.hf_configs import is_hf

        if is_hf(args.model):  # the layers: the elements of every ModuleList
            targets = [
                f"{n}.*" for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)
            ]
        elif args.model != "gpt":
            raise ValueError(
                "--grad_ckpt needs --grad_ckpt_modules for this model (module types or name globs, "
                "e.g. 'TransformerBlock' or 'layers.*'); the built-in GPT checkpoints its blocks"
            )
        else:
            targets = ["blocks.*"]
    if not targets:
        return []
    from ..step.activation_checkpointing import apply_activation_checkpointing

    try:
        done = apply_activation_checkpointing(model, targets)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"--grad_ckpt_modules {args.grad_ckpt_modules or ','.join(targets)!r}: {e}"
        ) from None
    return [
        f"activation checkpointing: {len(done)} module(s) ({', '.join(done[:4])}"
        f"{', ...' if len(done) > 4 else ''})"
    ]


def debug_mode(amp: MixedPrecision) -> str:
    """``--debug``: autograd's anomaly mode, with NaN checks unless the loss is scaled (its
    overflows are expected and skipped, not errors). Returns what it turned on."""
    check_nan = not amp.precision.needs_scaler
    torch.autograd.set_detect_anomaly(True, check_nan=check_nan)
    return (
        "debug: logging.getLogger('ampkit') at DEBUG on stderr; torch.autograd.set_detect_anomaly(True"
        + (")" if check_nan else ", check_nan=False): fp16's overflows are handled by loss scaling")
    )


def add_parser(sub: Any) -> None:
    """The train command: model and data, engine (generated from MixedPrecisionConfig), then one
    argument group per concern below, each its own function (``ampkit train --help`` shows the groups)."""
    p = sub.add_parser(
        "train",
        help="train a built-in model on local data, or yours (module:factory)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model_flags(p, size="small")
    add_engine_flags(p)
    for group in train_flags.GROUPS:
        group(p)
    debug_flags(p)
    parallel.add_flags(p)
    p.set_defaults(func=cmd_train)
