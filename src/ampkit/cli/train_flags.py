"""``ampkit train``'s own flags, one argument group per concern (the model, data, engine and
debugging flags are shared with other commands: :mod:`.flags`)."""

from __future__ import annotations

import argparse
from typing import Any

from .common import flag, memory_size, positive_float, positive_int, seed_int, unit_float

__all__ = ["GROUPS"]


def _batch_size_arg(text: str) -> Any:
    return "auto" if str(text).strip().lower() == "auto" else positive_int(text)


def _length_and_batch_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("run length, batch and memory")
    flag(
        g,
        "steps",
        type=positive_int,
        default=100,
        help="optimizer steps; with --resume, the total to reach (default: 100)",
    )
    flag(
        g,
        "epochs",
        type=positive_int,
        default=None,
        help="train this many epochs instead of --steps (not both)",
    )
    flag(
        g,
        "batch_size",
        type=_batch_size_arg,
        default=16,
        help="micro-batch size, or 'auto': the largest that fits --memory_budget by the estimate (default: 16)",
    )
    flag(
        g,
        "memory_budget",
        type=memory_size,
        default=None,
        help="with --batch_size auto: the memory to fit, e.g. 8GiB (default on CUDA: the device's free memory)",
    )
    flag(
        g,
        "target_effective_batch_size",
        type=positive_int,
        default=None,
        help="derive --accumulation_steps so that batch_size x accumulation_steps equals this",
    )
    flag(
        g,
        "grad_ckpt",
        action="store_true",
        help="activation checkpointing (the built-in GPT's blocks)",
    )
    flag(
        g,
        "grad_ckpt_modules",
        default=None,
        help="activation-checkpoint these module types / name globs (comma-separated); implies --grad_ckpt",
    )


def _optimizer_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimizer and seed")
    flag(g, "lr", type=positive_float, default=1e-3, help="AdamW learning rate (default: 1e-3)")
    flag(
        g, "weight_decay", type=unit_float, default=0.01, help="AdamW weight decay (default: 0.01)"
    )
    flag(
        g,
        "seed",
        type=seed_int,
        default=0,
        help="seed of every generator the run uses: torch (CPU and CUDA), "
        "Python's random, numpy (default: 0)",
    )


def _logging_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("logging")
    flag(
        g,
        "log_every",
        type=positive_int,
        default=10,
        help="read metrics to the host every N steps (default: 10)",
    )
    flag(
        g,
        "log_dir",
        default=None,
        help="run directory for logs (default: runs/<timestamp>-<precision>[+<rung>])",
    )
    flag(g, "no_progress", action="store_true", help="no progress bar")
    flag(g, "no_diagnose", action="store_true", help="do not localize the first skipped step")
    flag(
        g,
        "mlflow",
        default=None,
        metavar="URI",
        help="also log to MLflow at this tracking URI, e.g. "
        "file:///tmp/mlruns (needs ampkit[mlflow])",
    )
    flag(
        g,
        "wandb",
        default=None,
        metavar="PROJECT",
        help="also log to this Weights & Biases project "
        "(WANDB_MODE=offline works without an account; needs ampkit[wandb])",
    )


def _evaluation_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("evaluation")
    flag(
        g,
        "eval_every",
        type=positive_int,
        default=None,
        help="evaluate on held-out batches every N steps",
    )
    flag(
        g,
        "eval_precision",
        default="train",
        choices=["train", "fp32"],
        help="evaluate in the training precision or strict fp32 (default: train)",
    )


def _checkpoint_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("checkpoints and resume")
    flag(g, "checkpoint_dir", default=None, help="write checkpoints here (atomically)")
    flag(
        g,
        "checkpoint_every",
        type=positive_int,
        default=None,
        help="checkpoint every N optimizer steps",
    )
    flag(g, "keep_last", type=positive_int, default=3, help="checkpoints to keep (default: 3)")
    flag(
        g,
        "resume",
        action="store_true",
        help="continue from the newest good checkpoint in --checkpoint_dir "
        "(--steps is the total to reach)",
    )
    flag(
        g,
        "allow_fresh",
        action="store_true",
        help="with --resume: start fresh when there is no checkpoint",
    )
    flag(
        g,
        "overwrite",
        action="store_true",
        help="start a new run in a --checkpoint_dir that holds another run's "
        "checkpoints, deleting them",
    )


def _output_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("settings file and output")
    flag(
        g,
        "config",
        default=None,
        metavar="FILE.toml",
        help="read settings from TOML: an [amp] table (MixedPrecisionConfig fields) and a [train] table "
        "(these options' names, e.g. steps = 200); flags given on the command line override the file",
    )
    flag(g, "json", action="store_true", help="print the summary as JSON")
    flag(
        g,
        "save_model",
        default=None,
        metavar="DIR",
        help="save the trained weights (fp32) to DIR at the end: save_pretrained for Hugging Face models, "
        "else DIR/model.pt",
    )


GROUPS = (
    _length_and_batch_flags,
    _optimizer_flags,
    _logging_flags,
    _evaluation_flags,
    _checkpoint_flags,
    _output_flags,
)
