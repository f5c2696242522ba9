"""What a numerics trigger reports: the trigger itself, the ``fallback`` / ``fallback_retry`` /
``fallback_exhausted`` / ``scale_exhausted`` events' data, :class:`NumericsError` and its message
naming the first non-finite layer. The decisions are :mod:`ampkit.step.fallback`'s (which
re-exports these names)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from .localize import NonFiniteReport

__all__ = [
    "NumericsError",
    "Trigger",
    "chain_exhausted",
    "fallback_data",
    "nonfinite_grads",
    "recover_data",
    "scale_exhausted",
]


class NumericsError(RuntimeError):
    """Training stays non-finite: in the last precision of the fallback chain, or (fallback off)
    with the loss scale exhausted at its floor."""


@dataclass(frozen=True)
class Trigger:
    reason: str  # consecutive_skips | min_scale | scale_floor | nonfinite_unscaled | scale_exhausted (guard)
    detail: str
    consecutive_skips: int
    scale: Optional[float]
    nonfinite: tuple[
        str, ...
    ] = ()  # parameters with non-finite gradients when it fired (model order)
    target: Optional[str] = None  # ``recover``: the precision to retry
    recover_after: Optional[int] = (
        None  # with fallback_recover_after: clean steps before the next retry
    )


def nonfinite_grads(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """The names, in the given order, of the tensors whose ``.grad`` holds inf/NaN.

    ``named`` is e.g. ``model.named_parameters()`` (with fp32 masters: each name paired with the
    tensor the optimizer steps). Sharded (DTensor) gradients are checked on this process's shard.
    **Syncs** once: for error messages and fallback events, never per step.
    """
    names, flags = [], []
    for name, t in named:
        g = t.grad
        if g is None:
            continue
        if g.is_sparse:
            g = g.coalesce()._values()
        local = getattr(g, "to_local", None)
        g = local() if local is not None else g
        names.append(name)
        flags.append(torch.isfinite(g).all())
    if not flags:
        return []
    dev = flags[0].device
    bad = torch.stack([f.to(dev) for f in flags]).logical_not().tolist()
    return [n for n, b in zip(names, bad) if b]


def fallback_data(trigger: Trigger, diagnosis: Optional[NonFiniteReport]) -> dict[str, Any]:
    """The data of the ``fallback`` event a trigger causes."""
    data: dict[str, Any] = {
        "reason": f"{trigger.reason}: {trigger.detail}",
        "trigger": trigger.reason,
        "detail": trigger.detail,
        "consecutive_skips": trigger.consecutive_skips,
        "scale": trigger.scale,
        "nonfinite_params": list(trigger.nonfinite),
    }
    if trigger.recover_after is not None:
        data["recover_after"] = (
            trigger.recover_after
        )  # the wait before the next retry (doubled after a retry)
    if diagnosis is not None:
        data["diagnosis"] = diagnosis.to_dict()
    return data


def recover_data(trigger: Trigger) -> dict[str, Any]:
    """The data of the ``fallback_retry`` event a ``recover`` trigger causes."""
    return {
        "reason": f"recover: {trigger.detail}",
        "trigger": "recover",
        "detail": trigger.detail,
        "recover_after": trigger.recover_after,
    }


def chain_exhausted(
    trigger: Trigger, precision: str, chain: tuple[str, ...], diagnosis: Optional[NonFiniteReport]
) -> tuple[dict[str, Any], NumericsError]:
    """The ``fallback_exhausted`` event's data and the error: the chain's last precision stays non-finite."""
    data = fallback_data(trigger, diagnosis)
    del data["reason"]
    culprit = f"; {_culprit(list(trigger.nonfinite))}" if trigger.nonfinite else ""
    error = NumericsError(
        f"training stays non-finite in {precision}, the last precision of the fallback chain "
        f"{','.join(chain)}: {trigger.detail}{culprit}"
        + (f"; diagnosis: {diagnosis}" if diagnosis else "")
    )
    return {"precision": precision, **data}, error


def scale_exhausted(
    trigger: Trigger, precision: str, diagnosis: Optional[NonFiniteReport]
) -> tuple[dict[str, Any], NumericsError]:
    """The ``scale_exhausted`` event's data and the error (fallback off, the scale at its floor)."""
    bad = list(trigger.nonfinite)
    data: dict[str, Any] = {
        "precision": precision,
        "scale": trigger.scale,
        "consecutive_skips": trigger.consecutive_skips,
        "nonfinite_params": bad,
        "detail": trigger.detail,
    }
    if diagnosis is not None:
        data["diagnosis"] = diagnosis.to_dict()
    module = bad[0].rpartition(".")[0] if bad else ""
    keep = f"keep_fp32=[{module!r}]" if module else "keep_fp32=[...]"
    error = NumericsError(
        f"the loss scale is exhausted in {precision}: {trigger.detail}, after {trigger.consecutive_skips} "
        f"consecutive skipped steps; backing the scale off cannot help any more. {_culprit(bad)}. Turn on "
        f"fallback=True (fp16 -> bf16 -> fp32), keep the culprit in fp32 ({keep}) or train in bf16"
        + (f"; diagnosis: {diagnosis}" if diagnosis else "")
    )
    return data, error


def _culprit(names: list[str]) -> str:
    """'first non-finite layer: ...' from parameter names in model order."""
    if not names:
        return "No gradient on this process is non-finite now (the overflow is on another rank, or passed)"
    module = names[0].rpartition(".")[0]
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    where = f"{module!r}" if module else "the model's own parameters"
    return f"First non-finite layer: {where} (non-finite gradients in {shown})"
