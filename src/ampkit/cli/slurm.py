"""``ampkit slurm``: print the sbatch script for a multi-node run (``ampkit.distributed.slurm``);
the job checkpoints and requeues itself before its time limit and on preemption, then resumes."""

from __future__ import annotations

import argparse
from typing import Any

from .common import flag, positive_int
from .invocation import Invocation


def cmd_slurm(inv: Invocation) -> int:
    args = inv.args
    from ..distributed.slurm import sbatch_script

    flags = list(args.train_flags)
    if flags and flags[0] == "--":
        flags = flags[1:]
    print(
        sbatch_script(
            flags,
            nodes=args.nodes,
            gpus_per_node=args.gpus_per_node,
            partition=args.partition,
            time=args.time,
            job_name=args.job_name,
            account=args.account,
            cpus_per_task=args.cpus_per_task,
            output=args.output,
            port=args.port,
            signal_seconds=args.signal_seconds,
            env_flags=train_env_flags(),
        ),
        end="",
    )
    return 0


# Flags the script owns (the launch, the checkpoint directory), or whose upper-case names other
# tools commonly set in a job's environment (CONFIG, DEVICE, DATA, PARALLEL).
NOT_FROM_ENV = ("checkpoint_dir", "config", "device", "data", "parallel", "help")


def train_env_flags() -> dict[str, tuple[str, ...]]:
    """``ampkit train``'s value flags (name -> its spellings) that the script reads from the
    environment at submission: ``BATCH_SIZE=512 sbatch job.sh`` is ``--batch_size 512``."""
    from ..distributed.launch import LAUNCH_FLAGS
    from . import train

    parser = argparse.ArgumentParser(add_help=False)
    train.add_parser(parser.add_subparsers())
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[
        "train"
    ]
    out: dict[str, tuple[str, ...]] = {}
    for a in sub._actions:
        # exactly one value: not switches, nor --fallback / --deterministic (whose value is optional)
        if (
            a.option_strings
            and a.nargs is None
            and a.dest not in (*NOT_FROM_ENV, *LAUNCH_FLAGS)
            and a.dest not in out
            and a.const is None
        ):
            out[a.dest] = tuple(a.option_strings)
    return out


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "slurm",
        help="print an sbatch script: srun + torchrun on every node, then ampkit train",
        description="Print an sbatch script for `ampkit train` on several nodes. Everything after "
        "`--` goes to `ampkit train`, e.g.: ampkit slurm --nodes 2 --gpus_per_node 8 -- "
        "--model gpt --size large --steps 1000 --checkpoint_dir /shared/ckpt --checkpoint_every 500. "
        "The job survives preemption and the time limit: it trains with --resume "
        "--allow_fresh, checkpoints on USR1 (--signal_seconds before --time) or TERM, "
        "and requeues itself.",
    )
    flag(p, "nodes", type=positive_int, default=1, help="nodes (default: 1)")
    flag(
        p,
        "gpus_per_node",
        type=positive_int,
        default=8,
        help="GPUs (= worker processes) per node (default: 8)",
    )
    flag(p, "partition", default=None, help="Slurm partition")
    flag(p, "time", default=None, help="time limit, e.g. 04:00:00")
    flag(p, "account", default=None, help="Slurm account")
    flag(p, "cpus_per_task", type=positive_int, default=None, help="CPUs for each node's task")
    flag(p, "job_name", default="ampkit", help="job name (default: ampkit)")
    flag(p, "output", default="%x-%j.out", help="log file pattern (default: %%x-%%j.out)")
    flag(
        p,
        "port",
        type=positive_int,
        default=29500,
        help="rendezvous port on the first node (default: 29500)",
    )
    flag(
        p,
        "signal_seconds",
        type=int,
        default=120,
        help="Slurm sends the job USR1 this many seconds before --time runs out: the workers checkpoint, "
        "the job requeues itself and resumes (default: 120)",
    )
    p.add_argument(
        "train_flags", nargs=argparse.REMAINDER, help="-- then the flags for `ampkit train`"
    )
    p.set_defaults(func=cmd_slurm)
