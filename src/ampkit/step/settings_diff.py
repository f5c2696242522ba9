"""What a checkpoint's engine settings replace: :meth:`MixedPrecision.load_state_dict` restores the
settings a run was checkpointed with (the checkpoint is the run), and says so when they differ
from the ones the engine was made with -- a ``MixedPrecision("bf16", clip_grad_norm=0.5)`` that
loads a checkpoint clipped at 1.0 goes on clipping at 1.0, and a silent change of settings is a
silently different run. ``torch.amp.GradScaler.load_state_dict`` replaces its factors the same way,
without a word."""

from __future__ import annotations

import warnings
from dataclasses import fields
from typing import Any

__all__ = ["CheckpointSettingsWarning", "differing", "warn_replaced"]

#: settings that change no number of the run (the ladder's scratch only sizes a buffer)
QUIET = ("precision", "ladder_scratch_mib")


class CheckpointSettingsWarning(UserWarning):
    """A loaded state's engine settings replaced different ones (filter it where that is meant:
    ``ampkit train --resume`` says each flag's fate itself, a spike rollback restores its own)."""


def differing(mine: Any, theirs: Any) -> list[str]:
    """The names of the settings (config fields) whose values differ, in the config's order."""
    return [f.name for f in fields(mine) if getattr(mine, f.name) != getattr(theirs, f.name)]


def warn_replaced(mine: Any, theirs: Any, precision: tuple[str, str], source: str) -> None:
    """Warn, naming each setting of config ``mine`` that ``theirs`` replaced and the precision
    ``(mine, theirs)`` when it differs; nothing when all are equal."""
    changed = [
        f"{name} {getattr(mine, name)!r} -> {getattr(theirs, name)!r}"
        for name in differing(mine, theirs)
        if name not in QUIET
    ]
    if precision[0] != precision[1] and getattr(mine, "precision", None) != "auto":
        # (an engine asked for "auto" takes the run's confirmed pick without a word)
        changed.insert(0, f"precision {precision[0]} -> {precision[1]}")
    if changed:
        warnings.warn(
            CheckpointSettingsWarning(
                f"{source} replaced this engine's settings with the ones it was saved with: "
                f"{'; '.join(changed)} (the run goes on as it was saved, a fallback included)"
            ),
            stacklevel=3,
        )
