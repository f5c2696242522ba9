"""``ampkit train --nproc_per_node N``: re-run the same command under ``torch.distributed.run``.

The launcher is PyTorch's own (torchrun): this module only turns ampkit's flags into its
command line -- ``python -m ampkit.distributed.torchrun --nproc_per_node N [--nnodes M --node_rank R
--rdzv_backend c10d --rdzv_endpoint HOST:PORT --rdzv_id ID | --standalone] -m ampkit <argv>`` --
with the launch flags removed from ``argv`` (so the workers do not launch again), waits for it,
and returns its exit status. One node without an endpoint uses ``--standalone`` (a free local port).

The job lives and dies as one:

* **Signals.** SIGINT, SIGTERM and SIGHUP to the launcher are forwarded to torchrun once (a
  second signal is reported, not forwarded: torchrun would abandon the workers' shutdown), and
  torchrun forwards them to every worker, which finishes its step, checkpoints and exits
  130/143 (:mod:`ampkit.train.stop`). torchrun runs in its own session, so a Ctrl-C in the
  terminal reaches it only through the launcher -- once.
* **SIGKILL of the launcher.** torchrun is started with ``PR_SET_PDEATHSIG`` = SIGTERM: when the
  launcher dies, even by SIGKILL, torchrun gets SIGTERM and stops the workers as above; every
  worker has ``PR_SET_PDEATHSIG`` = SIGKILL towards torchrun (:func:`ampkit.distributed.env.init`),
  so no worker outlives its agent.
* **Exit status.** torchrun says 1 for any failed worker; each worker leaves its own status in a
  temporary directory (``AMPKIT_STATUS_DIR``) and the launcher returns that of the rank that
  failed first (2 for a usage error, 3 for a numerical failure, ...), or 128 + the signal it
  forwarded.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any, Optional

from .env import STATUS_DIR_ENV, die_with_parent

__all__ = ["COMMAND_ENV", "LAUNCH_FLAGS", "relaunch", "strip_flags", "torchrun_command"]

#: the launcher's own command line, for the workers' messages (e.g. the exact resume command)
COMMAND_ENV = "AMPKIT_COMMAND"
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

#: ampkit's launch flags (each takes a value); they are torchrun's own names
LAUNCH_FLAGS = ("nproc_per_node", "nnodes", "node_rank", "rdzv_endpoint", "rdzv_id", "rdzv_backend")


def strip_flags(argv: Sequence[str], names: Sequence[str] = LAUNCH_FLAGS) -> list[str]:
    """``argv`` without ``--name VALUE`` / ``--name=VALUE`` (underscore or hyphen spelling) for ``names``."""
    spellings = {f"--{n}" for n in names} | {f"--{n.replace('_', '-')}" for n in names}
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        head = a.split("=", 1)[0]
        if head in spellings:
            skip = "=" not in a
            continue
        out.append(a)
    return out


def torchrun_command(
    argv: Sequence[str],
    *,
    nproc_per_node: int,
    nnodes: str = "1",
    node_rank: Optional[int] = None,
    rdzv_endpoint: Optional[str] = None,
    rdzv_id: Optional[str] = None,
    rdzv_backend: str = "c10d",
) -> list[str]:
    """The torchrun command line that runs ``ampkit <argv>`` on ``nproc_per_node`` processes per node."""
    if nproc_per_node < 1:
        raise ValueError(f"--nproc_per_node {nproc_per_node} must be >= 1")
    multi_node = str(nnodes) not in ("1", "1:1")
    # torchrun itself, through a wrapper that exits quietly (128 + signal) when stopped by a signal.
    cmd = [
        sys.executable,
        "-m",
        "ampkit.distributed.torchrun",
        f"--nproc_per_node={nproc_per_node}",
        f"--nnodes={nnodes}",
    ]
    if rdzv_endpoint:
        cmd += [
            f"--rdzv_backend={rdzv_backend}",
            f"--rdzv_endpoint={rdzv_endpoint}",
            f"--rdzv_id={rdzv_id or 'ampkit'}",
        ]
    elif multi_node:
        raise ValueError(
            f"--nnodes {nnodes} needs --rdzv_endpoint HOST:PORT (a port on the first node, "
            "reachable from every node)"
        )
    else:
        cmd.append("--standalone")
    if node_rank is not None:
        cmd.append(f"--node_rank={node_rank}")
    return [*cmd, "-m", "ampkit", *strip_flags(argv)]


def relaunch(argv: Sequence[str], **kwargs: Any) -> int:
    """Run :func:`torchrun_command`, forwarding signals (module doc); return the job's status."""
    cmd = torchrun_command(argv, **kwargs)
    status_dir = tempfile.mkdtemp(prefix="ampkit-launch-")
    env = {**os.environ, STATUS_DIR_ENV: status_dir, COMMAND_ENV: shlex.join(["ampkit", *argv])}
    forwarded: list[int] = []
    previous: dict[int, Any] = {}
    try:
        proc = subprocess.Popen(
            cmd, env=env, start_new_session=True, preexec_fn=lambda: die_with_parent(signal.SIGTERM)
        )

        def forward(signum: int, frame: Any) -> None:
            if forwarded:
                print(
                    f"ampkit: {signal.Signals(signum).name} received again: already stopping the workers "
                    "(kill -9 this process to end the job at once)",
                    file=sys.stderr,
                    flush=True,
                )
                return
            forwarded.append(signum)
            print(
                f"ampkit: {signal.Signals(signum).name} received: forwarding it to the workers "
                "(they finish the step in flight and checkpoint it)",
                file=sys.stderr,
                flush=True,
            )
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signum)

        for sig in _FORWARDED:
            previous[sig] = signal.signal(sig, forward)
        rc = proc.wait()
        return job_status(rc, forwarded[0] if forwarded else None, status_dir)
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
        shutil.rmtree(status_dir, ignore_errors=True)


def job_status(torchrun_rc: int, signum: Optional[int], status_dir: str) -> int:
    """The job's exit status: 0 when torchrun succeeded; 128 + ``signum`` after a forwarded
    signal; else the status of the worker that failed first (statuses 130/143 are workers
    stopped *because* another failed, so they count last); else torchrun's own."""
    if torchrun_rc == 0:
        return 0
    if signum is not None:
        return 128 + int(signum)
    found = []
    for name in os.listdir(status_dir):
        path = os.path.join(status_dir, name)
        try:
            with open(path) as f:
                code = int(f.read().strip())
            found.append((code in (130, 143), os.stat(path).st_mtime_ns, code))
        except (OSError, ValueError):
            continue
    failed = sorted(x for x in found if x[2] != 0)
    if failed:
        return failed[0][2]
    return torchrun_rc if torchrun_rc > 0 else 128 - torchrun_rc
