"""The fallback chain (fp16 -> bf16 -> fp32), its triggers, and the exhausted-scale guard, checked
without stalling the device.

Triggers, evaluated every ``check_every`` optimizer steps:

* ``consecutive_skips``: ``patience`` consecutive skipped (overflowing) steps in a precision with
  loss scaling (fp16, fp16-pure);
* ``min_scale`` / ``scale_floor``: the loss scale has fallen to ``min_scale`` (when one is set),
  or to its positive floor 2**-126 (:data:`~ampkit.step.scale_rules.SCALE_FLOOR`) when none is;
* ``nonfinite_unscaled``: ``patience`` consecutive non-finite steps in a precision without loss
  scaling (bf16, tf32, fp32), where backing off a scale cannot help. The same patience as for
  fp16: a transient spike (fewer consecutive non-finite steps) is only skipped, as in fp16.

**Rungs of bf16-pure's memory ladder** are chain entries too, spelt as for ``estimate``/``plan``:
``fallback="bf16-pure:stochastic+bf16,bf16-pure:stochastic,bf16-pure:split,fp32"``. bf16-pure has no
loss scaling, so a rung falls to the next entry on ``nonfinite_unscaled`` (``patience`` consecutive
non-finite steps); the move is exactly ``switch("bf16-pure", masters=..., state_dtype=...)`` (via
fp32: the old rung's exact weights, then the new rung's form). A stall (updates rounding away) is
not a trigger: it is known up front (``masters="none"`` is refused unless forced) and measured by
``ampkit tune``, not seen in the gradients. A plain ``bf16-pure`` entry keeps the configured rung.

With the fallback off the same machinery is the **exhausted-scale guard** (a policy with an empty
chain, precisions with loss scaling only): when the scale sat at its floor (``max(min_scale,
2**-126)``) with an overflow at one check, and the step at the next check overflows at the floor
too, the engine raises :class:`NumericsError` ("the loss scale is exhausted") naming the
consecutive skipped steps and the layers whose gradients are non-finite, instead of skipping
forever. A long burst thus ends in a fallback (fallback on) or in that error (off), never in a
zero scale and NaN weights.

**Coming back** (opt-in, ``fallback_recover_after=N``): after a fallback, once ``N`` optimizer
steps in the slower precision ran clean (whole check intervals without a non-finite step, learnt
from the same asynchronous reads), the policy returns a ``recover`` trigger and the engine switches
back to the precision it fell from, recording a ``fallback_retry`` event. If trouble returns there,
the fallback is taken again as usual and the wait before the next retry doubles (``2N``, ``4N``,
...). After several fallbacks the retries climb back one precision at a time. The retry state is
part of the engine's ``state_dict``.

Per step the policy does three tiny in-place ops on device counters (consecutive skips and their
maximum since the last check). At each check it copies those counters (and the scale) to the host
without blocking and decides at the *next* check, when the copy has long landed: on CUDA no check
ever waits for the device; a trigger is acted on at most ``2 * check_every`` steps after it
happened (the steps in between are skipped anyway, so nothing non-finite is trained on). Only once
a trigger fires does the engine sync, to confirm the guard and to name the non-finite gradients
(:func:`nonfinite_grads`; what a trigger reports: :mod:`.fallback_report`). The checks fall on the
run's optimizer steps (``step % check_every``),
and the counters and the reading not yet decided on are part of the engine's ``state_dict``: a
resumed run falls back at the same step as one that was never stopped.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any, Callable, Optional, Union

import torch

from .config import ConfigError, MixedPrecisionConfig
from .fallback_report import (
    NumericsError,
    Trigger,
    chain_exhausted,
    fallback_data,
    nonfinite_grads,
    recover_data,
    scale_exhausted,
)
from .hardware import DeviceInfo
from .precision import (
    REGISTRY,
    PrecisionError,
    resolve_precision,
)
from .rung_switch import chain_entry, ladder_form, rung_label, rung_move
from .scale_rules import SCALE_FLOOR
from .scaler import LossScaler

__all__ = [
    "DEFAULT_CHAIN",
    "FallbackPolicy",
    "NumericsError",
    "Trigger",
    "chain_exhausted",
    "fallback_data",
    "make_fallback",
    "nonfinite_grads",
    "recover_data",
    "resolve_chain",
    "ladder_form",
    "rung_label",
    "rung_move",
    "scale_exhausted",
]

DEFAULT_CHAIN = ("fp16", "bf16", "fp32")
PURE_CHAIN = ("fp16-pure", "bf16-pure", "fp32")


def resolve_chain(
    spec: Union[bool, str], start: str, info: DeviceInfo, label: Optional[str] = None
) -> tuple[str, ...]:
    """The precisions to try after ``start``. ``True``: the default chain, keeping only what the
    device runs. A string: validated now (unknown or unsupported names raise ``PrecisionError``);
    its entries may name bf16-pure rungs (module doc). ``label``: ``start``'s rung (:func:`rung_label`)."""
    if spec is True:
        # Each row names its successor: pure forms fall back within the pure forms first (the
        # masters carry over), fp8 to bf16 (same autocast, plain Linears); all end in fp32.
        names, nxt = [start], REGISTRY[start].successor
        while nxt is not None:
            names += [nxt] if _runs(nxt, info) else []
            nxt = REGISTRY[nxt].successor
    else:
        names = [chain_entry(n.strip(), info) for n in str(spec).split(",") if n.strip()]
        if len(set(names)) != len(names):
            raise PrecisionError(
                f"fallback chain {','.join(names)!r} names an entry twice; each precision or "
                "rung may appear once"
            )
        label = label or start
        if start not in names and label not in names:
            raise PrecisionError(
                f"fallback chain {','.join(names)!r} does not contain the training precision "
                f"{label!r}; start the chain with it, e.g. '{label},fp32'"
            )
    return tuple(names)


def _runs(name: str, info: DeviceInfo) -> bool:
    try:
        resolve_precision(name, info)
        return True
    except PrecisionError:
        return False


def make_fallback(config: MixedPrecisionConfig, precision: str, info: DeviceInfo) -> FallbackPolicy:
    """The fallback chain of ``config`` for training in ``precision``, or with the fallback off the
    exhausted-scale guard (an empty chain). Raises ``ConfigError`` / ``PrecisionError``."""
    if config.fallback is False:
        chain: tuple[str, ...] = ()
    elif not config.skip_nonfinite:
        raise ConfigError("fallback needs skip_nonfinite=True: the triggers are non-finite steps")
    else:
        chain = resolve_chain(config.fallback, precision, info, rung_label(precision, config))
    return FallbackPolicy(
        chain,
        config.fallback_patience,
        config.fallback_check_every,
        config.min_scale,
        recover_after=config.fallback_recover_after if chain else None,
    )


class FallbackPolicy:
    """Device-side counters plus the asynchronous check (see the module doc).

    An empty ``chain`` makes it the exhausted-scale guard: its only trigger is ``scale_exhausted``.
    """

    def __init__(
        self,
        chain: tuple[str, ...],
        patience: int,
        check_every: int,
        min_scale: Optional[float],
        *,
        recover_after: Optional[int] = None,
    ) -> None:
        self.chain, self.patience, self.check_every, self.min_scale = (
            chain,
            patience,
            check_every,
            min_scale,
        )
        self.recover_after = recover_after
        #: the precisions fallen back from, most recent last (retried in reverse order)
        self.fell_from: list[str] = []
        self.interval = (
            recover_after  # clean steps before the next retry (doubles when trouble returns)
        )
        self.clean = 0  # clean steps counted since the last switch
        self.retried = (
            False  # the current precision is a retry: a fallback from it backs the interval off
        )
        #: the lowest scale the scaler leaves (``LossScaler.floor``): min_scale, or the positive floor
        self.floor = max(min_scale or 0.0, SCALE_FLOOR)
        self._consec: Optional[torch.Tensor] = None
        self._max: Optional[torch.Tensor] = None
        self._inflight: Optional[tuple[torch.Tensor, Any]] = None
        self._restored: tuple[float, ...] = (0.0, 0.0)  # the counters' values when they are made

    @property
    def falls_back(self) -> bool:
        """True for a fallback chain; False for the exhausted-scale guard (fallback off)."""
        return bool(self.chain)

    def next_precision(
        self, current: str, config: Optional[MixedPrecisionConfig] = None
    ) -> Optional[str]:
        """The precision to fall back to from ``current`` (None at the chain's end). With
        ``recover_after``, remembers ``current`` for a retry and, if ``current`` was itself a retry,
        doubles the wait before the next one. ``current`` may be a rung (``"bf16-pure:split"``): it
        matches that entry, else a plain ``bf16-pure`` one; with ``config``, ``current``'s rung is read from it."""
        current = rung_label(current, config) if config is not None else current
        at = current if current in self.chain else current.partition(":")[0]
        if at in self.chain:
            i = self.chain.index(at)
            nxt = self.chain[i + 1] if i + 1 < len(self.chain) else None
        else:
            nxt = self.chain[-1] if self.chain and self.chain[-1] != current else None
        if nxt is not None and self.recover_after is not None:
            self.fell_from.append(current)
            if self.retried and self.interval is not None:
                self.interval *= 2
            self.retried, self.clean = False, 0
        return nxt

    def _recover(self, run: int, precision_hint: Optional[float]) -> Optional[Trigger]:
        """At a check, with a retry pending: count a clean interval, or start over; a ``recover``
        trigger once ``interval`` clean steps ran."""
        if run > 0:
            self.clean = 0
            return None
        self.clean += self.check_every
        if self.interval is None or self.clean < self.interval:
            return None
        target = self.fell_from.pop()
        clean, self.clean, self.retried = self.clean, 0, True
        return Trigger(
            "recover",
            f"{clean} clean steps since the fallback (fallback_recover_after: "
            f"{self.interval}); retrying {target}",
            0,
            precision_hint,
            target=target,
            recover_after=self.interval,
        )

    def state_dict(self) -> dict[str, Any]:
        """The counters (the run of consecutive non-finite steps and its maximum since the last check),
        the reading launched at the last check and not yet decided on, and the retry state
        (``fallback_recover_after``: precisions fallen from, interval, clean steps): a resumed run
        decides at the same steps as an uninterrupted one. **Syncs** (reads the counters)."""
        out: dict[str, Any] = {
            "fell_from": list(self.fell_from),
            "interval": self.interval,
            "clean": self.clean,
            "retried": self.retried,
        }
        out["counters"] = (
            list(self._restored)
            if self._consec is None  # (none made yet: the restored values)
            else [float(self._consec.item()), float(self._max.item())]
        )  # type: ignore[union-attr]
        if self._inflight is not None:
            vals, done = self._inflight
            if done is not None:
                done.synchronize()
            out["reading"] = [float(v) for v in vals.tolist()]
        return out

    def load_state_dict(self, state: Optional[dict[str, Any]]) -> None:
        """Restore :meth:`state_dict` (a state without counters, from before they were saved, starts
        them at 0). The device counters are made at the next :meth:`observe`, on its device."""
        state = state or {}
        self._consec = self._max = None
        self._restored = tuple(float(v) for v in state.get("counters", (0.0, 0.0)))
        reading = state.get("reading")
        self._inflight = (torch.tensor([float(v) for v in reading]), None) if reading else None
        if self.recover_after is None:
            return
        self.fell_from = [str(p) for p in state.get("fell_from", [])]
        self.interval = int(state.get("interval") or self.recover_after)
        self.clean, self.retried = int(state.get("clean", 0)), bool(state.get("retried", False))

    def reset(self) -> None:
        self._restored = (0.0, 0.0)
        if self._consec is not None:
            self._consec.zero_()
            self._max.zero_()  # type: ignore[union-attr]
        self._inflight = None

    def observe(self, found_inf: Optional[torch.Tensor]) -> None:
        """Per optimizer step: update the device counters (three in-place ops, no sync)."""
        if found_inf is None:
            return
        if self._consec is None:  # (resumed: from the checkpoint's counters)
            consec, high = self._restored
            self._consec = torch.full((), consec, dtype=torch.float32, device=found_inf.device)
            self._max = torch.full((), high, dtype=torch.float32, device=found_inf.device)
        # consecutive = (consecutive + 1) if found else 0, with found in {0., 1.}
        self._consec.add_(1.0).mul_(found_inf)
        torch.maximum(self._max, self._consec, out=self._max)  # type: ignore[arg-type]

    def watch(
        self,
        found_inf: Optional[torch.Tensor],
        scale: Optional[torch.Tensor],
        step: int,
        scaler: Optional[LossScaler],
        named_grads: Callable[[], Iterable[tuple[str, torch.Tensor]]],
    ) -> Optional[Trigger]:
        """After optimizer step ``step``, while the gradients are still there: count it and, every
        ``check_every`` steps, check (module doc). ``scale`` is the scale this step's gradients
        carried; ``scaler`` the loss scaler of a precision with loss scaling, else None.

        Returns the trigger to act on, naming the non-finite gradients (``named_grads()``): a
        fallback trigger, or with the fallback off ``scale_exhausted`` once a step at the floor
        overflows again. No sync unless a trigger fires.
        """
        if found_inf is None or not (self.chain or scaler is not None):
            return None
        self.observe(found_inf)
        if step % self.check_every:
            return None
        trigger = self.check(
            scaler.scale_tensor if scaler is not None else None, scaler is not None
        )
        if trigger is None:
            return None
        if not self.falls_back:
            # The guard fired on the previous check's counters: confirm on this step (**syncs**).
            if not (found_inf.item() > 0 and scale is not None and scale.item() <= self.floor):
                return None  # the burst is over: the scale will grow back
            trigger = dataclasses.replace(
                trigger, consecutive_skips=self.consecutive(), scale=self.floor
            )
        return dataclasses.replace(trigger, nonfinite=tuple(nonfinite_grads(named_grads())))

    def consecutive(self) -> int:
        """The current run of consecutive non-finite steps. **Syncs**: for error messages only."""
        return 0 if self._consec is None else int(self._consec.item())

    def check(self, scale: Optional[torch.Tensor], scaled: bool) -> Optional[Trigger]:
        """Every ``check_every`` steps: decide on the previous interval's counters, launch this one's copy."""
        if self._consec is None:
            return None
        trigger = self._decide(scaled) if self._inflight is not None else None
        vals = torch.stack(
            [self._max, self._consec, scale if scale is not None else torch.zeros_like(self._max)]
        )  # type: ignore[list-item]
        done = None
        if vals.device.type == "cuda":
            vals = vals.to("cpu", non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        self._max.copy_(self._consec)  # type: ignore[union-attr]  # the next window starts from the current run
        self._inflight = (vals, done)
        return trigger

    def _decide(self, scaled: bool) -> Optional[Trigger]:
        assert self._inflight is not None
        vals, done = self._inflight
        if done is not None and not done.query():
            done.synchronize()
        max_consec, consec, scale = vals.tolist()
        run = int(max_consec)
        at_floor = scaled and scale <= self.floor
        if not self.falls_back:  # the guard: the engine confirms on the step at hand, then raises
            if at_floor and consec >= 1:
                return Trigger(
                    "scale_exhausted",
                    f"the loss scale sits at its floor {self._floor_text()} and "
                    "steps still overflow",
                    int(consec),
                    scale,
                )
            return None
        retry = (
            None if self.interval is None else self.interval * (2 if self.retried else 1)
        )  # after next_precision
        if run >= self.patience:
            if scaled:
                return Trigger(
                    "consecutive_skips",
                    f"{run} consecutive skipped steps (patience {self.patience})",
                    run,
                    scale,
                    recover_after=retry,
                )
            return Trigger(
                "nonfinite_unscaled",
                f"{run} consecutive steps with non-finite loss/gradients in a "
                f"precision without loss scaling (patience {self.patience})",
                run,
                None,
                recover_after=retry,
            )
        if at_floor:
            if self.min_scale is not None and self.min_scale >= SCALE_FLOOR:
                return Trigger(
                    "min_scale",
                    f"the loss scale reached min_scale={self.min_scale:g}",
                    run,
                    scale,
                    recover_after=retry,
                )
            return Trigger(
                "scale_floor",
                f"the loss scale fell to its floor {self._floor_text()}",
                run,
                scale,
                recover_after=retry,
            )
        if self.fell_from:
            return self._recover(run, scale if scaled else None)
        return None

    def _floor_text(self) -> str:
        if self.min_scale is not None and self.min_scale >= SCALE_FLOOR:
            return f"min_scale={self.min_scale:g}"
        return "2**-126 (the smallest normal fp32)"
