"""Changing precision between steps (explicit ``switch()``, the fallback chain's automatic one)
and the form of the weights each precision needs (fp32 masters for the pure forms, fp8 modules).

A mixin of :class:`~ampkit.step.engine.MixedPrecision` (it uses the engine's scaler, window and
event stream); kept apart so the engine file holds the step itself.
"""

from __future__ import annotations

from typing import Any, Optional, Union

import torch

from .config import ConfigError
from .fallback import FallbackPolicy, NumericsError, Trigger, resolve_chain
from .overrides import match_modules
from .precision import Precision, PrecisionError, resolve_precision

__all__ = ["SUPPORTED_BY_ENGINE", "SwitchingMixin"]

SUPPORTED_BY_ENGINE = ("fp32", "tf32", "bf16", "fp16", "bf16-pure", "fp16-pure", "fp8")


class SwitchingMixin:
    """``switch``, ``set_fallback`` and the fallback chain's trigger handling."""

    _fallback: Optional[FallbackPolicy]
    _masters: Any
    _parallel: Any
    _fp8_report: Any
    _model: Optional[torch.nn.Module]
    _optimizers: list[torch.optim.Optimizer]
    _last_diagnosis: Any
    _skipped_before: Optional[torch.Tensor]

    def _make_fallback(self) -> Optional[FallbackPolicy]:
        cfg = self.config
        if cfg.fallback is False:
            return None
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
        if self._fallback is not None:
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

    def _fall_back(self, trigger: Trigger) -> None:
        assert self._fallback is not None
        nxt = self._fallback.next_precision(self.precision.name)
        data: dict[str, Any] = {"trigger": trigger.reason, "detail": trigger.detail,
                                "consecutive_skips": trigger.consecutive_skips, "scale": trigger.scale}
        if self._last_diagnosis is not None:
            data["diagnosis"] = self._last_diagnosis.to_dict()
        if nxt is None:
            self._emit("fallback_exhausted", {"precision": self.precision.name, **data})
            raise NumericsError(f"training stays non-finite in {self.precision.name}, the last precision of the "
                                f"fallback chain {','.join(self._fallback.chain)}: {trigger.detail}"
                                + (f"; diagnosis: {self._last_diagnosis}" if self._last_diagnosis else ""))
        self._switch(nxt, "fallback", {"reason": f"{trigger.reason}: {trigger.detail}", **data})
        self._last_diagnosis = None

