"""LossScaler: ``torch.amp.GradScaler`` semantics, plus DeepSpeed-style hysteresis, bounds, a floor, a constant mode.

Semantics, written down before the code (per iteration, after all backward passes):

1. ``unscale_(opt)`` multiplies every gradient by ``1/scale`` (the reciprocal taken in fp64, as
   torch does) and sets ``found_inf`` if any gradient holds inf/NaN. No host sync.
2. ``step(opt)`` skips ``opt.step()`` when ``found_inf``. With an optimizer that does its own
   AMP bookkeeping (fused Adam/AdamW/SGD: ``_step_supports_amp_scaling``) the decision is made on
   the device (no sync); otherwise reading ``found_inf`` is one device->host sync, as in torch.
   A unit scale (a check only) with every gradient on the CPU is decided on the host, where a read
   is free, by read-only sums (:func:`.gradcheck.cpu_all_finite`): the optimizer is then called
   exactly as in a plain loop.
3. ``update()``: if found_inf, the step was skipped; then back off, subject to hysteresis:
   ``hysteresis == 1`` (torch) backs off on every overflow; ``hysteresis == N > 1`` tolerates
   overflows as DeepSpeed's ``DynamicLossScaler`` does (:mod:`.scale_rules`).

   * Every overflow resets the growth counter; ``growth_interval`` consecutive finite steps
     multiply the scale by ``growth_factor`` (only if the result is finite, as torch).
   * ``min_scale`` / ``max_scale`` clamp the result. ``dynamic=False`` never changes the scale
     (non-finite steps are still skipped).
   * Extension, **the scale never reaches zero**: the same device op (no sync) clamps it up to
     ``max(min_scale, 2**-126)`` (:data:`.scale_rules.SCALE_FLOOR`, the smallest normal fp32).
     GradScaler halves 65536 to 0.0 after 166 overflows, then ``grad * (1/0)`` puts NaN in every
     parameter. A run stuck at the floor is the engine's business (:mod:`.fallback`).

With ``hysteresis=1`` and no bounds, ``update`` *is* ``torch._amp_update_scale_``, the kernel
GradScaler uses, so the scale sequence is identical to ``torch.amp.GradScaler``'s while it stays
above the floor (below it torch's scale is subnormal or zero). The scale, growth counter,
hysteresis budget and overflow count are device tensors, created lazily on the device of the first
``scale()``d tensor.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from enum import Enum
from typing import Any, Callable, Optional, Union

import torch

from .config import ConfigError, MixedPrecisionConfig
from .fused_protocol import grad_scale_for, takes_grad_scaler
from .gradcheck import check_and_unscale, cpu_all_finite, first_grad_device
from .scale_rules import SCALE_FLOOR, hysteresis_update, new_scale_problem, scaling_problem
from .scaler_state import host_state, load_into, saved_state

__all__ = ["SCALE_FLOOR", "LossScaler"]


_CPU = torch.device("cpu")


class _Stage(Enum):
    READY = 0
    UNSCALED = 1
    STEPPED = 2


def _fresh() -> dict[str, Any]:
    return {"stage": _Stage.READY, "found_inf_per_device": {}}


class LossScaler:
    """Dynamic loss scaling for fp16 training (and finite-checking for every precision).

    Args:
        init_scale, growth_factor, backoff_factor, growth_interval: as ``torch.amp.GradScaler``.
        hysteresis: overflows tolerated before backing off (DeepSpeed semantics, see module doc).
        consecutive_hysteresis: refill the hysteresis budget on every finite step.
        min_scale, max_scale: clamp the scale (None: unbounded, like torch, but see :attr:`floor`).
        dynamic: False keeps the scale at ``init_scale`` forever; non-finite steps are still skipped.
        enabled: False makes every method a pass-through (like ``GradScaler(enabled=False)``).
        device: where the scale lives; default: that of the first tensor ``scale``d or gradient unscaled.

    A drop-in for ``torch.amp.GradScaler`` (every public method, disabled no-ops, pickling; pass the
    settings by keyword). Raises :class:`~ampkit.step.config.ConfigError` naming an invalid setting.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        *,
        hysteresis: int = 1,
        consecutive_hysteresis: bool = False,
        min_scale: Optional[float] = None,
        max_scale: Optional[float] = None,
        dynamic: bool = True,
        enabled: bool = True,
        device: Union[str, torch.device, None] = None,
    ) -> None:
        problem = scaling_problem(
            init_scale,
            growth_factor,
            backoff_factor,
            growth_interval,
            hysteresis,
            min_scale,
            max_scale,
        )
        if problem is not None:
            name, value, allowed = problem
            raise ConfigError(f"invalid {name}={value!r}: must be {allowed}")
        self._init_scale = float(init_scale)
        self._growth_factor = float(growth_factor)
        self._backoff_factor = float(backoff_factor)
        self._growth_interval = int(growth_interval)
        self._hysteresis = int(hysteresis)
        self._consecutive_hysteresis = bool(consecutive_hysteresis)
        self._min_scale, self._max_scale = min_scale, max_scale
        self._dynamic = bool(dynamic)
        self._enabled = bool(enabled)
        self._device = torch.device(device) if device is not None else None
        # Device state, created lazily (cheap, device-agnostic construction).
        self._scale = self._growth_tracker = self._hysteresis_left = self._overflows = None
        self._init_growth_tracker, self._init_overflows = 0, 0
        self._init_hysteresis_left = self._hysteresis
        self._updates = 0
        self._last_found_inf: Optional[torch.Tensor] = None
        self._per_optimizer: dict[int, dict[str, Any]] = defaultdict(_fresh)
        #: called on every fresh ``found_inf`` before any optimizer sees it (DDP: all-reduce max), or None
        self.found_inf_hook: Optional[Callable[[torch.Tensor], None]] = None

    @classmethod
    def from_config(
        cls,
        config: MixedPrecisionConfig,
        *,
        enabled: bool = True,
        device: Union[str, torch.device, None] = None,
    ) -> LossScaler:
        """A scaler configured by the loss-scaling fields of ``config``."""
        return cls(
            config.init_scale,
            config.growth_factor,
            config.backoff_factor,
            config.growth_interval,
            hysteresis=config.hysteresis,
            consecutive_hysteresis=config.consecutive_hysteresis,
            min_scale=config.min_scale,
            max_scale=config.max_scale,
            dynamic=config.dynamic_scaling,
            enabled=enabled,
            device=device,
        )

    # ------------------------------------------------------------------ properties
    @property
    def is_unit(self) -> bool:
        """True for a constant scale of 1.0: ``scale()`` is the identity and ``unscale_`` only checks."""
        return not self._dynamic and self._init_scale == 1.0

    @property
    def one(self) -> torch.Tensor:
        """A cached 0-d fp32 ``1.0`` on the scaler's device (after first use)."""
        return self._one

    def is_enabled(self) -> bool:
        return self._enabled

    @property
    def scale_tensor(self) -> Optional[torch.Tensor]:
        """The live scale (a 0-d fp32 device tensor; None before first use). No sync."""
        return self._scale

    @property
    def found_inf(self) -> Optional[torch.Tensor]:
        """0-d fp32 tensor: > 0 when the last ``update()``'d iteration overflowed. No sync."""
        return self._last_found_inf

    def found_inf_of(self, optimizers: Iterable[torch.optim.Optimizer]) -> Optional[torch.Tensor]:
        """0-d fp32, > 0 when a gradient of ``optimizers`` was non-finite this iteration (their
        step skipped); None before they were stepped. For a step whose update waits. No sync."""
        per = self._per_optimizer
        found = [f for o in optimizers if id(o) in per for f in per[id(o)]["found_inf_per_device"].values()]
        if not found or self._scale is None:
            return None
        return torch.stack([f.to(self._scale.device) for f in found]).amax()

    @property
    def overflow_count(self) -> Optional[torch.Tensor]:
        """0-d fp32 tensor: total overflowing (skipped) iterations, a loaded state's before first use. No sync."""
        if self._overflows is None and self._init_overflows:
            return torch.full((), float(self._init_overflows), dtype=torch.float32)
        return self._overflows

    @property
    def growth_tracker(self) -> Optional[torch.Tensor]:
        """0-d int32 device tensor: consecutive finite steps since the last growth or overflow. No sync."""
        return self._growth_tracker

    def device_tensors(self) -> tuple[torch.Tensor, ...]:
        """The scaler's device state (scale, growth tracker, hysteresis budget, overflow count, the
        cached 1.0; empty before first use), for memory accounting: read them, never write. No sync."""
        tensors = (self._scale, self._growth_tracker, self._hysteresis_left, self._overflows)
        return () if self._scale is None else (*(t for t in tensors if t is not None), self._one)

    @property
    def floor(self) -> float:
        """The lowest scale ``update()`` leaves: ``max(min_scale, 2**-126)`` (module doc)."""
        return max(self._min_scale or 0.0, SCALE_FLOOR)

    @property
    def updates(self) -> int:
        """Number of ``update()`` calls (optimizer iterations), a host int."""
        return self._updates

    # ------------------------------------------------------------------ lazy state
    def _lazy_init(self, device: torch.device) -> None:
        dev = self._device or device
        self._device = dev
        self._scale = torch.full((), self._init_scale, dtype=torch.float32, device=dev)
        self._growth_tracker = torch.full(
            (), self._init_growth_tracker, dtype=torch.int32, device=dev
        )
        self._hysteresis_left = torch.full(
            (), self._init_hysteresis_left, dtype=torch.int32, device=dev
        )
        # fp32 counts exactly up to 2**24 overflows, and lets update() add found_inf in one op.
        self._overflows = torch.full((), self._init_overflows, dtype=torch.float32, device=dev)
        self._one = torch.ones((), dtype=torch.float32, device=dev)

    def _ensure(self, device: torch.device) -> torch.Tensor:
        if self._scale is None:
            self._lazy_init(device)
        assert self._scale is not None
        return self._scale

    # ------------------------------------------------------------------ the verbs
    def scale(self, outputs: Any) -> Any:
        """Multiply a tensor, or the tensors of a (nested) iterable, by the scale. No sync.

        Call on the loss before ``backward()``. Lists and tuples come back as their type, other iterables
        as an iterator (as ``GradScaler``); unchanged when disabled or the scale is the constant 1.
        """
        if not self._enabled:
            return outputs
        if isinstance(outputs, torch.Tensor):
            scale = self._ensure(outputs.device)
            if self.is_unit:
                return outputs
            return outputs * scale.to(device=outputs.device, non_blocking=True)
        if isinstance(outputs, (list, tuple)):
            return type(outputs)(self.scale(o) for o in outputs)
        if isinstance(outputs, Iterable):
            return map(self.scale, outputs)
        raise ValueError(
            f"outputs must be a Tensor or an iterable of Tensors, got {type(outputs).__name__}"
        )

    def unscale_(self, optimizer: torch.optim.Optimizer) -> Optional[torch.Tensor]:
        """Divide ``optimizer``'s gradients by the scale in place and check them for inf/NaN.

        Call once per optimizer per iteration, after all backward passes and before ``step``
        (e.g. to clip). Returns this optimizer's ``found_inf`` (0-d fp32 tensor on the scale's
        device; > 0 means overflow); disabled, None (a no-op). No sync. A second call before ``update()`` raises.
        """
        if not self._enabled:
            return None
        state = self._per_optimizer[id(optimizer)]
        if state["stage"] is _Stage.UNSCALED:
            raise RuntimeError(
                "unscale_() has already been called on this optimizer since the last update(); "
                "call it once per iteration, after backward() and before step()"
            )
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError(
                "unscale_() is being called after step(); call unscale_() before step(), "
                "or call update() to start the next iteration"
            )
        scale = self._ensure(first_grad_device(optimizer))
        if self.is_unit:
            inv = self._one
        elif scale.device.type == "mps":
            inv = scale.reciprocal()
        else:
            # fp32 division can be imprecise under some compile options, so torch takes the
            # reciprocal in fp64 (torch/amp/grad_scaler.py); we do the same to stay bit-identical.
            inv = scale.double().reciprocal().float()
        state["found_inf_per_device"] = self._check(optimizer, inv, allow_fp16=False)
        state["stage"] = _Stage.UNSCALED
        return self._combined(state)

    def set_found_inf(self, optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
        """Record a finite check made elsewhere (e.g. from a clipped total norm) for ``optimizer``.

        Only for a unit scaler, whose gradients need no unscaling: it stands in for
        ``unscale_`` and saves a pass over the gradients. ``found_inf`` is a 0-d float tensor.
        """
        if not self.is_unit:
            raise RuntimeError(
                "set_found_inf() is only valid for a constant unit scale; call unscale_() instead"
            )
        state = self._per_optimizer[id(optimizer)]
        if state["stage"] is not _Stage.READY:
            raise RuntimeError("set_found_inf() must come before step() and instead of unscale_()")
        self._ensure(found_inf.device)
        if self.found_inf_hook is not None:
            self.found_inf_hook(found_inf)
        state["found_inf_per_device"] = {found_inf.device: found_inf}
        state["stage"] = _Stage.UNSCALED

    def step_decided(
        self, optimizer: torch.optim.Optimizer, finite: bool, *args: Any, **kwargs: Any
    ) -> Any:
        """Step ``optimizer`` exactly as a plain loop calls it when ``finite``, else skip it, on a
        verdict already made on the host: a unit scale on the CPU, where reading a value costs no
        sync (:func:`.gradcheck.cpu_all_finite`, or a clipped total norm read with ``.item()``).
        The optimizer gets no ``found_inf`` (a fused one would otherwise read it and correct its
        step counts afterwards). Stands in for ``unscale_`` + ``step``; returns what ``step`` did.
        """
        if not self.is_unit or self.found_inf_hook is not None:
            raise RuntimeError(
                "step_decided() is only valid for a constant unit scale without a found_inf hook; "
                "call step() instead"
            )
        state = self._per_optimizer[id(optimizer)]
        if state["stage"] is not _Stage.READY:
            raise RuntimeError(
                "step_decided() must come instead of unscale_() and step(), once per iteration"
            )
        dev = self._ensure(_CPU).device
        state["found_inf_per_device"] = {
            dev: torch.full((), 0.0 if finite else 1.0, dtype=torch.float32, device=dev)
        }
        state["host_finite"] = finite  # (update() then skips adding a known 0 to the count)
        state["stage"] = _Stage.STEPPED
        return optimizer.step(*args, **kwargs) if finite else None

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
        """``unscale_`` (if not done yet), then ``optimizer.step()`` unless gradients were non-finite.

        Fused optimizers (``_step_supports_amp_scaling``) receive ``grad_scale``/``found_inf``
        and skip on the device: no sync (a ``grad_scale`` already set on the optimizer is
        multiplied in, as ``GradScaler`` does). One whose ``step`` takes a ``grad_scaler`` argument
        is handed this scaler instead, with a ``FutureWarning`` (GradScaler's older protocol).
        Other optimizers need one device->host sync to decide.
        Returns what ``optimizer.step`` returned (None when skipped). Closures are not supported.
        """
        if not self._enabled:
            return optimizer.step(*args, **kwargs)
        if "closure" in kwargs:
            raise RuntimeError("closure use is not supported with loss scaling")
        state = self._per_optimizer[id(optimizer)]
        if state["stage"] is _Stage.STEPPED:
            raise RuntimeError(
                "step() has already been called since the last update(); call update() first"
            )
        fused = getattr(optimizer, "_step_supports_amp_scaling", False)
        if state["stage"] is _Stage.READY and self.is_unit and self.found_inf_hook is None:
            # A check only, on the CPU: decide on the host (free there) and call the optimizer
            # exactly as a plain loop would (gradcheck.cpu_all_finite).
            finite = cpu_all_finite(optimizer, allow_fp16=fused)
            if finite is not None:
                return self.step_decided(optimizer, finite, *args, **kwargs)
        if fused and takes_grad_scaler(optimizer):  # (fused_protocol: it unscales itself)
            ret = optimizer.step(*args, **{**kwargs, "grad_scaler": self})
            state["stage"] = _Stage.STEPPED
            return ret
        if fused:
            scale = self._ensure(first_grad_device(optimizer))
            ready = state["stage"] is _Stage.READY
            if ready:  # only check here; the fused kernel unscales (torch's own protocol)
                state["found_inf_per_device"] = self._check(optimizer, self._one, allow_fp16=True)
            grad_scale = grad_scale_for(optimizer, scale, unit=self.is_unit, unscaled=not ready)
            optimizer.grad_scale = grad_scale  # type: ignore[attr-defined]
            optimizer.found_inf = self._combined(state)  # type: ignore[attr-defined]
            try:
                ret = optimizer.step(*args, **kwargs)
            finally:
                del optimizer.grad_scale  # type: ignore[attr-defined]
                del optimizer.found_inf  # type: ignore[attr-defined]
            state["stage"] = _Stage.STEPPED
            return ret
        if state["stage"] is _Stage.READY:
            self.unscale_(optimizer)
        ret = None
        # The one sync non-fused optimizers need: the host must decide whether to call step().
        if not sum(v.item() for v in state["found_inf_per_device"].values()):
            ret = optimizer.step(*args, **kwargs)
        state["stage"] = _Stage.STEPPED
        return ret

    def update(self, new_scale: Union[float, torch.Tensor, None] = None) -> None:
        """End the iteration: fold every optimizer's ``found_inf`` into the scale (module doc). No sync.

        Call once per iteration, after ``step`` for every optimizer. ``new_scale`` (a float or a
        1-element tensor that does not require grad, copied; else ValueError) sets the scale
        directly instead (bounds and the floor still apply).
        """
        if not self._enabled:
            return
        if self._scale is None:
            raise RuntimeError(
                "update() called before any scale()/unscale_()/step(); nothing to update"
            )
        if new_scale is not None:
            if isinstance(new_scale, torch.Tensor):
                if (problem := new_scale_problem(new_scale)) is not None:
                    raise ValueError(problem)
                self._scale.copy_(new_scale.reshape(()))
            else:
                self._scale.fill_(new_scale)
            self._clamp()
            self._per_optimizer = defaultdict(_fresh)
            return
        dev = self._scale.device
        found = [
            f if f.device == dev else f.to(dev, non_blocking=True)
            for st in self._per_optimizer.values()
            for f in st["found_inf_per_device"].values()
        ]
        if not found:
            raise RuntimeError(
                "update() called but no optimizer was unscaled or stepped this iteration; "
                "call step(optimizer) (or unscale_) before update()"
            )
        # found_inf is exactly 0.0 or 1.0 per optimizer and device; combined, clamp to 1.0.
        found_inf = found[0] if len(found) == 1 else torch.stack(found).sum().clamp_(max=1.0)
        assert (
            self._growth_tracker is not None
            and self._hysteresis_left is not None
            and self._overflows is not None
        )
        if self._dynamic:
            if self._hysteresis == 1:
                torch._amp_update_scale_(
                    self._scale,
                    self._growth_tracker,
                    found_inf,
                    self._growth_factor,
                    self._backoff_factor,
                    self._growth_interval,
                )
            else:
                hysteresis_update(
                    self._scale,
                    self._growth_tracker,
                    self._hysteresis_left,
                    found_inf,
                    growth_factor=self._growth_factor,
                    backoff_factor=self._backoff_factor,
                    growth_interval=self._growth_interval,
                    hysteresis=self._hysteresis,
                    consecutive=self._consecutive_hysteresis,
                )
            self._clamp()
        if not all(st.get("host_finite") for st in self._per_optimizer.values()):
            self._overflows.add_(found_inf)
        self._last_found_inf = found_inf
        self._updates += 1
        self._per_optimizer = defaultdict(_fresh)

    # ------------------------------------------------------------------ internals
    def _check(
        self, optimizer: torch.optim.Optimizer, inv: torch.Tensor, allow_fp16: bool
    ) -> dict[Any, Any]:
        found = check_and_unscale(optimizer, inv, allow_fp16)
        if self.found_inf_hook is not None:
            for f in found.values():
                self.found_inf_hook(f)  # e.g. max over ranks, so every rank skips alike
        return found

    def _clamp(self) -> None:
        # always: the floor (module doc); clamp_ keeps a scale above it bit-exact
        if self._scale is not None:
            self._scale.clamp_(min=self.floor, max=self._max_scale)

    def _combined(self, state: dict[str, Any]) -> torch.Tensor:
        assert self._scale is not None
        dev = self._scale.device
        vals = [
            v if v.device == dev else v.to(dev, non_blocking=True)
            for v in state["found_inf_per_device"].values()
        ]
        if not vals:
            return torch.zeros((), dtype=torch.float32, device=dev)
        return vals[0] if len(vals) == 1 else torch.stack(vals).sum().clamp_(max=1.0)

    # ------------------------------------------------------------------ reading (syncs)
    def get_scale(self) -> float:
        """The current scale as a Python float (1.0 when disabled). **Syncs** with the device."""
        if not self._enabled:
            return 1.0
        return self._init_scale if self._scale is None else float(self._scale.item())

    # ------------------------------------------------------------------ GradScaler's knobs
    def get_growth_factor(self) -> float:
        """The factor the scale grows by after ``growth_interval`` finite steps."""
        return self._growth_factor

    def set_growth_factor(self, new_factor: float) -> None:
        """Use ``new_factor`` (> 1.0) from the next ``update()`` on; raises ``ConfigError`` otherwise."""
        self._growth_factor = self._checked("growth_factor", new_factor)

    def get_backoff_factor(self) -> float:
        """The factor the scale shrinks by after an overflow."""
        return self._backoff_factor

    def set_backoff_factor(self, new_factor: float) -> None:
        """Use ``new_factor`` (0 < f < 1) from the next ``update()`` on; raises ``ConfigError`` otherwise."""
        self._backoff_factor = self._checked("backoff_factor", new_factor)

    def get_growth_interval(self) -> int:
        """Consecutive finite steps before the scale grows."""
        return self._growth_interval

    def set_growth_interval(self, new_interval: int) -> None:
        """Use ``new_interval`` (an int >= 1) from the next ``update()`` on; raises ``ConfigError`` otherwise."""
        self._growth_interval = self._checked("growth_interval", new_interval)

    def _checked(self, name: str, value: Any) -> Any:
        knobs = {
            "growth_factor": self._growth_factor,
            "backoff_factor": self._backoff_factor,
            "growth_interval": self._growth_interval,
            name: value,
        }
        problem = scaling_problem(
            self._init_scale, hysteresis=1, min_scale=None, max_scale=None, **knobs
        )
        if problem is not None:
            raise ConfigError(f"invalid {name}={value!r}: must be {problem[2]}")
        return value

    # ------------------------------------------------------------------ pickling (syncs)
    def __getstate__(self) -> dict[str, Any]:
        """Pickle between iterations only, as ``GradScaler`` (:func:`.scaler_state.host_state`). **Syncs**."""
        if self._per_optimizer:
            raise RuntimeError(
                "a LossScaler may only be pickled at the start of an iteration or after update()"
            )
        return host_state(vars(self))

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume; a superset of ``torch.amp.GradScaler.state_dict()``
        (:mod:`.scaler_state`); ``{}`` when disabled. **Syncs**. Call between iterations (after ``update()``)."""
        return saved_state(vars(self)) if self._enabled else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore from our own ``state_dict()`` or from a ``torch.amp.GradScaler.state_dict()``;
        a no-op when disabled. Keys a GradScaler does not have (hysteresis, bounds) keep this
        scaler's settings. Raises before changing anything for an empty or invalid state dict.
        """
        if not self._enabled:
            return
        load_into(self.__dict__, state_dict)
        self._per_optimizer = defaultdict(_fresh)

    def __repr__(self) -> str:
        mode = "unit" if self.is_unit else ("dynamic" if self._dynamic else "constant")
        return (
            f"LossScaler({mode}, init_scale={self._init_scale}, growth_factor={self._growth_factor}, "
            f"backoff_factor={self._backoff_factor}, growth_interval={self._growth_interval}, "
            f"hysteresis={self._hysteresis}, min_scale={self._min_scale}, max_scale={self._max_scale})"
        )
