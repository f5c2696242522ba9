"""The sbatch script for a multi-node run: ``srun`` starts one torchrun per node, torchrun the workers.

One Slurm task per node runs ``python -m torch.distributed.run`` with c10d rendezvous on the
job's first node (``scontrol show hostnames``), ``--nproc_per_node`` workers each (one per GPU),
and ``-m ampkit train <flags>``. Settings that change from submission to submission are shell
variables with defaults, overridable from the environment: ``PRECISION=fp16 sbatch job.sh``.

The script survives preemption and the time limit: it asks Slurm for ``SIGUSR1``
``signal_seconds`` before the limit (``--signal=B:USR1@N``, to the batch shell only), allows
requeue (``--requeue``, ``--open-mode=append``: a requeued job appends to the same log) and
always trains with ``--resume --allow_fresh`` in a checkpoint directory that outlives the job
(``--checkpoint_dir``, by default ``checkpoints/$SLURM_JOB_ID``: the job id stays the same
across requeues). ``srun`` runs in the background while the batch shell waits; on ``USR1`` or
``TERM`` the shell forwards ``SIGTERM`` to ``srun`` (srun to torchrun, torchrun to the workers,
which checkpoint and exit), waits for it, then on ``USR1`` requeues the job (``scontrol
requeue``) and exits 0; on ``TERM`` (preemption, ``scancel``) it exits 143 and Slurm requeues a
preempted job itself. The next run resumes from the newest checkpoint. See docs/guides/slurm.md.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from typing import Optional

__all__ = ["sbatch_script"]

_TIME = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$|^\d+$")
_MAX_SIGNAL_SECONDS = 65535  # sbatch --signal: sig_time is 0..65535


def _take(flags: list[str], name: str) -> Optional[str]:
    """Remove ``--name VALUE`` / ``--name=VALUE`` (either spelling) from ``flags``; return VALUE."""
    spellings = {f"--{name}", f"--{name.replace('_', '-')}"}
    for i, a in enumerate(flags):
        head, _, value = a.partition("=")
        if head in spellings:
            if value or "=" in a:
                del flags[i]
                return value
            if i + 1 >= len(flags):
                raise ValueError(f"{a} needs a value")
            value = flags[i + 1]
            del flags[i : i + 2]
            return value
    return None


def _env_flags(
    flags: list[str], env_flags: Mapping[str, Sequence[str]]
) -> tuple[list[str], list[str], str]:
    """Make ``ampkit train``'s value flags settable from the environment at submission.

    A flag given in ``flags`` (any of its spellings) becomes the default of its variable, named
    like the flag in upper case (``--batch_size 16`` -> ``BATCH_SIZE=${BATCH_SIZE:-16}`` and
    ``--batch_size "$BATCH_SIZE"``; taken out of ``flags``). The others are read by a loop: a
    variable that is set adds its flag. Returns ``(variable lines, loop lines, the train command's
    words for them)``.
    """
    defaults, rest, words = [], [], ""
    for name, spellings in env_flags.items():
        var = name.upper()
        value = _take_any(flags, spellings)
        if value is None:
            rest.append(name)
            continue
        defaults.append(f"{var}=${{{var}:-{shlex.quote(value)}}}")
        words += f' --{name} "${var}"'
    loop = (
        []
        if not rest
        else [
            "# Any other `ampkit train` flag from the environment at submission: a variable named like the flag",
            "# in upper case (BATCH_SIZE=512 sbatch job.sh -> --batch_size 512).",
            "ENV_FLAGS=()",
            f"for name in {' '.join(rest)}; do",
            "    var=${name^^}",
            '    if [ -n "${!var:-}" ]; then ENV_FLAGS+=("--$name" "${!var}"); fi',
            "done",
            'if [ ${#ENV_FLAGS[@]} -gt 0 ]; then echo "ampkit: from the environment: ${ENV_FLAGS[*]}"; fi',
        ]
    )
    if loop:
        words += ' ${ENV_FLAGS[@]+"${ENV_FLAGS[@]}"}'  # (an empty array under set -u, bash < 4.4)
    return defaults, loop, words


def _take_any(flags: list[str], spellings: Sequence[str]) -> Optional[str]:
    """:func:`_take` for any of ``spellings`` (``--mixed_precision`` is ``--precision``); the last one given wins."""
    value = None
    for s in spellings:
        while (v := _take(flags, s.lstrip("-"))) is not None:
            value = v
    return value


def _has_switch(flags: Sequence[str], name: str) -> bool:
    """Whether the on/off flag ``--name`` (either spelling) is among ``flags``."""
    spellings = {f"--{name}", f"--{name.replace('_', '-')}"}
    return any(a.partition("=")[0] in spellings for a in flags)


def _time_seconds(time: str) -> int:
    """A Slurm time limit in seconds: MINUTES, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS."""
    days, _, rest = time.rpartition("-")
    parts = [int(p) for p in rest.split(":")]
    if days:
        parts += [0] * (3 - len(parts))  # D-HH[:MM[:SS]]
        h, m, s = parts
    else:
        h, m, s = ([0] * (3 - len(parts)) + parts) if len(parts) > 1 else (0, parts[0], 0)
    return ((int(days or 0) * 24 + h) * 60 + m) * 60 + s


def _config_train_table(path: str) -> dict:
    """The ``[train]`` table of ``--config FILE.toml`` (read here, so that it is checked too)."""
    from ..step.config import ConfigError, read_toml

    try:
        table = read_toml(path).get("train", {})
    except (ConfigError, OSError) as e:
        raise ValueError(
            f"--config {path!r}: ampkit slurm reads it to see whether [train] sets checkpoint_dir or "
            f"overwrite, and cannot: {e}"
        ) from None
    return table if isinstance(table, dict) else {}


def _check_values(
    nodes: int, gpus_per_node: int, port: int, time: Optional[str], signal_seconds: int
) -> None:
    """Raise ``ValueError`` naming the first bad value of :func:`sbatch_script`."""
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(f"--nodes {nodes} and --gpus_per_node {gpus_per_node} must both be >= 1")
    if not 1 <= port <= 65535:
        raise ValueError(f"--port {port} is not a TCP port (1..65535)")
    if time is not None and not _TIME.match(time):
        raise ValueError(
            f"--time {time!r} is not a Slurm time limit (MINUTES, HH:MM:SS or D-HH:MM:SS)"
        )
    if (
        isinstance(signal_seconds, bool)
        or not isinstance(signal_seconds, int)
        or not 1 <= signal_seconds <= _MAX_SIGNAL_SECONDS
    ):
        raise ValueError(
            f"--signal_seconds {signal_seconds!r} must be a whole number of seconds from 1 to "
            f"{_MAX_SIGNAL_SECONDS} (how long before the time limit Slurm sends the USR1 warning)"
        )
    if time is not None and signal_seconds >= _time_seconds(time):
        raise ValueError(
            f"--signal_seconds {signal_seconds} is not shorter than --time {time} "
            f"({_time_seconds(time)} s): the USR1 warning would come before the job could train"
        )


# The batch shell's signal handling (see sbatch_script's docstring).
_SIGNAL_HANDLING = [
    "# Preemption and the time limit: Slurm sends this shell USR1 before the limit (#SBATCH --signal)",
    "# and TERM on preemption or scancel. Either stops srun with SIGTERM (the workers write a",
    "# checkpoint and exit); after it ends, USR1 requeues the job, TERM exits 143 (Slurm requeues a",
    "# preempted job itself). The next run resumes from the newest checkpoint (--resume).",
    'SRUN_PID="" SIGNAL="" FORWARDED="" WOKEN=""',
    "stop_srun() {",
    '    if [ -n "$SRUN_PID" ] && [ -z "$FORWARDED" ]; then',
    "        FORWARDED=1",
    '        kill -TERM "$SRUN_PID" 2>/dev/null || true',
    "    fi",
    "}",
    "on_signal() {",
    "    WOKEN=1",
    '    if [ -n "$SIGNAL" ]; then',
    '        echo "ampkit: SIG$1 while already stopping after SIG$SIGNAL: still waiting for srun" >&2',
    "        return 0",
    "    fi",
    "    SIGNAL=$1",
    '    if [ "$1" = USR1 ]; then',
    '        echo "ampkit: time limit near: checkpointing, then requeue of job $SLURM_JOB_ID" >&2',
    "    else",
    '        echo "ampkit: SIGTERM (preemption or scancel): checkpointing, then exit" >&2',
    "    fi",
    "    stop_srun",
    "}",
    "trap 'on_signal USR1' USR1",
    "trap 'on_signal TERM' TERM",
    "",
]


def _wait_then_requeue_or_exit(resubmit: str) -> list[str]:
    """After srun started: wait for it, then requeue (USR1), exit 143 (TERM) or with its status."""
    return [
        "SRUN_PID=$!",
        'if [ -n "$SIGNAL" ]; then stop_srun; fi  # a signal that came before srun started',
        "",
        "# wait returns early when a trapped signal arrives: wait again until srun has really ended.",
        "while :; do",
        '    WOKEN=""',
        "    STATUS=0",
        '    wait "$SRUN_PID" || STATUS=$?',
        '    if [ -z "$WOKEN" ]; then break; fi',
        "done",
        'if [ -z "$SIGNAL" ]; then exit "$STATUS"; fi',
        'if [ "$STATUS" = 0 ]; then',
        '    echo "ampkit: training finished before the SIG$SIGNAL took effect: nothing to requeue" >&2',
        "    exit 0",
        "fi",
        'if [ "$SIGNAL" = USR1 ]; then',
        '    if scontrol requeue "$SLURM_JOB_ID"; then',
        '        echo "ampkit: job $SLURM_JOB_ID requeued (srun exited $STATUS); it resumes when it runs again" >&2',
        "        exit 0",
        "    fi",
        '    echo "ampkit: scontrol requeue $SLURM_JOB_ID failed; to resume, submit again: '
        + resubmit
        + '" >&2',
        "    exit 1",
        "fi",
        'echo "ampkit: stopped by SIGTERM (srun exited $STATUS); Slurm requeues a preempted job (--requeue), '
        'a cancelled one stays cancelled" >&2',
        "exit 143",
    ]


def sbatch_script(
    train_flags: Sequence[str],
    *,
    nodes: int,
    gpus_per_node: int,
    partition: Optional[str] = None,
    time: Optional[str] = None,
    job_name: str = "ampkit",
    account: Optional[str] = None,
    cpus_per_task: Optional[int] = None,
    output: str = "%x-%j.out",
    port: int = 29500,
    precision: str = "bf16",
    signal_seconds: int = 120,
    env_flags: Optional[Mapping[str, Sequence[str]]] = None,
) -> str:
    """An sbatch script running ``ampkit train <train_flags>`` on ``nodes`` x ``gpus_per_node`` workers.

    ``--precision`` in ``train_flags`` becomes the default of ``$PRECISION``; launch flags
    (``--nproc_per_node`` ...) are refused there, the script sets them.

    The job is requeueable and resumes: ``--resume --allow_fresh`` are added to the train flags
    unless given, and ``--checkpoint_dir "$CHECKPOINT_DIR"`` (default ``checkpoints/$SLURM_JOB_ID``)
    unless the flags or the ``[train]`` table of their ``--config`` name one; ``--overwrite`` is
    refused (a requeued run must never delete its own checkpoints). Slurm sends the batch shell
    ``USR1`` ``signal_seconds`` before the time limit; the shell then stops ``srun`` with
    ``SIGTERM`` (the workers checkpoint), waits for it and requeues the job (``scontrol requeue``,
    exit 0). On ``TERM`` (preemption, ``scancel``) it stops ``srun`` the same way and exits 143.
    Without a signal it exits with ``srun``'s status.

    ``env_flags`` (flag name -> its spellings; ``ampkit slurm`` passes every value flag of ``ampkit
    train``) are read from the environment at submission, like ``PRECISION`` (:func:`_env_flags`).

    Raises ``ValueError`` for a bad value, naming it.
    """
    _check_values(nodes, gpus_per_node, port, time, signal_seconds)
    flags = list(train_flags)
    if flags and flags[0] == "train":
        flags = flags[1:]
    from .launch import LAUNCH_FLAGS

    for name in LAUNCH_FLAGS:
        if _take(list(flags), name) is not None:
            raise ValueError(
                f"--{name} belongs to the script (srun + torchrun set it), not to the train flags"
            )
    config = _take(list(flags), "config")
    file_train = _config_train_table(config) if config else {}
    if _has_switch(flags, "overwrite") or file_train.get("overwrite") is True:
        where = (
            f"[train] overwrite in --config {config}"
            if not _has_switch(flags, "overwrite")
            else "--overwrite"
        )
        raise ValueError(
            f"{where}: the script resumes the run after a requeue, and --overwrite would delete its "
            "checkpoints; remove it (or empty the --checkpoint_dir yourself before submitting)"
        )
    precision = _take_any(flags, (env_flags or {}).get("precision", ("precision",))) or precision
    env_defaults, env_loop, env_words = _env_flags(
        flags, {k: v for k, v in (env_flags or {}).items() if k != "precision"}
    )
    own_dir = _take(list(flags), "checkpoint_dir") is None and "checkpoint_dir" not in file_train
    extra = [] if _has_switch(flags, "resume") else ["--resume"]
    extra += [] if _has_switch(flags, "allow_fresh") else ["--allow_fresh"]
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={gpus_per_node}",
        f"#SBATCH --output={output}",
    ]
    for key, value in (
        ("partition", partition),
        ("time", time),
        ("account", account),
        ("cpus-per-task", cpus_per_task),
    ):
        if value is not None:
            lines.append(f"#SBATCH --{key}={value}")
    lines += [
        "#SBATCH --requeue",
        "#SBATCH --open-mode=append",
        f"#SBATCH --signal=B:USR1@{signal_seconds}",
    ]
    q = shlex.quote
    # A new submission is a new job id: it resumes only in the same checkpoint directory.
    resubmit = (
        "CHECKPOINT_DIR=$CHECKPOINT_DIR sbatch <this script>" if own_dir else "sbatch <this script>"
    )
    # How long torchrun waits for its workers after SIGTERM before SIGKILL (recent torch reads
    # TORCH_ELASTIC_SHUTDOWN_TIMEOUT; older ones wait 30 s): most of the warning time, leaving
    # some for the requeue.
    grace = max(signal_seconds - 10, signal_seconds // 2, 1)
    lines += [
        "",
        "# Generated by `ampkit slurm`. Override at submission, e.g.: PRECISION=fp16 sbatch this.sh",
        "set -euo pipefail",
        f"PRECISION=${{PRECISION:-{q(precision)}}}",
        f"NPROC_PER_NODE=${{NPROC_PER_NODE:-{gpus_per_node}}}",
        f"RDZV_PORT=${{RDZV_PORT:-{port}}}",
        *env_defaults,
    ]
    if own_dir:
        lines.append(
            "CHECKPOINT_DIR=${CHECKPOINT_DIR:-checkpoints/$SLURM_JOB_ID}  # the job id survives requeues"
        )
    lines += [
        "PYTHON=${PYTHON:-python3}",
        "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}",
        f"export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${{TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-{grace}}}"
        "  # torchrun's wait for checkpointing workers",
        "",
        *_SIGNAL_HANDLING,
        *env_loop,
        "# Rendezvous on the job's first node; every node runs one torchrun, torchrun one worker per GPU.",
        'HEAD_NODE=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        'echo "ampkit: $SLURM_JOB_NUM_NODES node(s) x $NPROC_PER_NODE process(es), rendezvous $HEAD_NODE:$RDZV_PORT, '
        'precision $PRECISION"',
        'if [ "${SLURM_RESTART_COUNT:-0}" != 0 ]; then',
        '    echo "ampkit: restart $SLURM_RESTART_COUNT of job $SLURM_JOB_ID: resuming from its newest checkpoint"',
        "fi",
        "",
        'srun --kill-on-bad-exit=1 "$PYTHON" -m torch.distributed.run \\',
        '    --nnodes="$SLURM_JOB_NUM_NODES" --nproc_per_node="$NPROC_PER_NODE" \\',
        '    --rdzv_id="$SLURM_JOB_ID" --rdzv_backend=c10d --rdzv_endpoint="$HEAD_NODE:$RDZV_PORT" \\',
        '    -m ampkit train --precision "$PRECISION"'
        + "".join(f" {q(f)}" for f in flags)
        + env_words
        + "".join(f" {f}" for f in extra)
        + (' --checkpoint_dir "$CHECKPOINT_DIR"' if own_dir else "")
        + " &",
        *_wait_then_requeue_or_exit(resubmit),
        "",
    ]
    return "\n".join(lines)
