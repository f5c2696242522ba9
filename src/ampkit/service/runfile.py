"""The service's contract with training: one ``run.toml`` per run, read by ``ampkit train --config``.

A run's spec (:class:`ampkit.service.schemas.RunSpec`) becomes two tables: ``[train]``, whose keys
are ``ampkit train``'s option names (what its ``--config`` reader accepts), and ``[amp]``, the
:class:`ampkit.MixedPrecisionConfig` fields of the request's ``amp`` dict, already validated at
submit. Only the flags that differ per attempt or are fixed for every run stay on the command line
(:func:`ampkit.service.runner.command_for`). The file is written once, when the run is accepted;
a resume reads the same file.

TOML has no null: a ``None`` value is left out, which means the reader's default.

The file proves it is whole: its first line says it is a run file and its last line is the sha256
of the lines above it (:func:`ampkit.step.config.seal_run_file`). ``ampkit train --config`` refuses
a run file that is cut short or changed (TOML cut at a line boundary is still TOML: 4 steps of 40),
and so does the runner before it starts one (:func:`check_run_file`).

The run's directory is 0700 and its files 0600 whatever the umask: a run's texts and settings
are its owner's, not every local user's.
"""

from __future__ import annotations

import json
import os
from typing import Any

from ..step import tomlio
from ..step.config import check_run_file as _check_sealed
from ..step.config import seal_run_file

__all__ = [
    "RUN_FILE",
    "SERVICE_CAPS",
    "SERVICE_DEFAULTS",
    "SERVICE_ONLY",
    "TEXTS_FILE",
    "TRAIN_ONLY",
    "check_run_file",
    "dumps_toml",
    "private_dir",
    "run_tables",
    "train_key",
    "write_run_file",
]

RUN_FILE = "run.toml"
#: TOML text of ``{table: {key: value}}``, ``None`` left out (:func:`ampkit.step.tomlio.dumps`).
dumps_toml = tomlio.dumps
TEXTS_FILE = "texts.json"

# RunSpec fields whose ``ampkit train`` option has another name (the REST names came first).
_RENAMED = {
    "max_length": "block_size",
    "activation_checkpointing": "grad_ckpt",
    "model_overrides": "model_config",
    "texts": "data",
}
# RunSpec fields that are not training options, and why.
SERVICE_ONLY = {
    "max_seconds": "a wall-clock limit the runner enforces by ending the run's process group",
    "user_id": "a label for the brief's clients; the owner is the token's",
    "amp": "the [amp] table (MixedPrecisionConfig fields), not a [train] key",
}


# RunSpec fields whose default is not ``ampkit train``'s, and why (an empty request is a cheap,
# resumable run on a shared server). tests/service/test_run_schema.py checks that an empty request's
# run file trains like `ampkit train` without flags but for exactly these.
SERVICE_DEFAULTS: dict[str, tuple[Any, str]] = {
    "model": ("mlp", "an empty request trains the smallest built-in model, not the GPT"),
    "size": ("tiny", "an empty request is a cheap run on a shared server"),
    "device": (
        "cpu",
        "a run takes a GPU only when its request asks for one (`ampkit train`: the best device)",
    ),
    "checkpoint_every": (
        10,
        "every run can be resumed (POST /v1/runs/{id}/resume needs a checkpoint)",
    ),
    "log_every": (
        5,
        "clients poll the metrics route: twice the points of the command line's console",
    ),
}
# RunSpec fields with an upper bound that ``ampkit train`` does not have: a request is untrusted
# input, and one request must not hold the server for months or ask for memory no machine has.
SERVICE_CAPS: tuple[str, ...] = (
    "steps",
    "batch_size",
    "accumulation_steps",
    "lr",
    "max_length",
    "epochs",
    "target_effective_batch_size",
    "checkpoint_every",
    "log_every",
)
# ``ampkit train`` options a request cannot set, and why (every other option is a RunSpec field, or a
# MixedPrecisionConfig field of its ``amp`` dict).
TRAIN_ONLY: dict[str, str] = {
    "memory_budget": "batch_size is a number in a request; 'auto' and its budget are for the command line",
    "mlflow": "trackers are the operator's: the service's runs log to their own log.jsonl (GET .../metrics)",
    "wandb": "trackers are the operator's: the service's runs log to their own log.jsonl (GET .../metrics)",
    "grad_ckpt_modules": "activation_checkpointing takes the built-in GPT's blocks or a Hugging Face model's layers",
    "eval_every": "not offered yet: a request's texts are all training data",
    "eval_precision": "not offered yet: a request's texts are all training data",
    "no_diagnose": "a service run always localizes its first skipped step (its events say where)",
    "no_progress": "the runner's --json already turns the progress bar off",
    "checkpoint_dir": "fixed by the runner: the run's directory",
    "log_dir": "fixed by the runner: the run's directory",
    "keep_last": "the runner keeps train's default",
    "resume": "POST /v1/runs/{id}/resume",
    "allow_fresh": "POST /v1/runs/{id}/resume needs a checkpoint",
    "overwrite": "a run's directory is its own",
    "print_config": "prints and exits: not a run",
    "debug": "anomaly mode is for a person at a terminal, and slow",
    "amp_opt_level": "the precision field takes O0, O1 and O2 as names; a level with a dtype is one name "
    "(bf16 with O2 is bf16-pure)",
    "nproc_per_node": "one process per run on this server",
    "nnodes": "one process per run on this server",
    "node_rank": "one process per run on this server",
    "rdzv_backend": "one process per run on this server",
    "rdzv_endpoint": "one process per run on this server",
    "rdzv_id": "one process per run on this server",
    "parallel": "one process per run on this server",
}


def train_key(field: str) -> str:
    """The ``[train]`` key (an ``ampkit train`` option name) that carries RunSpec ``field``."""
    if field in SERVICE_ONLY:
        raise KeyError(f"RunSpec field {field!r} is not a [train] key: {SERVICE_ONLY[field]}")
    return _RENAMED.get(field, field)


def run_tables(spec: dict[str, Any], run_dir: str) -> dict[str, dict[str, Any]]:
    """``{"train": ..., "amp": ...}`` of a run's spec (a ``RunSpec.model_dump()``) writing under
    ``run_dir``: files the spec refers to (texts, the saved model) are paths in ``run_dir``."""
    train = {train_key(k): v for k, v in spec.items() if k not in SERVICE_ONLY}
    overrides = spec.get("model_overrides") or {}
    train["model_config"] = ",".join(f"{k}={v}" for k, v in overrides.items()) or None
    train["data"] = os.path.join(run_dir, TEXTS_FILE) if spec.get("texts") else None
    train["save_model"] = os.path.join(run_dir, "model") if spec.get("save_model") else None
    return {"train": train, "amp": dict(spec.get("amp") or {})}


def write_run_file(spec: dict[str, Any], run_dir: str) -> str:
    """Write ``run.toml`` (and the texts it names) into ``run_dir``; returns the file's path.

    Raises ``ValueError`` for a value TOML cannot carry (a lone surrogate, a nested dict), before
    anything is written."""
    tables = run_tables(spec, run_dir)
    text = seal_run_file(dumps_toml(tables))
    private_dir(run_dir)
    if spec.get("texts"):  # atomic too: never half a file
        tomlio.write(os.path.join(run_dir, TEXTS_FILE), json.dumps(spec["texts"]), mode=0o600)
    return tomlio.write(
        os.path.join(run_dir, RUN_FILE), text, mode=0o600
    )  # atomic: never half a file


def check_run_file(run_dir: str) -> None:
    """``ValueError`` naming the file when ``run_dir``'s run file is missing, cut short or changed."""
    path = os.path.join(run_dir, RUN_FILE)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ValueError(f"run file {path!r} cannot be read: {e.strerror or e}") from None
    _check_sealed(data, path)


def private_dir(path: str) -> str:
    """``path`` made (with its missing parents) and set to mode 0700, whatever the umask."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)
    return path
