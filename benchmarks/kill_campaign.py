"""Signal and kill campaign (issue 21): stop real `ampkit train` runs with real signals, resume
them, and check that nothing was lost.

Each kill starts a run (`ampkit train`, one process or `--nproc_per_node 2` through torchrun with
gloo on CPU) in its own temporary directory, waits a random number of logged steps, and sends one
signal:

* ``SIGINT`` / ``SIGTERM``: graceful stop (the step in flight is finished and checkpointed, exit
  130/143); ``--checkpoint_every`` = the total, so the stop's checkpoint is the only one;
* ``SIGKILL``: of the single process, or of the *launcher* for two processes (torchrun then gets
  SIGTERM through PR_SET_PDEATHSIG and the workers stop gracefully); ``--checkpoint_every 5``;
* ``SIG*@write``: the same signals aimed at a checkpoint write (``--checkpoint_every 5``; the
  directory is polled until a ``.tmp-*.pt`` file or a ``ckpt-*.partial`` directory exists, then the
  signal is sent). A SIGKILL of one process there loses that write; the run resumes from the
  previous good checkpoint.

Recorded per kill: exit status, seconds from the signal to the exit of the signalled process and
until no process of the run is left (processes whose command line holds the run's unique path,
waited for up to 20 s, then killed and counted), the newest complete checkpoint's step, the steps
lost (the last step the run reached -- the ``stop`` event's step for a graceful stop, else the last
``step`` record in log.jsonl; the runs use ``--log_every 1`` so every step is flushed -- minus the
newest checkpoint's step), then the resume (the printed ``Resume with:`` command when there is one,
else the same command plus ``--resume``) to the total, and a bitwise comparison (``torch.equal`` on
the model, the optimizer state, the loss scaler, the step count and the data position) of its final
checkpoint with an uninterrupted run of the same configuration (one per configuration, with
``--checkpoint_every`` = the total).

    python benchmarks/kill_campaign.py --kills 36 --seed 0 --out kill_campaign.json --verbose

**Kill points** (issue 34: stops of runs whose state goes beyond weights): ``--points 3`` kills at
every 3rd step instead of at random moments (``--points 1``: every step), SIGTERM with the stop's
checkpoint only and SIGKILL with ``--checkpoint_every 1`` (``--kill_every``), for

* ``fp16-fallback``: fp16 with ``--init_scale 1e9``: every step overflows until the check at step 20
  falls back to bf16 (the checks read at steps 10, 20, ...; a reading is decided on at the next);
* ``rollback``: ``benchmarks/rollback_run.py`` (a Trainer with ``spike_rollback``, a x1000 spike at
  step 14 read at step 16 and rolled back to step 12);

and the table counts the bitwise-equal resumes and the largest parameter difference from the
uninterrupted run (the training decisions -- ``spike``, ``fallback`` events with their steps -- are
compared too)::

    python benchmarks/kill_campaign.py --points 3 --configs rollback,fp16-fallback --kinds SIGTERM,SIGKILL \
        --steps 30 --verbose
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
BASE = ["--model", "mlp", "--size", "small", "--device", "cpu", "--no_progress", "--log_every", "1"]

#: name -> (processes, extra flags). bf16/fp16 are emulated on CPUs without bf16/fp16 instructions
#: (10x slower there), hence their smaller batch.
CONFIGS: dict[str, tuple[int, list[str]]] = {
    "fp32": (1, ["--precision", "fp32"]),
    "bf16": (1, ["--precision", "bf16", "--batch_size", "4"]),
    "fp32-accum2": (1, ["--precision", "fp32", "--accumulation_steps", "2"]),
    "fp16": (1, ["--precision", "fp16", "--batch_size", "4"]),
    "bf16-pure": (1, ["--precision", "bf16-pure"]),
    "ddp-2proc": (2, ["--precision", "fp32", "--nproc_per_node", "2", "--parallel", "ddp"]),
    "fsdp-2proc": (2, ["--precision", "fp32", "--nproc_per_node", "2", "--parallel", "fsdp"]),
    "fp16-fallback": (1, ["--precision", "fp16", "--init_scale", "1e9", "--batch_size", "4"]),
    "rollback": (
        1,
        [],
    ),  # benchmarks/rollback_run.py (a Trainer with spike_rollback), not `ampkit train`
}
STEPS_OF = {"rollback": 20}  # runs of a fixed length (the rollback run's spike is at step 14)
KINDS = ["SIGINT", "SIGTERM", "SIGKILL", "SIGINT@write", "SIGTERM@write", "SIGKILL@write"]
EVERY = 5  # --checkpoint_every for the SIGKILL and @write kinds
GONE_WAIT = 20.0  # seconds after the signal for every process of the run to be gone
STOP_RE = re.compile(
    r"stopped by (SIG\w+) after optimizer step (\d+); checkpoint (\S+) written\. "
    r"Resume with: (ampkit train .*)"
)
RESUMED_RE = re.compile(r"resumed from (\S+) at step (\d+)")


# ---------------------------------------------------------------------------- processes
def ampkit(args: list[str], config: str = "") -> list[str]:
    if config == "rollback":
        return [sys.executable, str(ROOT / "benchmarks" / "rollback_run.py"), *args]
    return [sys.executable, "-m", "ampkit", *args]


def live(marker: str) -> list[int]:
    """Pids of live (not zombie) processes whose command line holds ``marker``."""
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            cmd = (
                Path(f"/proc/{d}/cmdline")
                .read_bytes()
                .replace(b"\0", b" ")
                .decode(errors="replace")
            )
            state = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[-1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            pids.append(int(d))
    return pids


def wait_gone(marker: str, deadline: float) -> tuple[list[int], Optional[float]]:
    """Wait until no process holds ``marker`` or ``deadline`` (monotonic); kill what is left.
    Returns (pids left, monotonic time when none was left or None)."""
    while True:
        left = live(marker)
        if not left:
            return [], time.monotonic()
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return left, None


def read_log(path: Path) -> list[dict[str, Any]]:
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):  # a line cut short by SIGKILL
                out.append(json.loads(line))
    return out


def logged_steps(path: Path) -> int:
    try:
        text = path.read_text()
    except OSError:
        return 0
    return sum('"type":"step"' in ln.replace(" ", "") for ln in text.splitlines())


def writing(ckdir: Path) -> Optional[str]:
    """The name of a checkpoint being written in ``ckdir`` (temp file or .partial dir), or None."""
    try:
        names = os.listdir(ckdir)
    except OSError:
        return None
    for n in names:
        if (n.startswith(".tmp-") and n.endswith(".pt")) or n.endswith(".partial"):
            return n
    return None


def debris(ckdir: Path) -> list[str]:
    return (
        sorted(
            n
            for n in os.listdir(ckdir)
            if (n.startswith(".tmp-") and n.endswith(".pt")) or n.endswith(".partial")
        )
        if ckdir.is_dir()
        else []
    )


def newest_checkpoint(ckdir: Path) -> Optional[int]:
    from ampkit.loop.checkpoint import list_checkpoints

    found = list_checkpoints(str(ckdir))
    return found[-1][0] if found else None


# ---------------------------------------------------------------------------- bitwise comparison
def final_path(ckdir: Path, steps: int, nproc: int) -> Path:
    return ckdir / (f"ckpt-{steps:08d}" if nproc > 1 else f"ckpt-{steps:08d}.pt")


DECISIONS = (
    "spike",
    "fallback",
    "fallback_retry",
    "precision_switch",
)  # events that change the training


def _no_clock(obj: Any) -> Any:
    """``obj`` without wall-clock fields (an epoch's ``seconds``) and the first-skip diagnosis (an
    observation made at the monitor's reads, attached to the next fallback event)."""
    if isinstance(obj, dict):
        return {k: _no_clock(v) for k, v in obj.items() if k not in ("seconds", "diagnosis")}
    return obj


def trained_state(path: Path) -> dict[str, Any]:
    """What training computed: weights, optimizer state, loss scaler, step count, data position, and
    the training decisions (spike rollbacks, fallbacks: kind, step, data)."""
    if path.is_dir():
        from ampkit.distributed import dcp

        state = dcp.consolidate(str(path))
    else:
        from ampkit.loop.checkpoint import load_checkpoint

        state = load_checkpoint(str(path))
    return {
        "model": state["model"],
        "optimizer": state["optimizer"]["state"],
        "scaler": state["amp"]["scaler"],
        "precision": state["amp"]["precision"],
        "steps": state["amp"]["optimizer_steps"],
        "data": _no_clock(state["data"]),
        "decisions": [
            _no_clock(e) for e in state["amp"].get("events", []) if e.get("kind") in DECISIONS
        ],
    }


def max_param_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The largest absolute difference between two trained states' model tensors (fp32)."""
    diffs = [
        (x.float() - b["model"][k].float()).abs().max().item()
        for k, x in a["model"].items()
        if isinstance(x, torch.Tensor)
        and x.is_floating_point()
        and k in b["model"]
        and b["model"][k].shape == x.shape
        and x.numel()
    ]
    return max(diffs, default=0.0)


def differences(a: Any, b: Any, where: str = "state") -> list[str]:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if (
            not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor))
            or a.dtype != b.dtype
            or a.shape != b.shape
            or not torch.equal(a, b)
        ):
            return [where]
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{where} keys {sorted(map(str, set(a) ^ set(b)))}"]
        return [d for k in a for d in differences(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where} length"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [where]


# ---------------------------------------------------------------------------- one kill
@dataclass
class Kill:
    index: int
    config: str
    kind: str
    nproc: int
    target_step: (
        int  # signal after this many logged steps (the @write kinds: at the next write after it)
    )
    command: str = ""
    signalled_at_step: Optional[int] = None  # logged steps when the signal was sent
    write_seen: Optional[str] = (
        None  # @write: the temp file / .partial dir present when the signal was sent
    )
    write_left_after_kill: bool = (
        False  # that temp file / .partial dir still there after the run ended
    )
    exit_status: Optional[int] = None
    expected_status: Optional[int] = None
    exit_s: Optional[float] = None
    gone_s: Optional[float] = None
    left: list[int] = field(default_factory=list)
    stop_event: bool = False
    stop_signal: Optional[str] = None
    last_step: Optional[int] = None
    newest_ckpt: Optional[int] = None
    steps_lost: Optional[int] = None
    resume_command: str = ""
    resume_from_printed: bool = False
    resume_status: Optional[int] = None
    resumed_at: Optional[int] = None
    resume_s: Optional[float] = None
    resume_ok: bool = False
    left_after_resume: list[int] = field(default_factory=list)
    debris_after_resume: list[str] = field(default_factory=list)
    bitwise_equal: Optional[bool] = None
    max_param_diff: Optional[float] = None
    differs: list[str] = field(default_factory=list)
    note: str = ""

    @property
    def signame(self) -> str:
        return self.kind.split("@")[0]

    @property
    def graceful(self) -> bool:
        # SIGKILL of the launcher still stops the two workers gracefully (torchrun gets SIGTERM)
        return self.signame != "SIGKILL" or self.nproc > 1


def plan(n: int, seed: int, configs: list[str], kinds: list[str], steps: int) -> list[Kill]:
    """``n`` kills: kinds round-robin; for each kind, the configurations in a seeded order with the
    two-process ones at positions 0 and 3 (so every kind hits both process counts from 4 kills on)."""
    rng = random.Random(seed)
    multi = [c for c in configs if CONFIGS[c][0] > 1]
    single = [c for c in configs if CONFIGS[c][0] == 1]
    order: dict[str, list[str]] = {}
    for k in kinds:
        s, m = single[:], multi[:]
        rng.shuffle(s)
        rng.shuffle(m)
        seq: list[str] = []
        while s or m:
            take_multi = m and (len(seq) % 3 == 0 or not s)
            seq.append(m.pop(0) if take_multi else s.pop(0))
        order[k] = seq
    kills = []
    for i in range(n):
        kind = kinds[i % len(kinds)]
        cfg = order[kind][(i // len(kinds)) % len(order[kind])]
        # A random moment; @write kinds leave room for a few more writes before the end. Kinds that
        # may lose a write start after the second one, so a good checkpoint is there to resume from
        # (with none, `--resume` refuses to start fresh without --allow_fresh, by design).
        hi = int(steps * 0.7) if "@write" not in kind else steps - 4 * EVERY
        lo = 5 if kind in ("SIGINT", "SIGTERM") else 2 * EVERY
        kills.append(Kill(i, cfg, kind, CONFIGS[cfg][0], rng.randint(lo, max(lo + 1, hi))))
    rng.shuffle(kills)  # run them in a random order
    for i, k in enumerate(kills):
        k.index = i
    return kills


def points(every: int, configs: list[str], kinds: list[str], steps: int) -> list[Kill]:
    """Kills at steps ``every``, ``2 * every``, ... before the end, for each configuration and kind."""
    kills = [
        Kill(0, c, kind, CONFIGS[c][0], k)
        for c in configs
        for kind in kinds
        for k in range(every, STEPS_OF.get(c, steps), every)
    ]
    for i, k in enumerate(kills):
        k.index = i
    return kills


def run_kill(
    k: Kill,
    work: Path,
    steps: int,
    ref: Path,
    rng: random.Random,
    timeout: float,
    kill_every: int = EVERY,
) -> Kill:
    run = work / f"k{k.index:02d}-{k.config}-{k.kind.replace('@', '-at-')}"
    ckdir, logdir = run / "ck", run / "log"
    run.mkdir(parents=True)
    nproc, extra = CONFIGS[k.config]
    every = steps if k.kind in ("SIGINT", "SIGTERM") else kill_every
    args = [
        "train",
        *BASE,
        *extra,
        "--steps",
        str(steps),
        "--checkpoint_every",
        str(every),
        "--checkpoint_dir",
        str(ckdir),
        "--log_dir",
        str(logdir),
    ]
    k.command = shlex.join(["ampkit", *args])
    k.expected_status = -9 if k.signame == "SIGKILL" else 128 + signal.Signals[k.signame]
    out = run / "run.out"
    marker = str(run)
    with open(out, "w") as f:
        proc = subprocess.Popen(
            ampkit(args, k.config), stdout=f, stderr=subprocess.STDOUT, cwd=ROOT
        )
    log = logdir / "log.jsonl"
    try:
        # --- the random moment
        end = time.monotonic() + timeout
        while logged_steps(log) < k.target_step:
            if proc.poll() is not None or time.monotonic() > end:
                k.note = (
                    f"run ended (status {proc.returncode}) before step {k.target_step}"
                    if proc.poll() is not None
                    else f"no step {k.target_step} within {timeout:.0f} s"
                )
                proc.kill()
                proc.wait()
                wait_gone(marker, time.monotonic() + GONE_WAIT)
                return k
            time.sleep(0.02)
        if "@write" in k.kind:
            while (seen := writing(ckdir)) is None:
                if proc.poll() is not None or time.monotonic() > end:
                    k.note = "no checkpoint write caught before the run ended"
                    break
                time.sleep(0.0005)
            k.write_seen = seen
        else:
            time.sleep(rng.uniform(0, 0.05))  # anywhere in the step after the logged one
        k.signalled_at_step = logged_steps(log)
        t0 = time.monotonic()
        proc.send_signal(signal.Signals[k.signame])
        # --- exit
        try:
            proc.wait(timeout=GONE_WAIT)
        except subprocess.TimeoutExpired:
            k.note += " did not exit within 20 s (killed);"
            proc.kill()
            proc.wait()
        k.exit_status = proc.returncode
        k.exit_s = time.monotonic() - t0
        k.left, gone = wait_gone(marker, t0 + GONE_WAIT)
        k.gone_s = None if gone is None else gone - t0
        if k.write_seen:
            k.write_left_after_kill = (ckdir / k.write_seen).exists()
        # --- what was lost
        events = read_log(log)
        stops = [e for e in events if e.get("kind") == "stop"]
        step_recs = [
            e["step"] for e in events if e.get("type") == "step" and isinstance(e.get("step"), int)
        ]
        k.stop_event = bool(stops)
        if stops:
            k.stop_signal = stops[-1].get("signal")
            k.last_step = int(stops[-1]["step"])
        elif step_recs:
            k.last_step = max(step_recs)
        k.newest_ckpt = newest_checkpoint(ckdir)
        if k.last_step is not None:
            k.steps_lost = k.last_step - (k.newest_ckpt or 0)
        # --- resume
        text = out.read_text(errors="replace")
        printed = list(STOP_RE.finditer(" ".join(text.split())))
        m = printed[-1] if printed else None
        if m:
            words = shlex.split(m.group(4))
            k.resume_command, k.resume_from_printed = m.group(4), True
            rargs = words[1:]
        else:
            rargs = [*args, "--resume"]
            k.resume_command = shlex.join(["ampkit", *rargs])
        t1 = time.monotonic()
        try:
            r = subprocess.run(
                ampkit(rargs, k.config), capture_output=True, text=True, cwd=ROOT, timeout=600
            )
            k.resume_status, rtext = r.returncode, r.stdout + r.stderr
        except subprocess.TimeoutExpired as e:
            k.resume_status, rtext = None, f"timed out: {e}"
        k.resume_s = time.monotonic() - t1
        (run / "resume.out").write_text(rtext)
        k.left_after_resume, _ = wait_gone(marker, time.monotonic() + 5)
        rm = RESUMED_RE.search(" ".join(rtext.split()))
        k.resumed_at = int(rm.group(2)) if rm else None
        final = final_path(ckdir, steps, nproc)
        k.resume_ok = k.resume_status == 0 and final.exists()
        k.debris_after_resume = debris(ckdir)
        if k.resume_ok:
            mine, theirs = trained_state(final), trained_state(ref)
            k.differs = differences(mine, theirs)
            k.bitwise_equal = not k.differs
            k.max_param_diff = max_param_diff(mine, theirs)
        else:
            k.note += f" resume failed: {rtext.strip()[-600:]}"
        return k
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def reference(cfg: str, work: Path, steps: int) -> Path:
    """An uninterrupted run of ``cfg`` (checkpoint only at the end); its final checkpoint."""
    run = work / f"ref-{cfg}"
    nproc, extra = CONFIGS[cfg]
    args = [
        "train",
        *BASE,
        *extra,
        "--steps",
        str(steps),
        "--checkpoint_every",
        str(steps),
        "--checkpoint_dir",
        str(run / "ck"),
        "--log_dir",
        str(run / "log"),
    ]
    r = subprocess.run(ampkit(args, cfg), capture_output=True, text=True, cwd=ROOT, timeout=900)
    final = final_path(run / "ck", steps, nproc)
    if r.returncode != 0 or not final.exists():
        raise SystemExit(
            f"reference run failed ({r.returncode}): {shlex.join(['ampkit', *args])}\n"
            f"{(r.stdout + r.stderr)[-3000:]}"
        )
    wait_gone(str(run), time.monotonic() + 5)
    return final


# ---------------------------------------------------------------------------- report
def median(xs: list[float]) -> Optional[float]:
    return statistics.median(xs) if xs else None


def fmt(x: Optional[float], nd: int = 2) -> str:
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def summarize(kills: list[Kill]) -> list[dict[str, Any]]:
    rows = []
    groups: dict[tuple[str, int], list[Kill]] = {}
    for k in kills:
        groups.setdefault((k.kind, k.nproc), []).append(k)
    keys = sorted(groups, key=lambda g: (KINDS.index(g[0]) if g[0] in KINDS else 99, g[1]))
    for key in [*keys, ("all", 0)]:
        ks = kills if key == ("all", 0) else groups[key]
        lost = [k.steps_lost for k in ks if k.steps_lost is not None]
        statuses = sorted({k.exit_status for k in ks if k.exit_status is not None})
        rows.append(
            {
                "kind": key[0],
                "processes": "1+2" if key[1] == 0 else str(key[1]),
                "kills": len(ks),
                "signalled": sum(k.exit_status is not None for k in ks),
                "exit_status": ",".join(map(str, statuses)) or "-",
                "unexpected_status": sum(
                    k.exit_status is not None and k.exit_status != k.expected_status for k in ks
                ),
                "writes_hit": sum(bool(k.write_seen) for k in ks)
                if key[0].endswith("@write") or key[0] == "all"
                else None,
                "resumes_failed": sum(k.exit_status is not None and not k.resume_ok for k in ks),
                "lost_median": median([float(x) for x in lost]),
                "lost_max": max(lost) if lost else None,
                "processes_left": sum(len(k.left) for k in ks),
                "bitwise_equal": sum(bool(k.bitwise_equal) for k in ks),
                "exit_s_median": median([k.exit_s for k in ks if k.exit_s is not None]),
                "gone_s_median": median([k.gone_s for k in ks if k.gone_s is not None]),
                "configs": ", ".join(sorted({k.config for k in ks})) if key != ("all", 0) else "",
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| signal | processes | kills | exit status | resumes failed | steps lost median / max | processes left "
        "| bitwise equal | median s to exit | median s to no process | configs |"
    )
    lines = [head, "| --- | ---: | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        kills = f"{r['kills']}" + (
            f" ({r['writes_hit']} in a write)"
            if r["writes_hit"] is not None and r["kind"].endswith("@write")
            else ""
        )
        lines.append(
            f"| {r['kind']} | {r['processes']} | {kills} | {r['exit_status']} | {r['resumes_failed']} | "
            f"{fmt(r['lost_median'], 1)} / {fmt(r['lost_max'])} | {r['processes_left']} | "
            f"{r['bitwise_equal']}/{r['kills']} | {fmt(r['exit_s_median'])} | {fmt(r['gone_s_median'])} | "
            f"{r['configs']} |"
        )
    return "\n".join(lines)


def points_table(kills: list[Kill]) -> str:
    """``--points``: per configuration and kind, the bitwise-equal resumes, the largest parameter
    difference, and the kill points (the step logged when the signal went) whose resume differs."""
    lines = [
        "| config | signal | kill points | resumes failed | bitwise equal | max parameter difference "
        "| differing at steps |",
        "| --- | --- | ---: | ---: | ---: | ---: | --- |",
    ]
    groups: dict[tuple[str, str], list[Kill]] = {}
    for k in kills:
        groups.setdefault((k.config, k.kind), []).append(k)
    for (cfg, kind), ks in groups.items():
        diffs = [k.max_param_diff for k in ks if k.max_param_diff is not None]
        differ = [str(k.signalled_at_step) for k in ks if k.bitwise_equal is False]
        lines.append(
            f"| {cfg} | {kind} | {len(ks)} | {sum(not k.resume_ok for k in ks)} | "
            f"{sum(bool(k.bitwise_equal) for k in ks)}/{len(ks)} | {'-' if not diffs else f'{max(diffs):.2g}'} | "
            f"{', '.join(differ) or '-'} |"
        )
    return "\n".join(lines)


def anomalies(k: Kill, steps: int) -> list[str]:
    out = []
    if k.exit_status is None:
        return [f"not signalled: {k.note.strip()}"]
    if k.exit_status != k.expected_status:
        out.append(f"exit status {k.exit_status}, expected {k.expected_status}")
    if k.left:
        out.append(f"{len(k.left)} process(es) left after {GONE_WAIT:.0f} s")
    if k.graceful and k.steps_lost not in (0,):
        out.append(f"graceful stop lost {k.steps_lost} step(s)")
    if k.graceful and not k.stop_event:
        out.append("no stop event in log.jsonl")
    if k.graceful and k.stop_signal and k.nproc == 1 and k.stop_signal != k.signame:
        out.append(f"stop event says {k.stop_signal}")
    if k.resumed_at is not None and k.newest_ckpt is not None and k.resumed_at != k.newest_ckpt:
        out.append(f"resumed at step {k.resumed_at}, newest checkpoint {k.newest_ckpt}")
    if not k.resume_ok:
        out.append(f"resume failed (status {k.resume_status})")
    elif not k.bitwise_equal:
        out.append(f"not bitwise equal: {', '.join(k.differs[:6])}")
    if k.left_after_resume:
        out.append(f"{len(k.left_after_resume)} process(es) left after the resume")
    if k.debris_after_resume:
        out.append(
            f"left in the checkpoint dir after the resume: {', '.join(k.debris_after_resume)}"
        )
    if "@write" in k.kind and not k.write_seen:
        out.append("no write caught")
    return out


def line(k: Kill, steps: int) -> str:
    bad = anomalies(k, steps)
    write = (
        f" write {k.write_seen}{' (left)' if k.write_left_after_kill else ''}"
        if k.write_seen
        else ""
    )
    return (
        f"#{k.index:02d} {k.kind:<13} {k.config:<11} at step {fmt(k.signalled_at_step)}{write}: "
        f"exit {fmt(k.exit_status)} in {fmt(k.exit_s)} s (none left after {fmt(k.gone_s)} s), "
        f"last step {fmt(k.last_step)}, newest ckpt {fmt(k.newest_ckpt)}, lost {fmt(k.steps_lost)}, "
        f"resume {'printed' if k.resume_from_printed else '+--resume'} from {fmt(k.resumed_at)} "
        f"-> {fmt(k.resume_status)} in {fmt(k.resume_s, 1)} s, "
        f"bitwise {'=' if k.bitwise_equal else ('≠' if k.bitwise_equal is False else '-')}"
        + (f"  !! {'; '.join(bad)}" if bad else "")
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--kills", type=int, default=36)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--steps", type=int, default=200, help="total optimizer steps of every run (default: 200)"
    )
    ap.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help="comma-separated subset of: " + ", ".join(CONFIGS),
    )
    ap.add_argument(
        "--kinds", default=",".join(KINDS), help="comma-separated subset of: " + ", ".join(KINDS)
    )
    ap.add_argument("--timeout", type=float, default=300, help="seconds to reach the kill's step")
    ap.add_argument("--out", help="write every kill and the table as JSON here")
    ap.add_argument("--keep", action="store_true", help="keep the runs' directories (printed)")
    ap.add_argument("--verbose", action="store_true", help="one line per kill")
    ap.add_argument(
        "--points",
        type=int,
        help="kill at every N-th step of each configuration and kind (instead "
        "of --kills at random moments); the table then has one row per configuration and kind",
    )
    ap.add_argument(
        "--kill_every",
        type=int,
        help="--checkpoint_every of the SIGKILL and @write kinds "
        f"(default {EVERY}; 1 with --points)",
    )
    args = ap.parse_args()
    kill_every = args.kill_every or (1 if args.points else EVERY)
    if args.steps % kill_every or any(n % kill_every for n in STEPS_OF.values()):
        ap.error(
            f"--steps must be a multiple of {kill_every} (the SIGKILL kinds' --checkpoint_every)"
        )
    configs = [c for c in args.configs.split(",") if c]
    kinds = [k for k in args.kinds.split(",") if k]
    for c in configs:
        if c not in CONFIGS:
            ap.error(f"unknown config {c!r}")
    for k in kinds:
        if k not in KINDS:
            ap.error(f"unknown kind {k!r}")

    signal.signal(
        signal.SIGTERM, lambda *_: sys.exit(143)
    )  # clean up (the `finally`s) when stopped
    rng = random.Random(args.seed + 1)
    kills = (
        points(args.points, configs, kinds, args.steps)
        if args.points
        else plan(args.kills, args.seed, configs, kinds, args.steps)
    )
    work = Path(tempfile.mkdtemp(prefix="ampkit-kill-"))
    print(
        f"# torch {torch.__version__} · Python {platform.python_version()} · {os.cpu_count()} cores · "
        f"{len(kills)} kills · {args.steps} steps per run · seed {args.seed} · work dir {work}",
        flush=True,
    )
    t_start = time.monotonic()
    refs: dict[str, Path] = {}
    ref_s: dict[str, float] = {}
    try:
        for k in kills:
            steps = STEPS_OF.get(k.config, args.steps)
            if k.config not in refs:
                t = time.monotonic()
                refs[k.config] = reference(k.config, work, steps)
                ref_s[k.config] = time.monotonic() - t
                if args.verbose:
                    print(f"reference {k.config}: {ref_s[k.config]:.1f} s", flush=True)
            run_kill(k, work, steps, refs[k.config], rng, args.timeout, kill_every)
            if args.verbose:
                print(line(k, steps), flush=True)
            if not args.keep:
                for d in work.glob(f"k{k.index:02d}-*"):
                    shutil.rmtree(d, ignore_errors=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    total_s = time.monotonic() - t_start
    rows = summarize(kills)
    print()
    print(table(rows))
    if args.points:
        print()
        print(points_table(kills))
    bad = [(k, anomalies(k, args.steps)) for k in sorted(kills, key=lambda k: k.index)]
    bad = [(k, a) for k, a in bad if a]
    print()
    print(f"{len(kills)} kills in {total_s / 60:.1f} min; {len(bad)} with an anomaly")
    for k, a in bad:
        print(
            f"  #{k.index:02d} {k.kind} {k.config}: {'; '.join(a)}\n      {k.command}\n      resume: {k.resume_command}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {
                    "torch": torch.__version__,
                    "python": platform.python_version(),
                    "cores": os.cpu_count(),
                    "argv": sys.argv,
                    "steps": args.steps,
                    "seed": args.seed,
                    "minutes": total_s / 60,
                    "reference_s": ref_s,
                    "table": rows,
                    "kills": [{**asdict(k), "anomalies": anomalies(k, args.steps)} for k in kills],
                },
                f,
                indent=1,
            )
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
