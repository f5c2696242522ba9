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

    unscale_ (only if clipping) -> clip_grad_norm_ (model order) -> scaler.step (skip if
    non-finite) -> scaler.update -> zero_grad(set_to_none=True)

(see :mod:`ampkit.step.boundary`; window bookkeeping in :mod:`ampkit.step.accumulate`).

The engine knows nothing about logging, plots or the CLI: observers subscribe to its events
(:meth:`MixedPrecision.subscribe`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable, Optional, Union

import torch

from .accumulate import Window
from .boundary import ClipOrder, optimizer_step
from .config import MixedPrecisionConfig
from .contexts import MatmulPrecision
from .determinism import apply_determinism
from .events import Event, EventStream, StepResult
from .fallback import NumericsError
from .hardware import DeviceInfo, device_info, normalize_device
from .master import MasterWeights
from .overrides import Fp32Overrides, apply_fp32_overrides
from .parallel import Parallel
from .precision import Precision, resolve_precision
from .scaler import LossScaler
from .state import StateMixin
from .switching import SwitchingMixin
from .validation import check_setup, stepped_optimizers

__all__ = ["Event", "MixedPrecision", "NumericsError", "StepResult"]

class MixedPrecision(SwitchingMixin, StateMixin):
    """Mixed-precision training: autocast, loss scaling, accumulation, clipping, skipping, switching.

    Args:
        precision: a name or alias (``"auto"``, ``"bf16"``, ``"fp16"``, ``"16-mixed"``, ...), a
            ``torch.dtype``, or None to take ``config.precision`` (default ``"auto"``).
        device: where training runs (default: CUDA if available, else MPS, else CPU).
        config: a :class:`MixedPrecisionConfig`; ``**overrides`` replace single fields of it,
            e.g. ``MixedPrecision("fp16", init_scale=2.**12, accumulation_steps=4)``.

    Raises :class:`PrecisionError` for unknown precisions and precisions the device cannot run,
    and :class:`ampkit.step.config.ConfigError` for invalid settings.
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
        self.precision: Precision = resolve_precision(cfg.precision, self.device_info, emulate_fp8=cfg.fp8_emulate)
        self._parallel: Parallel = Parallel()
        self._scaler = self._make_scaler(self.precision)
        self._model: Optional[torch.nn.Module] = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._window = Window(cfg.accumulation_steps)
        self._clip_order: Optional[ClipOrder] = None
        self._steps = 0  # accumulation boundaries reached (optimizer steps attempted)
        self._stream = EventStream()
        self._masters: Optional[MasterWeights] = None
        self._fp8_report: Optional[list[Any]] = None
        self._window_loss: Optional[torch.Tensor] = None
        self._overrides: Optional[Fp32Overrides] = None
        self._skipped_before: Optional[torch.Tensor] = None  # skips counted by scalers since replaced
        self._last_diagnosis: Optional[Any] = None
        self._fallback = self._make_fallback()
        self._build_contexts()

    # ------------------------------------------------------------------ construction helpers
    def _make_scaler(self, precision: Precision) -> LossScaler:
        if precision.needs_scaler:
            scaler = LossScaler.from_config(self.config, device=self.device)
        else:  # no scaling arithmetic at all; still finite-checks when skip_nonfinite is on
            scaler = LossScaler(1.0, dynamic=False, enabled=self.config.skip_nonfinite, device=self.device)
        scaler.found_inf_hook = self._parallel.found_inf_reducer()  # data parallel: same skips on all ranks
        return scaler

    def _build_contexts(self) -> None:
        p = self.precision
        if p.name == "tf32":
            # On CUDA "high" means TF32; on CPUs with AMX, oneDNN may use bf16 internals.
            level = "high" if self.device.type == "cuda" else "medium"
            self._matmul: Optional[MatmulPrecision] = MatmulPrecision(level, True)
        elif p.name == "fp32":
            self._matmul = MatmulPrecision("highest", False)
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
        engine cannot apply yet (the pure forms and fp8), before anything is changed. With
        ``config.deterministic`` set, first switches PyTorch to deterministic kernels
        (process-wide: :func:`ampkit.step.determinism.apply_determinism`).
        """
        check_setup(self.precision.name, model, optimizers, self.config.keep_fp32)  # before anything changes
        if self.config.deterministic is not False:
            apply_determinism(self.config.deterministic)
        if any(t.device != self.device for t in [*model.parameters(), *model.buffers()]):
            model.to(self.device)  # (skipped when already there: also lets fake-tensor models through)
        self._model = model
        self._fp8_report = None
        if self.precision.name == "fp8":  # before the overrides: conversion swaps modules
            self._convert_fp8()
        if self._overrides is not None:
            self._overrides.remove()
        if self.config.keep_fp32:
            self._overrides = apply_fp32_overrides(model, self.config.keep_fp32, self.device.type)
        self._model = model
        self._optimizers = list(optimizers)
        pick = type(self).parallel_adapter
        self._parallel = (pick(model) if pick is not None else None) or Parallel()
        self._scaler.found_inf_hook = self._parallel.found_inf_reducer()
        self._masters = None
        if self.precision.is_pure and not self._parallel.shards_params:  # FSDP2: the fp32 shards are the masters
            self._masters = MasterWeights(model, self._optimizers, self.precision.param_dtype, self._kept_names())
        self._parallel.use_masters(self._masters is not None)
        self._clip_order = ClipOrder(model, self._masters)
        if self.config.compile:
            model.compile()  # nn.Module.compile: in place, so parameters and state_dict keys stay the same
        return (model, *optimizers) if optimizers else model

    # ------------------------------------------------------------------ forward
    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """Context for the forward pass (and loss): autocast to the compute dtype.

        Also applies the fp32 matmul policy (tf32 on / strictly off for fp32) and, under DDP,
        ``no_sync()`` on micro-steps that do not end an accumulation window. No sync.
        """
        p = self.precision
        w = self._window
        no_sync = self._parallel.forward_context(w.micro + 1 >= w.current_size)
        autocast = p.autocast_enabled or p.is_pure  # pure: inputs and non-mastered ops follow the half dtype
        if autocast and self._matmul is None and no_sync is None:
            # The common case costs exactly what a hand-written loop pays: one torch.autocast.
            return torch.autocast(self.device.type, dtype=p.compute_dtype, cache_enabled=self.config.autocast_cache)
        if not autocast and no_sync is None and self._matmul is not None:
            return self._matmul  # fp32 / tf32: only the matmul policy
        stack = contextlib.ExitStack()
        if autocast:
            stack.enter_context(torch.autocast(self.device.type, dtype=p.compute_dtype,
                                               cache_enabled=self.config.autocast_cache))
        if self._matmul is not None:
            stack.enter_context(self._matmul)
        if no_sync is not None:
            stack.enter_context(no_sync)
        return stack

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Run the block in full fp32: autocast off, reduced-precision matmul internals off (e.g. evaluation)."""
        with torch.autocast(self.device.type, enabled=False), MatmulPrecision("highest", False):
            yield

    # ------------------------------------------------------------------ backward
    def backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        """Backpropagate ``loss``: divided by ``accumulation_steps``, multiplied by the loss scale.

        **The division is ampkit's**: pass the plain per-micro-batch loss, not ``loss / accum``
        (README "Porting an existing loop"). Gradients accumulate into ``.grad`` (scaled for fp16
        until :meth:`step` unscales them). ``kwargs`` go to ``Tensor.backward`` (e.g.
        ``retain_graph``). Raises when the window already holds ``accumulation_steps``
        micro-steps without a :meth:`step` in between. No sync.
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
        window = self._window
        window.add_micro()  # raises before any gradient is touched when the window is full
        if window.divisor > 1:
            loss = loss / window.divisor
        if self._stream.subscribers:  # observers get the window's mean loss; no cost without them
            d = loss.detach()
            self._window_loss = d if window.micro == 1 or self._window_loss is None else self._window_loss + d
        scaled = self._scaler.scale(loss)
        self._parallel.before_backward(window.complete)
        try:
            if self._matmul is not None:
                with self._matmul:
                    scaled.backward(**kwargs)
            else:
                scaled.backward(**kwargs)
        except BaseException:
            window.micro -= 1  # that micro-step did not happen (e.g. an out-of-memory error)
            raise
        if self._masters is not None:
            self._masters.absorb_grads()  # half gradients summed into the fp32 masters' gradients

    def set_window(self, micro_steps: int) -> None:
        """Make the next accumulation window ``micro_steps`` long (1..``accumulation_steps``).

        For the last, short window of an epoch when its length is known in advance (timm's
        ``last_accum_steps``): each loss of that window is divided by ``micro_steps`` and
        :meth:`step` steps after ``micro_steps`` backward calls -- bitwise what a hand-written
        loop computes. Afterwards windows are ``accumulation_steps`` long again. Call it before
        the window's first :meth:`backward`; raises otherwise.
        """
        self._window.set_size(micro_steps)

    def discard_window(self) -> None:
        """Drop the current accumulation window: its gradients (set to None on every set-up
        optimizer) and its micro-step count -- e.g. to redo it after an out-of-memory error."""
        self._require_setup("discard_window")
        for opt in self._optimizers:
            opt.zero_grad(set_to_none=True)
        if self._model is not None:
            for p in self._model.parameters():
                p.grad = None  # half gradients not yet absorbed, parameters outside the optimizers
        self._window.reset()
        self._window_loss = None

    def set_accumulation_steps(self, n: int) -> None:
        """Change ``accumulation_steps`` between windows (raises inside one)."""
        if self._window.micro:
            raise RuntimeError(f"set_accumulation_steps() inside a window ({self._window.micro} micro-step(s) "
                               "done); call it after step() or discard_window()")
        self.config = self.config.replace(accumulation_steps=n)
        self._window = Window(n)

    # ------------------------------------------------------------------ step
    def step(
        self,
        *optimizers: torch.optim.Optimizer,
        clip_grad_norm: Optional[float] = None,
        zero_grad: bool = True,
        flush: bool = False,
    ) -> StepResult:
        """Call after every :meth:`backward` (or once after a window's backward calls); steps the
        optimizer(s) at the accumulation boundary.

        At the boundary: unscale the gradients (fp16), clip their total norm to
        ``clip_grad_norm`` (default ``config.clip_grad_norm``) over the model's parameters in
        model order, so clipping always sees unscaled gradients, step each optimizer unless the
        gradients are non-finite (then the step is skipped and, for fp16, the scale backs off),
        update the scale, and set the gradients to None (``zero_grad=False`` keeps them). Off
        the boundary it returns at once.

        ``flush=True`` steps now even if the window is short (the end of an epoch): the
        gradients, summed over ``k`` micro-steps each divided by ``accumulation_steps``, are
        first multiplied by ``accumulation_steps / k`` -- the mean over the ``k`` micro-batches.
        With an empty window it does nothing and returns a non-boundary result.

        ``optimizers`` default to all optimizers given to :meth:`setup`. No host sync with fused
        optimizers (``fused=True``); other optimizers need one sync per step to decide whether to
        skip (as ``torch.amp.GradScaler`` does). Raises if called before :meth:`setup` or
        :meth:`backward`, or with an optimizer that was not set up.

        Every ``fallback_check_every`` steps the numerics check runs (asynchronous, see
        :mod:`ampkit.step.fallback`): with ``fallback`` on it may switch precision after this step;
        with it off, a loss scale exhausted at its floor (``max(min_scale, 2**-126)``) that still
        overflows raises :class:`NumericsError` naming the non-finite layers (the gradients are
        dropped first, as usual). Only a firing trigger syncs.
        """
        self._require_setup("step")
        opts = self._check_optimizers(optimizers)
        window = self._window
        if window.micro == 0:
            if flush:
                return StepResult(boundary=False)
            raise RuntimeError("step() called before backward(); call amp.backward(loss) after each "
                               "forward, then amp.step(optimizer)")
        if not window.complete and not flush:
            return StepResult(boundary=False)
        clip = clip_grad_norm if clip_grad_norm is not None else self.config.clip_grad_norm
        if clip is not None and not clip > 0:
            raise ValueError(f"clip_grad_norm={clip!r} must be > 0 (or None for no clipping)")
        assert self._clip_order is not None
        params = self._clip_order.params(opts)
        self._parallel.before_step(params)
        grad_norm, scale, found_inf = optimizer_step(self._scaler, opts, params, clip, window.flush_factor())
        if self._masters is not None:
            self._masters.copy_to_model()  # unconditional: after a skipped step the masters did not move
        micro = window.micro
        window.reset()
        self._steps += 1
        try:  # before the gradients go, so that a trigger can name the non-finite ones
            trigger = self._watch(found_inf, scale)  # raises NumericsError: scale exhausted, fallback off
        finally:
            if zero_grad:
                for opt in opts:
                    opt.zero_grad(set_to_none=True)
        if trigger is not None:
            self._fall_back(trigger)  # raises NumericsError at the end of the chain
        result = StepResult(boundary=True, grad_norm=grad_norm, scale=scale, found_inf=found_inf)
        if self._stream.subscribers:
            loss, self._window_loss = self._window_loss, None
            if loss is not None and micro != window.size and flush:
                loss = loss * (window.size / micro)  # the mean over the short window, like the gradients
            self._emit("step", {"loss": loss, "result": result}, record=False)
        return result

    # ------------------------------------------------------------------ diagnosis
    #: ``localizer(model, closure, scale=...)`` used by :meth:`diagnose`; the package root sets it
    #: to :func:`ampkit.observe.numerics.localize_nonfinite` (the engine does not import observers).
    default_localizer: Optional[Callable[..., Any]] = None
    #: ``parallel_adapter(model) -> Parallel | None``: how to cooperate with a DDP/FSDP2 model; the
    #: package root sets it to :func:`ampkit.distributed.adapter_for`.
    parallel_adapter: Optional[Callable[[torch.nn.Module], Optional[Parallel]]] = None

    def diagnose(self, closure: Callable[[], torch.Tensor], *, scale: Optional[float] = None,
                 localizer: Optional[Callable[..., Any]] = None) -> Any:
        """Name the first module that produces inf/NaN on ``closure``'s batch (see
        :func:`ampkit.observe.numerics.localize_nonfinite`); records a ``diagnosis`` event and attaches the
        report to the next ``fallback`` event. ``scale`` defaults to the current loss scale
        (fp16). Runs an extra forward and backward and **syncs**; gradients are left untouched.
        """
        self._require_setup("diagnose")
        localize = localizer or type(self).default_localizer
        if localize is None:
            raise RuntimeError("diagnose() has no localizer: pass localizer=ampkit.observe.numerics.localize_nonfinite")
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
        return self._stream.subscribe(callback)

    def record_event(self, kind: str, **data: Any) -> Event:
        """Record a notable event (kept in ``state_dict``) and pass it to subscribers."""
        return self._emit(kind, data)

    @property
    def events(self) -> list[Event]:
        """Notable events so far (switches, fallbacks, ...); per-step events are not kept."""
        return list(self._stream.kept)

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers given to :meth:`setup`."""
        return list(self._optimizers)

    @property
    def model(self) -> Optional[torch.nn.Module]:
        return self._model

    def _emit(self, kind: str, data: dict[str, Any], record: bool = True) -> Event:
        return self._stream.emit(Event(kind=kind, step=self._steps, data=data), record)

    # ------------------------------------------------------------------ reading (syncs)
    @property
    def optimizer_steps(self) -> int:
        """Accumulation boundaries reached (optimizer steps attempted, skipped ones included)."""
        return self._steps

    # ------------------------------------------------------------------ internals
    def _require_setup(self, verb: str) -> None:
        if self._model is None:
            raise RuntimeError(f"{verb}() called before setup(); call model, optimizer = amp.setup(model, optimizer) first")

    def _check_optimizers(self, optimizers: tuple[torch.optim.Optimizer, ...]) -> list[torch.optim.Optimizer]:
        return stepped_optimizers(optimizers, self._optimizers)

    def __repr__(self) -> str:
        return (f"MixedPrecision(precision={self.precision.name!r}, device={str(self.device)!r}, "
                f"accumulation_steps={self.config.accumulation_steps})")


