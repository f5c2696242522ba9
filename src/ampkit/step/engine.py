"""MixedPrecision: the training-step engine.

The happy path is four calls::

    amp = MixedPrecision("auto")
    model, opt = amp.setup(model, opt)
    with amp.autocast():
        loss = model(batch)
    amp.backward(loss)
    amp.step(opt, clip_grad_norm=1.0)

Order of operations at an optimizer step (the accumulation boundary), identical to the
hand-written ``torch.autocast`` + ``torch.amp.GradScaler`` loop::

    unscale_ (only if clipping) -> clip_grad_norm_ -> scaler.step (skip if non-finite)
    -> scaler.update -> zero_grad(set_to_none=True)

The engine knows nothing about logging, plots or the CLI: observers subscribe to its events
(:meth:`MixedPrecision.subscribe`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from .config import ConfigError, MixedPrecisionConfig
from .fallback import FallbackPolicy, NumericsError, Trigger, resolve_chain
from .hardware import DeviceInfo, device_info, normalize_device
from .overrides import Fp32Overrides, apply_fp32_overrides, match_modules
from .precision import Precision, PrecisionError, resolve_precision
from .scaler import LossScaler

__all__ = ["Event", "MixedPrecision", "NumericsError", "StepResult"]

_SUPPORTED_BY_ENGINE = ("fp32", "tf32", "bf16", "fp16")


@dataclass(frozen=True)
class StepResult:
    """What :meth:`MixedPrecision.step` did. Reading the tensors does not sync; ``skipped`` does.

    Attributes:
        boundary: True when this call ended an accumulation window (an optimizer step was attempted).
        grad_norm: total norm of the unscaled gradients before clipping (0-d tensor), or None
            when not clipping or not a boundary.
        scale: the loss scale that this step's gradients were multiplied by (0-d tensor), or
            None when not a boundary.
        found_inf: 0-d tensor, > 0 when the gradients were non-finite and the step was skipped
            (None when not a boundary, or when non-finite checking is off).
    """

    boundary: bool
    grad_norm: Optional[torch.Tensor] = None
    scale: Optional[torch.Tensor] = None
    found_inf: Optional[torch.Tensor] = None

    @property
    def skipped(self) -> bool:
        """True when the optimizer step was skipped for non-finite gradients. **Syncs** with the device."""
        return bool(self.found_inf is not None and self.found_inf.item() > 0)


@dataclass(frozen=True)
class Event:
    """A notable moment: ``kind`` (e.g. ``precision_switch``), the optimizer step, and details."""

    kind: str
    step: int
    data: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "step": self.step, **self.data}


class _MatmulPrecision:
    """Set fp32 matmul internals for the duration of a block (tf32 on; fp32 strictly off).

    ``torch.set_float32_matmul_precision`` is process-global, so it is set on entry and restored
    on exit rather than left changed behind the user's back.
    """

    __slots__ = ("level", "cudnn_tf32", "_prev", "_prev_cudnn")

    def __init__(self, level: str, cudnn_tf32: bool) -> None:
        self.level, self.cudnn_tf32 = level, cudnn_tf32

    def __enter__(self) -> None:
        self._prev = torch.get_float32_matmul_precision()
        self._prev_cudnn = torch.backends.cudnn.allow_tf32
        if self._prev != self.level:
            torch.set_float32_matmul_precision(self.level)
        if self._prev_cudnn != self.cudnn_tf32:
            torch.backends.cudnn.allow_tf32 = self.cudnn_tf32

    def __exit__(self, *exc: object) -> None:
        if self._prev != self.level:
            torch.set_float32_matmul_precision(self._prev)
        if self._prev_cudnn != self.cudnn_tf32:
            torch.backends.cudnn.allow_tf32 = self._prev_cudnn


class MixedPrecision:
    """Mixed-precision training: autocast, loss scaling, accumulation, clipping, skipping, switching.

    Args:
        precision: a name or alias (``"auto"``, ``"bf16"``, ``"fp16"``, ``"16-mixed"``, ...), a
            ``torch.dtype``, or None to take ``config.precision`` (default ``"auto"``).
        device: where training runs (default: CUDA if available, else MPS, else CPU).
        config: a :class:`MixedPrecisionConfig`; ``**overrides`` replace single fields of it,
            e.g. ``MixedPrecision("fp16", init_scale=2.**12, accumulation_steps=4)``.

    Raises :class:`PrecisionError` for unknown precisions and precisions the device cannot run,
    and :class:`ampkit.config.ConfigError` for invalid settings.
    """

    def __init__(
        self,
        precision: Union[str, torch.dtype, Precision, None] = None,
        *,
        device: Union[str, torch.device, None] = None,
        config: Optional[MixedPrecisionConfig] = None,
        **overrides: Any,
    ) -> None:
        cfg = config if config is not None else MixedPrecisionConfig()
        if not isinstance(cfg, MixedPrecisionConfig):
            raise TypeError(f"config must be a MixedPrecisionConfig, got {type(cfg).__name__}")
        if precision is not None:
            overrides["precision"] = precision.name if isinstance(precision, Precision) else precision
        if overrides:
            cfg = cfg.replace(**overrides)
        self.config: MixedPrecisionConfig = cfg
        self.device: torch.device = normalize_device(device)
        self.device_info: DeviceInfo = device_info(self.device)
        self.precision: Precision = resolve_precision(cfg.precision, self.device_info)
        self._scaler = self._make_scaler(self.precision)
        self._model: Optional[torch.nn.Module] = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._micro = 0  # micro-steps (backward calls) in the current accumulation window
        self._steps = 0  # accumulation boundaries reached (optimizer steps attempted)
        self._events: list[Event] = []
        self._subscribers: list[Callable[[Event], None]] = []
        self._window_loss: Optional[torch.Tensor] = None
        self._overrides: Optional[Fp32Overrides] = None
        self._skipped_before: Optional[torch.Tensor] = None  # skips counted by scalers since replaced
        self._last_diagnosis: Optional[Any] = None
        self._fallback = self._make_fallback()
        self._build_contexts()

    # ------------------------------------------------------------------ construction helpers
    def _make_scaler(self, precision: Precision) -> LossScaler:
        if precision.needs_scaler:
            return LossScaler.from_config(self.config, device=self.device)
        # No scaling arithmetic at all; still finite-checks when skip_nonfinite is on.
        return LossScaler(1.0, dynamic=False, enabled=self.config.skip_nonfinite, device=self.device)

    def _make_fallback(self) -> Optional[FallbackPolicy]:
        cfg = self.config
        if cfg.fallback is False:
            return None
        if not cfg.skip_nonfinite:
            raise ConfigError("fallback needs skip_nonfinite=True: the triggers are non-finite steps")
        chain = resolve_chain(cfg.fallback, self.precision.name, self.device_info)
        return FallbackPolicy(chain, cfg.fallback_patience, cfg.fallback_check_every, cfg.min_scale)

    def _build_contexts(self) -> None:
        p = self.precision
        if p.name == "tf32":
            # On CUDA "high" means TF32; on CPUs with AMX, oneDNN may use bf16 internals.
            level = "high" if self.device.type == "cuda" else "medium"
            self._matmul: Optional[_MatmulPrecision] = _MatmulPrecision(level, True)
        elif p.name == "fp32":
            self._matmul = _MatmulPrecision("highest", False)
        else:
            self._matmul = None

    # ------------------------------------------------------------------ set-up
    @property
    def scaler(self) -> LossScaler:
        """The loss scaler in use (a constant unit scaler for precisions without scaling)."""
        return self._scaler

    def setup(self, model: torch.nn.Module, *optimizers: torch.optim.Optimizer) -> Any:
        """Prepare ``model`` (moved to the device) and register ``optimizers`` with the engine.

        Returns ``model`` when no optimizer is given, else ``(model, *optimizers)``. Must be called
        before :meth:`backward`/:meth:`step`. Raises :class:`PrecisionError` for precisions the
        engine cannot apply yet (the pure forms and fp8), before anything is changed.
        """
        if self.precision.name not in _SUPPORTED_BY_ENGINE:
            raise PrecisionError(
                f"precision {self.precision.name!r} is not supported by MixedPrecision.setup() yet: "
                f"pure half-precision weights with fp32 master weights and fp8 are planned; "
                f"choose one of: {', '.join(_SUPPORTED_BY_ENGINE)}")
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"setup() expects a torch.nn.Module first, got {type(model).__name__}")
        if self.config.keep_fp32:
            match_modules(model, self.config.keep_fp32)  # raises before anything is changed
        params = {id(p) for p in model.parameters()}
        for i, opt in enumerate(optimizers):
            if not isinstance(opt, torch.optim.Optimizer):
                raise TypeError(f"setup() argument {i + 2} must be a torch.optim.Optimizer, got {type(opt).__name__}")
            foreign = sum(1 for g in opt.param_groups for p in g["params"] if id(p) not in params)
            if foreign:
                raise ValueError(f"optimizer {i} ({type(opt).__name__}) holds {foreign} parameter(s) that are "
                                 "not in the model; build the optimizer from model.parameters()")
        model.to(self.device)
        if self._overrides is not None:
            self._overrides.remove()
        if self.config.keep_fp32:
            self._overrides = apply_fp32_overrides(model, self.config.keep_fp32, self.device.type)
        self._model = model
        self._optimizers = list(optimizers)
        return (model, *optimizers) if optimizers else model

    # ------------------------------------------------------------------ forward
    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """Context for the forward pass (and loss): autocast to the compute dtype.

        Also applies the fp32 matmul policy (tf32 on / strictly off for fp32) and, under DDP,
        ``no_sync()`` on micro-steps that do not end an accumulation window. No sync.
        """
        p = self.precision
        model = self._model
        no_sync = (self.config.accumulation_steps > 1 and model is not None and hasattr(model, "no_sync")
                   and self._micro + 1 < self.config.accumulation_steps)
        if p.autocast_enabled and self._matmul is None and not no_sync:
            # The common case costs exactly what a hand-written loop pays: one torch.autocast.
            return torch.autocast(self.device.type, dtype=p.compute_dtype, cache_enabled=self.config.autocast_cache)
        stack = contextlib.ExitStack()
        if p.autocast_enabled:
            stack.enter_context(torch.autocast(self.device.type, dtype=p.compute_dtype,
                                               cache_enabled=self.config.autocast_cache))
        if self._matmul is not None:
            stack.enter_context(self._matmul)
        if no_sync:
            stack.enter_context(model.no_sync())  # type: ignore[union-attr,operator]
        return stack

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Run the block in full fp32: autocast off, reduced-precision matmul internals off (e.g. evaluation)."""
        with torch.autocast(self.device.type, enabled=False), _MatmulPrecision("highest", False):
            yield

    # ------------------------------------------------------------------ backward
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backpropagate ``loss``: divided by ``accumulation_steps``, multiplied by the loss scale.

        Gradients accumulate into ``.grad`` (scaled for fp16 until :meth:`step` unscales them).
        ``kwargs`` go to ``Tensor.backward`` (e.g. ``retain_graph``). No sync.
        """
        self._require_setup("backward")
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"backward() expects the loss as a torch.Tensor, got {type(loss).__name__}")
        if not loss.is_floating_point():
            raise TypeError(f"backward() expects a floating-point loss, got dtype {loss.dtype}; "
                            "did you pass labels or a count instead of the loss?")
        if loss.numel() != 1:
            raise ValueError(f"backward() expects a scalar loss, got shape {tuple(loss.shape)}; "
                             "reduce it first (e.g. loss.mean())")
        if not loss.requires_grad:
            raise ValueError("backward() got a loss that does not require grad: it was computed under "
                             "torch.no_grad() or detached, or the model has no trainable parameters")
        accum = self.config.accumulation_steps
        if accum > 1:
            loss = loss / accum
        if self._subscribers:  # observers get the window's mean loss; no cost without them
            d = loss.detach()
            self._window_loss = d if self._micro == 0 or self._window_loss is None else self._window_loss + d
        scaled = self._scaler.scale(loss)
        if self._matmul is not None:
            with self._matmul:
                scaled.backward(**kwargs)
        else:
            scaled.backward(**kwargs)
        self._micro += 1

    # ------------------------------------------------------------------ step
    def step(
        self,
        *optimizers: torch.optim.Optimizer,
        clip_grad_norm: Optional[float] = None,
        zero_grad: bool = True,
    ) -> StepResult:
        """Call after every :meth:`backward`; steps the optimizer(s) at the accumulation boundary.

        At the boundary: unscale the gradients (fp16), clip their total norm to
        ``clip_grad_norm`` (default ``config.clip_grad_norm``) so clipping always sees unscaled
        gradients, step each optimizer unless the gradients are non-finite (then the step is
        skipped and, for fp16, the scale backs off), update the scale, and set the gradients to
        None (``zero_grad=False`` keeps them). Off the boundary it returns at once.

        ``optimizers`` default to all optimizers given to :meth:`setup`. No host sync with fused
        optimizers (``fused=True``); other optimizers need one sync per step to decide whether to
        skip (as ``torch.amp.GradScaler`` does). Raises if called before :meth:`setup` or
        :meth:`backward`, or with an optimizer that was not set up.
        """
        self._require_setup("step")
        opts = self._check_optimizers(optimizers)
        if self._micro == 0:
            raise RuntimeError("step() called before backward(); call amp.backward(loss) after each "
                               "forward, then amp.step(optimizer)")
        if self._micro < self.config.accumulation_steps:
            return StepResult(boundary=False)
        clip = clip_grad_norm if clip_grad_norm is not None else self.config.clip_grad_norm
        if clip is not None and not clip > 0:
            raise ValueError(f"clip_grad_norm={clip!r} must be > 0 (or None for no clipping)")
        scaler = self._scaler
        grad_norm = None
        found_inf = None
        if scaler.is_enabled():
            scale = scaler.scale_tensor if scaler.is_unit else _clone(scaler.scale_tensor)
            if clip is not None and scaler.is_unit:
                # Nothing to unscale: the clipped total norm is non-finite exactly when some
                # gradient is, so it doubles as the finite check (saves a pass over the grads).
                grad_norm = torch.nn.utils.clip_grad_norm_(_params(opts), clip)
                found = torch.zeros((), dtype=torch.float32, device=grad_norm.device)
                # One fused op sets found=1.0 iff the norm is inf/NaN (and multiplies it by 1).
                torch._amp_foreach_non_finite_check_and_unscale_([grad_norm], found, scaler.one)
                for opt in opts:
                    scaler.set_found_inf(opt, found)
            elif clip is not None:
                for opt in opts:
                    scaler.unscale_(opt)
                grad_norm = torch.nn.utils.clip_grad_norm_(_params(opts), clip)
            for opt in opts:
                scaler.step(opt)
            scaler.update()
            found_inf = scaler.found_inf
        else:
            scale = None
            if clip is not None:
                grad_norm = torch.nn.utils.clip_grad_norm_(_params(opts), clip)
            for opt in opts:
                opt.step()
        if zero_grad:
            for opt in opts:
                opt.zero_grad(set_to_none=True)
        self._micro = 0
        self._steps += 1
        if self._fallback is not None:
            self._fallback.observe(found_inf)
            if self._steps % self.config.fallback_check_every == 0:
                trigger = self._fallback.check(scaler.scale_tensor if self.precision.needs_scaler else None,
                                               self.precision.needs_scaler)
                if trigger is not None:
                    self._fall_back(trigger)
        result = StepResult(boundary=True, grad_norm=grad_norm, scale=scale, found_inf=found_inf)
        if self._subscribers:
            loss, self._window_loss = self._window_loss, None
            self._emit("step", {"loss": loss, "result": result}, record=False)
        return result

    # ------------------------------------------------------------------ switching
    def switch(self, precision: Union[str, torch.dtype, Precision], *, reason: str = "requested") -> Precision:
        """Change the precision between optimizer steps (e.g. fp16 -> bf16 after overflows).

        The model's fp32 weights and the optimizer state carry over unchanged; the loss scaler
        is rebuilt from the config when the new precision needs one. Records a
        ``precision_switch`` event. Raises inside an accumulation window (gradients from the
        old precision would mix with the new one) and for precisions the device cannot run.
        """
        return self._switch(precision, "precision_switch", {"reason": reason})

    def _switch(self, precision: Union[str, torch.dtype, Precision], kind: str, data: dict[str, Any]) -> Precision:
        new = resolve_precision(precision, self.device_info)
        if new.name not in _SUPPORTED_BY_ENGINE:
            raise PrecisionError(f"cannot switch to {new.name!r}: the engine supports {', '.join(_SUPPORTED_BY_ENGINE)} so far")
        if self._micro != 0:
            raise RuntimeError(f"switch() called inside an accumulation window ({self._micro} of "
                               f"{self.config.accumulation_steps} micro-steps done); switch after step()")
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
        self._emit(kind, {"from": old.name, "to": new.name, **data})
        return new

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

    # ------------------------------------------------------------------ diagnosis
    #: ``localizer(model, closure, scale=...)`` used by :meth:`diagnose`; the package root sets it
    #: to :func:`ampkit.numerics.localize_nonfinite` (the engine does not import observers).
    default_localizer: Optional[Callable[..., Any]] = None

    def diagnose(self, closure: Callable[[], torch.Tensor], *, scale: Optional[float] = None,
                 localizer: Optional[Callable[..., Any]] = None) -> Any:
        """Name the first module that produces inf/NaN on ``closure``'s batch (see
        :func:`ampkit.numerics.localize_nonfinite`); records a ``diagnosis`` event and attaches the
        report to the next ``fallback`` event. ``scale`` defaults to the current loss scale
        (fp16). Runs an extra forward and backward and **syncs**; gradients are left untouched.
        """
        self._require_setup("diagnose")
        localize = localizer or type(self).default_localizer
        if localize is None:
            raise RuntimeError("diagnose() has no localizer: pass localizer=ampkit.numerics.localize_nonfinite")
        if scale is None and self.precision.needs_scaler:
            scale = self._scaler.get_scale()
        assert self._model is not None
        report = localize(self._model, closure, scale=scale)
        self._last_diagnosis = report
        self._emit("diagnosis", report.to_dict())
        return report

    @property
    def overridden_modules(self) -> list[str]:
        """Qualified names of the modules kept in fp32 (``keep_fp32``)."""
        return list(self._overrides.names) if self._overrides is not None else []

    # ------------------------------------------------------------------ events
    def subscribe(self, callback: Callable[[Event], None]) -> Callable[[], None]:
        """Call ``callback(event)`` for every future event; returns a function that unsubscribes.

        Kinds: ``step`` (every optimizer step; ``data`` holds the window's mean ``loss`` and the
        :class:`StepResult`, as device tensors: reading them syncs, so observers batch their
        reads), ``precision_switch``, and whatever :meth:`record_event` is given. Callbacks run
        synchronously inside ``step()``: keep them cheap.
        """
        self._subscribers.append(callback)

        def unsubscribe() -> None:
            if callback in self._subscribers:
                self._subscribers.remove(callback)

        return unsubscribe

    def record_event(self, kind: str, **data: Any) -> Event:
        """Record a notable event (kept in ``state_dict``) and pass it to subscribers."""
        return self._emit(kind, data)

    @property
    def events(self) -> list[Event]:
        """Notable events so far (switches, fallbacks, ...); per-step events are not kept."""
        return list(self._events)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers given to :meth:`setup`."""
        return list(self._optimizers)

    @property
    def model(self) -> Optional[torch.nn.Module]:
        return self._model

    def _emit(self, kind: str, data: dict[str, Any], record: bool = True) -> Event:
        event = Event(kind=kind, step=self._steps, data=data)
        if record:
            self._events.append(event)
        for cb in list(self._subscribers):
            cb(event)
        return event

    # ------------------------------------------------------------------ reading (syncs)
    @property
    def optimizer_steps(self) -> int:
        """Accumulation boundaries reached (optimizer steps attempted, skipped ones included)."""
        return self._steps

    def stats(self) -> dict[str, Any]:
        """Precision, scale, steps, skipped steps, overflow rate, events. **Syncs** (reads device counters)."""
        overflows = self._scaler.overflow_count
        skipped = int(overflows.item()) if overflows is not None and self._scaler.is_enabled() else 0
        if self._skipped_before is not None:
            skipped += int(self._skipped_before.item())
        return {
            "precision": self.precision.name,
            "device": str(self.device),
            "scale": self._scaler.get_scale() if self.precision.needs_scaler else None,
            "optimizer_steps": self._steps,
            "skipped_steps": skipped,
            "overflow_rate": skipped / self._steps if self._steps else 0.0,
            "accumulation_steps": self.config.accumulation_steps,
            "pending_micro_steps": self._micro,
            "events": [e.to_dict() for e in self._events],
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: precision (after switches), config, scaler, counters, events. **Syncs**.

        Call between optimizer steps (not inside an accumulation window).
        """
        return {
            "precision": self.precision.name,
            "config": self.config.to_dict(),
            "scaler": self._scaler.state_dict(),
            "optimizer_steps": self._steps,
            "micro_steps": self._micro,
            "skipped_before": int(self._skipped_before.item()) if self._skipped_before is not None else 0,
            "events": [e.to_dict() for e in self._events],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`. Validates everything before changing anything."""
        if not isinstance(state, dict) or "precision" not in state or "config" not in state:
            raise ValueError("not a MixedPrecision state dict: expected keys 'precision', 'config', 'scaler', ...")
        cfg = MixedPrecisionConfig.from_dict(state["config"])
        new = resolve_precision(state["precision"], self.device_info)
        self.config = cfg
        self.precision = new
        self._scaler = self._make_scaler(new)
        if state.get("scaler"):
            self._scaler.load_state_dict(state["scaler"])
        self._steps = int(state.get("optimizer_steps", 0))
        before = int(state.get("skipped_before", 0))
        self._skipped_before = torch.tensor(float(before), device=self.device) if before else None
        self._micro = int(state.get("micro_steps", 0))
        self._events = [Event(kind=e["kind"], step=e["step"],
                              data={k: v for k, v in e.items() if k not in ("kind", "step")})
                        for e in state.get("events", [])]
        self._fallback = self._make_fallback()
        self._build_contexts()

    # ------------------------------------------------------------------ internals
    def _require_setup(self, verb: str) -> None:
        if self._model is None:
            raise RuntimeError(f"{verb}() called before setup(); call model, optimizer = amp.setup(model, optimizer) first")

    def _check_optimizers(self, optimizers: tuple[torch.optim.Optimizer, ...]) -> list[torch.optim.Optimizer]:
        if not optimizers:
            if not self._optimizers:
                raise RuntimeError("step() has no optimizer: pass it to setup(model, optimizer) or to step(optimizer)")
            return self._optimizers
        for opt in optimizers:
            if not any(opt is o for o in self._optimizers):
                raise ValueError(f"step() got an optimizer ({type(opt).__name__}) that was not set up; "
                                 "pass it to amp.setup(model, optimizer) first")
        return list(optimizers)

    def __repr__(self) -> str:
        return (f"MixedPrecision(precision={self.precision.name!r}, device={str(self.device)!r}, "
                f"accumulation_steps={self.config.accumulation_steps})")


def _params(opts: list[torch.optim.Optimizer]) -> list[torch.Tensor]:
    return [p for opt in opts for g in opt.param_groups for p in g["params"] if p.grad is not None]


def _clone(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if t is None else t.clone()
