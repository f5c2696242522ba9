"""Changing precision between steps (explicit ``switch()``, the fallback chain's automatic one),
the per-step numerics watch that drives it (and, with the fallback off, the exhausted-scale guard:
:mod:`ampkit.step.fallback`), and the form of the weights each precision needs (fp32 masters for
the pure forms, fp8 modules).

A mixin of :class:`~ampkit.step.engine.MixedPrecision` (it uses the engine's scaler, window and
event stream); kept apart so the engine file holds the step itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Union

import torch

from .config import ConfigError
from .fallback import FallbackPolicy, NumericsError, Trigger, nonfinite_grads, resolve_chain
from .overrides import match_modules
from .precision import Precision, PrecisionError, resolve_precision

__all__ = ["SUPPORTED_BY_ENGINE", "SwitchingMixin"]

SUPPORTED_BY_ENGINE = ("fp32", "tf32", "bf16", "fp16", "bf16-pure", "fp16-pure", "fp8")


class SwitchingMixin:
    """``switch``, ``set_fallback``, the fallback chain's trigger handling and the exhausted-scale guard."""

    _fallback: FallbackPolicy  # a chain, or (fallback off) the exhausted-scale guard
    _masters: Any
    _parallel: Any
    _fp8_report: Any
    _model: Optional[torch.nn.Module]
    _optimizers: list[torch.optim.Optimizer]
    _last_diagnosis: Any
    _skipped_before: Optional[torch.Tensor]

    def _make_fallback(self) -> FallbackPolicy:
        """The fallback chain, or with the fallback off the exhausted-scale guard (an empty chain)."""
        cfg = self.config
        if cfg.fallback is False:
            return FallbackPolicy((), cfg.fallback_patience, cfg.fallback_check_every, cfg.min_scale)
        if not cfg.skip_nonfinite:
            raise ConfigError("fallback needs skip_nonfinite=True: the triggers are non-finite steps")
        chain = resolve_chain(cfg.fallback, self.precision.name, self.device_info)
        return FallbackPolicy(chain, cfg.fallback_patience, cfg.fallback_check_every, cfg.min_scale)

    def switch(self, precision: Union[str, torch.dtype, Precision], *, reason: str = "requested") -> Precision:
        """Change the precision between optimizer steps (e.g. fp16 -> bf16 after overflows).

        The model's fp32 weights and the optimizer state carry over unchanged; the loss scaler
        is rebuilt from the config when the new precision needs one. Records a
        ``precision_switch`` event. Raises inside an accumulation window (gradients from the
        old precision would mix with the new one) and for precisions the device cannot run.
        """
        return self._switch(precision, "precision_switch", {"reason": reason})

    def _switch(self, precision: Union[str, torch.dtype, Precision], kind: str, data: dict[str, Any]) -> Precision:
        new = resolve_precision(precision, self.device_info, emulate_fp8=self.config.fp8_emulate)
        if new.name not in SUPPORTED_BY_ENGINE:
            raise PrecisionError(f"cannot switch to {new.name!r}: the engine supports {', '.join(SUPPORTED_BY_ENGINE)} so far")
        if self._window.micro != 0:
            raise RuntimeError(f"switch() called inside an accumulation window ({self._window.micro} of "
                               f"{self._window.current_size} micro-steps done); switch after step()")
        old = self.precision
        if new.name == old.name:
            return old
        self.precision = new
        self.config = self.config.replace(precision=new.name)
        if new.needs_scaler != old.needs_scaler:
            self._retire_scaler()
            self._scaler = self._make_scaler(new)
        self._fallback.reset()
        self._build_contexts()
        self._retarget_weights()
        self._emit(kind, {"from": old.name, "to": new.name, **data})
        return new

    # ------------------------------------------------------------------ the weights' form
    def _kept_names(self) -> list[str]:
        if self._model is None or not self.config.keep_fp32:
            return []
        return sorted({n for names in match_modules(self._model, self.config.keep_fp32).values() for n in names})

    def _convert_fp8(self) -> None:
        from .fp8 import convert

        assert self._model is not None
        emulate = self.config.fp8_emulate and not self.device_info.fp8
        self._fp8_report = convert(self._model, self.config.fp8_recipe, emulate=emulate, keep=self._kept_names())

    def fp8_report(self) -> list[dict[str, Any]]:
        """Each Linear of the model: converted to fp8 or skipped, with the reason (precision fp8)."""
        return [d.to_dict() for d in self._fp8_report] if self._fp8_report else []

    def master_params(self) -> list[torch.Tensor]:
        """The fp32 master weights (pure precisions; empty otherwise). They live in the optimizer."""
        return list(self._masters.masters) if self._masters is not None else []

    def full_precision_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict in fp32: for pure precisions the masters' values (what to export
        or evaluate); otherwise the model's own state dict (already fp32)."""
        self._require_setup("full_precision_state_dict")
        assert self._model is not None
        if self._masters is None:
            return dict(self._model.state_dict())
        return self._masters.full_precision_state_dict()

    def _retarget_weights(self) -> None:
        """Make the model's weights match ``self.precision``: add, recast or drop fp32 masters.

        bf16-pure <-> fp16-pure recasts the model from the masters; pure -> mixed/fp32 puts the
        masters' values back into fp32 parameters (and into the optimizers); mixed -> pure makes
        masters. Optimizer state follows its parameter. Between steps only (no gradients held).
        """
        from .boundary import ClipOrder
        from .master import MasterWeights

        model, p = self._model, self.precision
        if model is None:
            return
        masters = self._masters
        if masters is not None and p.is_pure and masters.dtype != p.param_dtype:
            masters.recast(p.param_dtype)
        elif masters is not None and not p.is_pure:
            masters.release()
            self._masters = None
        elif masters is None and p.is_pure and not self._parallel.shards_params:
            self._masters = MasterWeights(model, self._optimizers, p.param_dtype, self._kept_names())
        self._parallel.retarget(p)  # FSDP2: the all-gather/reduce dtypes follow the precision
        self._parallel.use_masters(self._masters is not None)
        if self._fp8_report and p.name != "fp8":
            from .fp8 import revert

            revert(model)  # fp8 -> bf16: plain Linears on the same parameters
            self._fp8_report = None
        elif p.name == "fp8" and not self._fp8_report:
            self._convert_fp8()
        self._clip_order = ClipOrder(model, self._masters)

    def _retire_scaler(self) -> None:
        """Keep the skipped-step count of a scaler that is being replaced (a device add, no sync)."""
        count = self._scaler.overflow_count
        if count is not None:
            self._skipped_before = count.clone() if self._skipped_before is None else self._skipped_before + count

    def set_fallback(self, fallback: Union[bool, str]) -> None:
        """Turn the fallback chain on (``True`` or ``"fp16,bf16,fp32"``) or off, between steps.

        Validates the chain against the device first (``PrecisionError`` / ``ConfigError``)."""
        cfg = self.config.replace(fallback=fallback)
        old, self.config = self.config, cfg
        try:
            self._fallback = self._make_fallback()
        except Exception:
            self.config = old
            raise

    # ------------------------------------------------------------------ the numerics watch
    def _watch(self, found_inf: Optional[torch.Tensor], scale: Optional[torch.Tensor]) -> Optional[Trigger]:
        """After each optimizer step, while the gradients are still there: count the step and, every
        ``fallback_check_every`` steps, check (module doc of :mod:`ampkit.step.fallback`).

        Returns the fallback trigger to act on (after the gradients are dropped: :meth:`_fall_back`),
        naming the non-finite gradients. With the fallback off, raises :class:`NumericsError` when
        the loss scale is exhausted. No sync unless a trigger fires.
        """
        policy = self._fallback
        if found_inf is None or not (policy.falls_back or self.precision.needs_scaler):
            return None
        policy.observe(found_inf)
        if self._steps % self.config.fallback_check_every:
            return None
        scaled = self.precision.needs_scaler
        trigger = policy.check(self._scaler.scale_tensor if scaled else None, scaled)
        if trigger is None:
            return None
        if not policy.falls_back:
            self._check_exhausted(trigger, found_inf, scale)
            return None
        return dataclasses.replace(trigger, nonfinite=tuple(self._nonfinite_params()))

    def _check_exhausted(self, trigger: Trigger, found_inf: torch.Tensor, scale: Optional[torch.Tensor]) -> None:
        """The guard fired on the previous check's counters: raise if this step overflowed too, with
        the scale (it carried) at the floor. **Syncs** (twice, and once more to name the layers)."""
        floor = self._fallback.floor
        if not (found_inf.item() > 0 and scale is not None and scale.item() <= floor):
            return  # the burst is over: the scale will grow back
        bad = self._nonfinite_params()
        run = self._fallback.consecutive()
        data: dict[str, Any] = {"precision": self.precision.name, "scale": floor, "consecutive_skips": run,
                                "nonfinite_params": bad, "detail": trigger.detail}
        if self._last_diagnosis is not None:
            data["diagnosis"] = self._last_diagnosis.to_dict()
        self._emit("scale_exhausted", data)
        module = bad[0].rpartition(".")[0] if bad else ""
        keep = f"keep_fp32=[{module!r}]" if module else "keep_fp32=[...]"
        raise NumericsError(
            f"the loss scale is exhausted in {self.precision.name}: {trigger.detail}, after {run} consecutive "
            f"skipped steps; backing the scale off cannot help any more. {_culprit(bad)}. Turn on "
            f"fallback=True (fp16 -> bf16 -> fp32), keep the culprit in fp32 ({keep}) or train in bf16"
            + (f"; diagnosis: {self._last_diagnosis}" if self._last_diagnosis else ""))

    def _nonfinite_params(self) -> list[str]:
        """Model parameters (in model order) whose gradient -- the fp32 master's for pure
        precisions -- holds inf/NaN now. **Syncs**."""
        if self._model is None:
            return []
        masters = self._masters
        named = self._model.named_parameters()
        return nonfinite_grads(named if masters is None else ((n, masters.stepped(p)) for n, p in named))

    def _fall_back(self, trigger: Trigger) -> None:
        assert self._fallback.falls_back
        nxt = self._fallback.next_precision(self.precision.name)
        data: dict[str, Any] = {"trigger": trigger.reason, "detail": trigger.detail,
                                "consecutive_skips": trigger.consecutive_skips, "scale": trigger.scale,
                                "nonfinite_params": list(trigger.nonfinite)}
        if self._last_diagnosis is not None:
            data["diagnosis"] = self._last_diagnosis.to_dict()
        if nxt is None:
            self._emit("fallback_exhausted", {"precision": self.precision.name, **data})
            culprit = f"; {_culprit(list(trigger.nonfinite))}" if trigger.nonfinite else ""
            raise NumericsError(f"training stays non-finite in {self.precision.name}, the last precision of the "
                                f"fallback chain {','.join(self._fallback.chain)}: {trigger.detail}{culprit}"
                                + (f"; diagnosis: {self._last_diagnosis}" if self._last_diagnosis else ""))
        self._switch(nxt, "fallback", {"reason": f"{trigger.reason}: {trigger.detail}", **data})
        self._last_diagnosis = None


def _culprit(names: list[str]) -> str:
    """'first non-finite layer: ...' from parameter names in model order."""
    if not names:
        return "No gradient on this process is non-finite now (the overflow is on another rank, or passed)"
    module = names[0].rpartition(".")[0]
    shown = ", ".join(names[:8]) + (f" and {len(names) - 8} more" if len(names) > 8 else "")
    where = f"{module!r}" if module else "the model's own parameters"
    return f"First non-finite layer: {where} (non-finite gradients in {shown})"
