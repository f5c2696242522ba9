"""``ampkit train --resume``: the flags of a resumed run against its checkpoint, and the exact
command that resumes a stopped run.

A requeue reruns the same command line, so a flag equal to the run's own setting is not a
change: a run that fell back from fp16 to bf16 and is resumed with ``--precision fp16`` again
continues in bf16 (:func:`run_setting`); only a different value asks for a switch.
"""

from __future__ import annotations

import argparse
import os
import shlex
from collections.abc import Sequence
from typing import Any, Optional

import torch

from ..step.config import MixedPrecisionConfig
from ..step.engine import MixedPrecision
from ..step.precision import PrecisionError, resolve_precision
from ..step.rung import Rung, join_spec
from ..step.settings_diff import differing

__all__ = ["apply_resume_flags", "resume_hint", "run_setting"]


def resume_hint(
    args: argparse.Namespace, argv: Sequence[str], log_dir: Optional[str] = None
) -> str:
    """One sentence: the exact command that continues this run (``argv``, or the launcher's own
    command line under ``--nproc_per_node``), or why there is none. It names the run's ``log_dir``
    where the command did not, so the resumed run writes (and summarizes) the same log."""
    from ..distributed.launch import COMMAND_ENV

    if not args.checkpoint_dir:
        return "pass --checkpoint_dir DIR to make a run resumable"
    words = shlex.split(os.environ[COMMAND_ENV])[1:] if os.environ.get(COMMAND_ENV) else list(argv)
    words = [w for w in words if w not in ("--overwrite",)]
    if "--resume" not in words:
        words.append("--resume")
    if log_dir and not any(
        w in ("--log_dir", "--log-dir") or w.startswith(("--log_dir=", "--log-dir=")) for w in words
    ):
        words += ["--log_dir", log_dir]
    return f"Resume with: {shlex.join(['ampkit', *words])}"


#: engine settings the resume flags handle one by one (the rest: refused when they differ)
_HANDLED = {
    "precision",
    "masters",
    "state_dtype",
    "clip_grad_norm",
    "accumulation_steps",
    "keep_fp32",
}


def apply_resume_flags(
    requested: MixedPrecisionConfig,
    given: set[str],
    hyper: dict[str, float],
    amp: MixedPrecision,
    optimizer: torch.optim.Optimizer,
    path: str,
    seed: Optional[int] = None,
    data: Any = None,
) -> list[str]:
    """Settings chosen for a resumed run (``given``; values in ``requested``, the optimizer's in
    ``hyper``: ``lr``, ``weight_decay``; ``seed``: the one ``--seed`` gave before the checkpoint's
    random state replaced it) against the checkpoint's. Honoured and said: precision (via
    ``switch``), the rung, lr, weight decay, clipping. Said not to apply: the seed and the initial
    scale (the run's random state and running scale continue). Refused naming both values:
    accumulation, keep_fp32 and every other engine setting that differs (the checkpoint fixed
    them; silently keeping its value would be another run than the one asked for). ``data``: the
    resumed Trainer's :class:`~ampkit.loop.batches.BatchSource`; text other than the run's
    (``--data``) is said (another ``--block_size`` or ``--batch_size`` the Trainer refused)."""
    cfg, notes = amp.config, []
    where = os.path.basename(path)
    skip = _HANDLED | {"init_scale"}
    differ = [f for f in differing(requested, cfg) if f in given and f not in skip]
    if differ:
        said = ", ".join(f"--{f} {_v(getattr(requested, f))}" for f in differ)
        theirs = ", ".join(f"{_v(getattr(cfg, f))}" for f in differ)
        raise ValueError(
            f"{said} {'differs' if len(differ) == 1 else 'differ'} from the checkpoint's {theirs} "
            f"({where}): a resumed run keeps the "
            "engine settings it was checkpointed with; resume without "
            f"{'it' if len(differ) == 1 else 'them'} (the run goes on as it was) or start a new run"
        )
    if "accumulation_steps" in given and requested.accumulation_steps != cfg.accumulation_steps:
        raise ValueError(
            f"--accumulation_steps {requested.accumulation_steps} differs from the checkpoint's "
            f"{cfg.accumulation_steps} ({where}): changing it mid-run changes the effective batch; resume "
            f"with --accumulation_steps {cfg.accumulation_steps} or start a new run"
        )
    if "keep_fp32" in given and tuple(requested.keep_fp32) != tuple(cfg.keep_fp32):
        raise ValueError(
            f"--keep_fp32 {','.join(requested.keep_fp32) or '(none)'!r} differs from the checkpoint's "
            f"{','.join(cfg.keep_fp32) or '(none)'!r} ({where}); resume without it or start a new run"
        )
    if "clip_grad_norm" in given and requested.clip_grad_norm != cfg.clip_grad_norm:
        amp.config = cfg.replace(clip_grad_norm=requested.clip_grad_norm)
        notes.append(
            f"--clip_grad_norm {requested.clip_grad_norm} replaces the checkpoint's {cfg.clip_grad_norm}"
        )
    for name, value in hyper.items():  # the optimizer's: the checkpoint's param_groups hold them
        old = optimizer.param_groups[0].get(name)
        if name in given and old is not None and old != value:
            for group in optimizer.param_groups:
                group[name] = value
            notes.append(f"--{name} {value:g} replaces the checkpoint's {old:g}")
    if "seed" in given and seed is not None and seed != torch.initial_seed():
        notes.append(
            f"--seed {seed}: the run continues the checkpoint's random state (seed "
            f"{torch.initial_seed()}): its data order and dropout go on as they were; --seed seeds "
            "fresh runs"
        )
    if "init_scale" in given and requested.init_scale != cfg.init_scale and amp.scaler.is_enabled():
        notes.append(
            f"--init_scale {_v(requested.init_scale)}: the loss scale continues from the checkpoint "
            f"({amp.scaler.get_scale():g} now); --init_scale sets a fresh run's first scale"
        )
    change = data.file_change() if data is not None else None
    if change is not None:
        notes.append(_data_note(*change, amp.optimizer_steps))
    requeued = False  # the run's own setting given again after a fallback: nothing to switch
    if "precision" in given and requested.precision != "auto":
        current, setting = amp.precision.name, run_setting(amp)
        try:
            wanted = resolve_precision(
                requested.precision, amp.device_info, emulate_fp8=amp.config.fp8_emulate
            ).name
        except PrecisionError:
            wanted = requested.precision  # switch() below raises the clear error
        requeued = wanted == setting and current != setting
        if requeued:
            # The same command line again (a requeue, a restart): not a request to undo the fallback.
            notes.append(
                f"--precision {requested.precision} is the run's own setting; it fell back to {current} "
                f"({_fallback_story(amp)}): continuing in {current} (give another --precision to switch)"
            )
        elif wanted != current:
            amp.switch(requested.precision, reason="--precision given on resume")
            notes.append(
                f"--precision {requested.precision} switches the checkpoint's {current} to "
                f"{amp.precision.name}"
            )
    elif "precision" in given:
        notes.append(f"--precision auto keeps the checkpoint's {amp.precision.name}")
    if not requeued:
        notes += _rung_given(requested, given, amp)
    return notes


def _rung_given(requested: MixedPrecisionConfig, given: set[str], amp: MixedPrecision) -> list[str]:
    """A memory-ladder rung given for a resumed bf16-pure run (``--masters``, ``--state_dtype``, or
    the whole rung with ``--precision``) that differs from the checkpoint's: a switch, said. The
    same command line again asks for the rung the run has: nothing changes."""
    spelled = "precision" in given and requested.precision != "auto"
    flags = [f for f in ("masters", "state_dtype") if f in given]
    if not (spelled or flags) or not amp.precision.row.has_ladder:
        return []
    now = Rung.of(amp.config)
    want = Rung(
        requested.masters if spelled or "masters" in flags else now.masters,
        requested.state_dtype if spelled or "state_dtype" in flags else now.state_dtype,
    )
    if want == now:
        return []
    name = amp.precision.name
    said = " ".join(f"--{f} {getattr(requested, f)}" for f in flags) or f"--precision {name}"
    amp.switch(name, reason=f"{said} given on resume", **want.fields())
    return [f"{said} switches the checkpoint's {join_spec(name, now)} to {join_spec(name, want)}"]


def _data_note(saved: Optional[str], now: Optional[str], step: int) -> str:
    """The run read ``saved`` (None: the built-in corpus) until step ``step``; it goes on with
    ``now``: the model, optimizer and position carry over, the text does not."""
    if now is None:
        return (
            f"no --data: the run read {saved} until step {step}; it goes on with the built-in "
            f"corpus (give --data {saved} to go on with its text)"
        )
    theirs = saved if saved is not None else "built-in corpus"
    return (
        f"--data {now} replaces the run's {theirs}: training goes on from step {step} with other "
        "text (not the batches the run would have read)"
    )


def _v(value: object) -> str:
    """A setting as a flag spells it."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return ",".join(map(str, value)) or "(none)"
    return f"{value:g}" if isinstance(value, float) else str(value)


def run_setting(amp: MixedPrecision) -> str:
    """The precision the run was last *asked* for: the target of the newest explicit switch, else
    the precision it started in (before any fallback), else the current one."""
    events = amp.events
    for e in reversed(events):
        if e.kind == "precision_switch":
            return str(e.data["to"])
    for e in events:
        if e.kind == "fallback":
            return str(e.data["from"])
    return amp.precision.name


def _fallback_story(amp: MixedPrecision) -> str:
    steps = [
        f"{e.data['from']} -> {e.data['to']} at step {e.step}"
        for e in amp.events
        if e.kind == "fallback"
    ]
    return "; ".join(steps) or "an earlier switch"
