"""MixedPrecision: the training-step engine.

The happy path is four calls::

    amp = MixedPrecision("auto")
    model, opt = amp.setup(model, opt)
    with amp.autocast():
        loss = model(batch)
    amp.backward(loss)
    amp.step(opt, clip_grad_norm=1.0)

At an optimizer step (the accumulation boundary) the order is the hand-written torch.amp loop's:
unscale_ (if clipping) -> clip (model order) -> step, skipped if non-finite -> update -> zero_grad
(:mod:`ampkit.step.boundary`; window bookkeeping: :mod:`ampkit.step.accumulate`).

The engine knows nothing about logging, plots or the CLI: observers subscribe to its events
(:meth:`MixedPrecision.subscribe`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Callable, Optional, Union

import torch

from .accumulate import Window
from .boundary import ClipOrder, PendingUpdate, lean_step, optimizer_step
from .config import MixedPrecisionConfig
from .contexts import MatmulPrecision
from .determinism import apply_determinism
from .events import Event, EventStream, StepResult
from .fallback import (
    NumericsError,
    Trigger,
    chain_exhausted,
    fallback_data,
    ladder_form,
    make_fallback,
    recover_data,
    rung_move,
    scale_exhausted,
)
from .hardware import DeviceInfo, device_info, normalize_device
from .in_backward import InBackward
from .localize import NonFiniteReport, localize_nonfinite
from .logs import watch
from .losscheck import check_loss
from .manifest_check import Manifest, ManifestWatch, build_manifest
from .model_prep import before_setup
from .overrides import Fp32Overrides, apply_fp32_overrides
from .parallel import adapter_for
from .parallel.base import Parallel
from .policies import policy_for
from .policies.base import PrecisionPolicy
from .precision import Precision, resolve_precision
from .profiling import ranged
from .scaler import LossScaler
from .settings_diff import warn_replaced
from .validation import check_setup, stepped_optimizers
from .window_state import restore_window, window_state

__all__ = ["Event", "MixedPrecision", "NumericsError", "StepResult"]


class MixedPrecision:
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
            overrides["precision"] = (
                precision.name if isinstance(precision, Precision) else precision
            )
        if overrides:
            cfg = cfg.replace(**overrides)
        self.config: MixedPrecisionConfig = cfg
        self.device: torch.device = normalize_device(device)
        self.device_info: DeviceInfo = device_info(self.device)
        self.precision: Precision = resolve_precision(
            cfg.precision, self.device_info, emulate_fp8=cfg.fp8_emulate
        )
        self._parallel: Parallel = Parallel()
        self._policy: PrecisionPolicy = policy_for(self.precision, cfg, self.device, asked=True)
        self._backward_context: Optional[contextlib.AbstractContextManager[Any]] = None
        self._scaler = self._make_scaler(self.precision)
        self._model: Optional[torch.nn.Module] = None
        self._optimizers: list[torch.optim.Optimizer] = []
        self._window = Window(cfg.accumulation_steps)
        self._clip_order: Optional[ClipOrder] = None
        self._updates = PendingUpdate()  # optimizers stepped with update_scale=False
        self._steps = 0  # scale updates (iterations) done: optimizer steps attempted
        self._stream, self._manifest = EventStream(), ManifestWatch()  # events; manifest checks
        self._window_loss: Optional[torch.Tensor] = None
        self._open_micro = False  # backward(micro_step_done=False) left the micro-step open
        self._normalized = False  # the window's losses are normalised (backward(normalized=True))
        self._overrides: Optional[Fp32Overrides] = None
        self._skipped_before: Optional[torch.Tensor] = None  # skips by scalers since replaced
        self._last_diagnosis: Optional[NonFiniteReport] = None
        self._fallback = make_fallback(cfg, self.precision.name, self.device_info)
        self._in_backward = (
            InBackward() if cfg.optimizer_in_backward else None
        )  # step/in_backward.py
        watch(self)  # logging.getLogger("ampkit"): subscribes only when enabled

    def _make_scaler(self, precision: Precision) -> LossScaler:
        if precision.needs_scaler:
            scaler = LossScaler.from_config(self.config, device=self.device)
        else:  # no scaling arithmetic at all; still finite-checks when skip_nonfinite is on
            scaler = LossScaler(
                1.0, dynamic=False, enabled=self.config.skip_nonfinite, device=self.device
            )
        scaler.found_inf_hook = (
            self._parallel.found_inf_reducer()
        )  # data parallel: same skips on all ranks
        return scaler

    # ------------------------------------------------------------------ set-up
    @property
    def scaler(self) -> LossScaler:
        """The loss scaler in use (a constant unit scaler for precisions without scaling)."""
        return self._scaler

    @property
    def policy(self) -> PrecisionPolicy:
        """The current precision's policy (:mod:`ampkit.step.policies`); ``policy.describe()`` says what it does."""
        return self._policy

    def setup(self, model: torch.nn.Module, *optimizers: torch.optim.Optimizer) -> Any:
        """Prepare ``model`` (moved to the device) and register ``optimizers`` with the engine.

        Returns ``model`` when no optimizer is given, else ``(model, *optimizers)``. Must be called before
        :meth:`backward`/:meth:`step`. The precision's policy prepares the model (casts and fp32 masters for the
        pure forms, fp8 modules); the DDP / FSDP2 adapter is picked from the model
        (:func:`ampkit.step.parallel.adapter_for`). Raises before anything is changed for a model or optimizers that
        do not fit. With ``config.deterministic`` set, first switches PyTorch to deterministic kernels
        (process-wide: :func:`ampkit.step.determinism.apply_determinism`).
        """
        check_setup(model, optimizers, self.config.keep_fp32)  # before anything changes
        if levers := before_setup(
            model, self.config
        ):  # refuses nn.DataParallel; memory_efficient's levers
            self._emit("memory_efficient", {"levers": levers})
        if self.config.deterministic is not False:
            apply_determinism(self.config.deterministic)
        if any(t.device != self.device for t in [*model.parameters(), *model.buffers()]):
            model.to(
                self.device
            )  # (skipped when already there: also lets fake-tensor models through)
        if self._model is not None:
            self._policy.release()  # a second setup(): the previous model gets its fp32 form back
        self._model = model
        self._optimizers = list(optimizers)
        self._parallel = adapter_for(model)
        self._scaler.found_inf_hook = self._parallel.found_inf_reducer()
        self._policy = policy_for(
            self.precision, self.config, self.device, shards_params=self._parallel.shards_params
        )
        self._prepare(model)  # before the overrides: fp8 conversion swaps modules
        self._manifest.setup(
            self
        )  # (a pure precision on a model fully_shard-ed without its policy: see there)
        if self._overrides is not None:
            self._overrides.remove()
        if self.config.keep_fp32:
            self._overrides = apply_fp32_overrides(model, self.config.keep_fp32, self.device.type)
        if self.config.compile:
            model.compile()  # nn.Module.compile: in place, so parameters and state_dict keys stay the same
        return (model, *optimizers) if optimizers else model

    def _prepare(self, model: torch.nn.Module) -> None:
        """The current policy gives the model its form; the adapter and the clip order follow it."""
        policy = self._policy
        policy.prepare(model, self._optimizers)
        self._backward_context = policy.backward_context()  # reusable: asked once, not per step
        self._parallel.use_masters(policy.keeps_masters)
        self._clip_order = ClipOrder(model, policy.stepped if policy.keeps_masters else None)
        if (
            self._in_backward is not None
        ):  # the optimizer steps in backward: hooks on the model's parameters
            self._in_backward.attach(
                model, self._optimizers, self.precision, policy, self._parallel.name, self._scaler
            )

    # ------------------------------------------------------------------ forward
    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Context for the forward pass (and loss): the policy's forward context -- autocast to the
        compute dtype, or for fp32/tf32 the fp32 matmul precision -- and, under DDP, ``no_sync()`` on
        micro-steps that do not end an accumulation window. No sync.
        """
        w = self._window
        no_sync = self._parallel.forward_context(w.micro + (not self._open_micro) >= w.current_size)
        if (
            no_sync is None
        ):  # one torch.autocast: what a hand-written loop pays (a range only while profiling)
            return ranged("ampkit.forward", self._policy.forward_context())
        stack = contextlib.ExitStack()
        stack.enter_context(ranged("ampkit.forward", self._policy.forward_context()))
        stack.enter_context(no_sync)
        return stack

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Run the block in full fp32: autocast off, reduced-precision matmul internals off (e.g. evaluation)."""
        with torch.autocast(self.device.type, enabled=False), MatmulPrecision("highest", False):
            yield

    # ------------------------------------------------------------------ backward
    def backward(
        self,
        loss: torch.Tensor,
        *,
        micro_step_done: bool = True,
        normalized: bool = False,
        **kwargs: Any,
    ) -> None:
        """Backpropagate ``loss``: divided by ``accumulation_steps``, multiplied by the loss scale.

        **The division is ampkit's**: pass the plain per-micro-batch loss, not ``loss / accum`` (README "Porting an
        existing loop"). ``normalized=True``: the loss is already normalised over the whole window (Hugging Face's
        ``num_items_in_batch``), so it is not divided, nor rescaled by ``step(flush=True)``; a window holds one kind
        of loss (mixing raises). ``micro_step_done=False`` leaves the micro-step open for more backward passes into
        the same gradients, PyTorch's "multiple losses" recipe: ``amp.backward(loss0, retain_graph=True,
        micro_step_done=False); amp.backward(loss1)``; :meth:`step` raises while one is open. Gradients accumulate
        into ``.grad`` (scaled for fp16 until :meth:`step` unscales them). ``kwargs`` go to ``Tensor.backward``
        (e.g. ``retain_graph``). Raises when the window already holds ``accumulation_steps`` micro-steps without a
        :meth:`step` in between. No sync.
        """
        if self._model is None:
            self._require_setup("backward")
        check_loss(loss)
        window, was_open = self._window, self._open_micro
        if window.micro and normalized != self._normalized:
            raise ValueError(
                f"backward(normalized={normalized}) inside a window of normalized={self._normalized} "
                "losses: a window's losses are all normalised over it, or none is"
            )
        if self._in_backward is not None:
            self._in_backward.start(loss, micro_step_done)
        if not was_open:
            window.add_micro()  # raises before any gradient is touched when the window is full
        self._normalized = normalized
        if window.divisor > 1 and not normalized:
            loss = loss / window.divisor
        if self._stream.subscribers:  # observers get the window's mean loss; no cost without them
            d = loss.detach()
            first = window.micro == 1 and not was_open
            self._window_loss = d if first or self._window_loss is None else self._window_loss + d
        scaled = self._scaler.scale(loss)
        self._parallel.before_backward(window.complete)
        try:
            with ranged("ampkit.backward", self._backward_context):
                scaled.backward(**kwargs)
        except BaseException:
            if not was_open:
                window.micro -= 1  # that micro-step did not happen (e.g. an out-of-memory error)
            raise
        self._open_micro = not micro_step_done
        hook = (
            self._policy.after_backward
        )  # pure precisions: half gradients summed into the fp32 masters'
        if hook is not None:  # True: a whole one-micro-step window (the step comes next)
            hook(micro_step_done and not was_open and window.micro == 1 and window.complete)

    def scale(self, outputs: Any) -> Any:
        """``outputs`` (a tensor or a nested list/tuple of them) times the loss scale, for gradients
        taken by hand: ``torch.autograd.grad(amp.scale(loss), params, create_graph=True)`` gives
        scaled gradients; multiply them by ``1.0 / amp.get_scale()`` (PyTorch's "gradient penalty"
        recipe). Not divided by the window (:meth:`backward` does that); unchanged for precisions
        without loss scaling. No sync."""
        return self._scaler.scale(outputs)

    def get_scale(self) -> float:
        """The current loss scale as a float (1.0 for precisions without scaling). **Syncs**."""
        return self._scaler.get_scale() if self.precision.needs_scaler else 1.0

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
        if (end := self._policy.end_step) is not None:
            end()
        self._window.reset()
        self._window_loss = None
        self._open_micro = False

    def set_accumulation_steps(self, n: int) -> None:
        """Change ``accumulation_steps`` between windows (raises inside one)."""
        if self._window.micro:
            raise RuntimeError(
                f"set_accumulation_steps() inside a window ({self._window.micro} micro-step(s) "
                "done); call it after step() or discard_window()"
            )
        self.config = self.config.replace(accumulation_steps=n)
        self._window = Window(n)

    # ------------------------------------------------------------------ step
    def step(
        self,
        *optimizers: torch.optim.Optimizer,
        clip_grad_norm: Optional[float] = None,
        zero_grad: bool = True,
        flush: bool = False,
        update_scale: bool = True,
    ) -> StepResult:
        """Call after every :meth:`backward` (or once after a window's backward calls); steps the optimizer(s) at
        the accumulation boundary.

        At the boundary: unscale the gradients (fp16), clip their total norm to ``clip_grad_norm`` (default
        ``config.clip_grad_norm``) over the model's parameters in model order, so clipping always sees unscaled
        gradients, step each optimizer unless the gradients are non-finite (then the step is skipped and, for fp16,
        the scale backs off), update the scale, and set the gradients to None (``zero_grad=False`` keeps them). Off
        the boundary it returns at once.

        ``flush=True`` steps now even if the window is short (the end of an epoch): the gradients, summed over ``k``
        micro-steps each divided by ``accumulation_steps``, are first multiplied by ``accumulation_steps / k`` --
        the mean over the ``k`` micro-batches. With an empty window it does nothing and returns a non-boundary
        result.

        ``update_scale=False`` leaves the scale update to the next step, which folds in every optimizer stepped
        since: one update per iteration for optimizers stepped apart (a GAN: :class:`.boundary.PendingUpdate`).

        With ``optimizer_in_backward`` each parameter was stepped in backward (:mod:`ampkit.step.in_backward`): here
        only the step's finite check is recorded; ``clip_grad_norm`` raises.

        ``optimizers`` default to all optimizers given to :meth:`setup`. No host sync with fused optimizers
        (``fused=True``); other optimizers need one sync per step to decide whether to skip (as
        ``torch.amp.GradScaler`` does). Raises if called before :meth:`setup` or :meth:`backward`, or with an
        optimizer that was not set up.

        Every ``fallback_check_every`` steps the numerics check runs (asynchronous, see
        :mod:`ampkit.step.fallback`): with ``fallback`` on it may switch precision after this step; with it off, a
        loss scale exhausted at its floor (``max(min_scale, 2**-126)``) that still overflows raises
        :class:`NumericsError` naming the non-finite layers (the gradients are dropped first, as usual). Only a
        firing trigger syncs.
        """
        if self._model is None:
            self._require_setup("step")
        opts = stepped_optimizers(optimizers, self._optimizers)
        window = self._window
        if window.micro == 0:
            if flush:
                return StepResult(boundary=False)
            raise RuntimeError(
                "step() called before backward(); call amp.backward(loss) after each "
                "forward, then amp.step(optimizer)"
            )
        if self._open_micro:
            raise RuntimeError(
                "step() called inside a micro-step left open by backward(..., micro_step_done=False); "
                "finish it with a last backward() (micro_step_done=True, the default) first"
            )
        if not window.complete and not flush:
            return StepResult(boundary=False)
        clip = clip_grad_norm if clip_grad_norm is not None else self.config.clip_grad_norm
        if clip is not None and not clip > 0:
            raise ValueError(f"clip_grad_norm={clip!r} must be > 0 (or None for no clipping)")
        self._updates.check(opts, update_scale, self._in_backward is not None)
        if (
            self._in_backward is not None
        ):  # each parameter was stepped in backward: the check's bookkeeping
            grad_norm, scale, found_inf = self._in_backward.finish(self._scaler, opts, clip)
        else:
            assert self._clip_order is not None
            params = self._clip_order.params(opts)
            flush_factor = None if self._normalized else window.flush_factor()
            lean, clip_fn = False, None
            if (prep := self._policy.before_step) is not None:  # the ladder's bf16 gradients
                one = type(self._parallel) is Parallel
                lean = lean_step(self._scaler, flush_factor, zero_grad) and one
                prep(lean)
                clip_fn = self._policy.clip_grad_norm if lean else None
            self._parallel.before_step(params)
            grad_norm, scale, found_inf = optimizer_step(
                self._scaler, opts, params, clip, flush_factor, clip_fn, update_scale
            )
        self._updates.done(opts, update_scale, self._scaler.is_enabled())
        hook = self._policy.after_step  # pure precisions: the masters rounded into the model
        if hook is not None:
            hook()
        micro = window.micro
        window.reset()
        self._steps += int(update_scale)  # an iteration ends with its scale update
        try:  # before the gradients go, so that a trigger can name the non-finite ones
            trigger = self._fallback.watch(
                found_inf,
                scale,
                self._steps,
                self._scaler if self.precision.needs_scaler else None,
                self._named_grads,
            )
        finally:
            if zero_grad:
                for opt in opts:
                    opt.zero_grad(set_to_none=True)
            if (end := self._policy.end_step) is not None:
                end()
        if trigger is not None:
            self._act(
                trigger
            )  # switches precision, or raises NumericsError (chain end, scale exhausted)
        self._manifest.after_step(self)  # every manifest_check_every steps: dtypes only, no sync
        result = StepResult(boundary=True, grad_norm=grad_norm, scale=scale, found_inf=found_inf)
        if self._stream.subscribers:
            loss, self._window_loss = self._window_loss, None
            if loss is not None and micro != window.size and flush and not self._normalized:
                loss = loss * (window.size / micro)  # the short window's mean, as the gradients
            if update_scale:  # an iteration of several steps (update_scale=False) is one record
                self._emit("step", {"loss": loss, "result": result}, record=False)
        return result

    # ------------------------------------------------------------------ diagnosis
    def diagnose(
        self,
        closure: Callable[[], torch.Tensor],
        *,
        scale: Optional[float] = None,
        localizer: Optional[Callable[..., NonFiniteReport]] = None,
    ) -> NonFiniteReport:
        """Name the first module that produces inf/NaN on ``closure``'s batch (see
        :func:`ampkit.step.localize.localize_nonfinite`, or pass another ``localizer``); records a
        ``diagnosis`` event and attaches the report to the next ``fallback`` event. ``scale``
        defaults to the current loss scale (fp16). Runs an extra forward and backward and
        **syncs**; gradients are left untouched.
        """
        self._require_setup("diagnose")
        if scale is None and self.precision.needs_scaler:
            scale = self._scaler.get_scale()
        assert self._model is not None
        report = (localizer or localize_nonfinite)(self._model, closure, scale=scale)
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

    # ------------------------------------------------------------------ the weights' form
    def fp8_report(self) -> list[dict[str, Any]]:
        """Each Linear of the model: converted to fp8 or skipped, with the reason (precision fp8)."""
        return list(self._policy.describe().get("modules", []))

    def manifest(self, *, read_scale: bool = True) -> Manifest:
        """Each parameter's dtypes and the loss scaling (:mod:`ampkit.step.manifest`); the scale **syncs**."""
        return build_manifest(self, read_scale=read_scale)

    def master_params(self) -> list[torch.Tensor]:
        """The fp32 master weights (pure precisions; empty otherwise). They live in the optimizer."""
        return self._policy.master_params()

    def full_precision_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict in fp32: for pure precisions the masters' values (what to export
        or evaluate); otherwise the model's own state dict (already fp32)."""
        self._require_setup("full_precision_state_dict")
        assert self._model is not None
        return self._policy.full_precision_state_dict(self._model)

    # ------------------------------------------------------------------ switching precision
    def switch(
        self,
        precision: Union[str, torch.dtype, Precision],
        *,
        reason: str = "requested",
        **rung: Any,
    ) -> Precision:
        """Change the precision between optimizer steps (e.g. fp16 -> bf16 after overflows).

        The old precision's policy releases the model (fp32 weights back, fp8 modules reverted),
        the new one prepares it; the fp32 weights and the optimizer state carry over unchanged.
        The loss scaler is rebuilt from the config when the new precision needs one and the old
        did not. Records a ``precision_switch`` event. Raises inside an accumulation window
        (gradients from the old precision would mix with the new one) and for precisions the
        device cannot run. ``masters=``/``state_dtype=`` move along bf16-pure's memory ladder (via fp32).
        """
        if rung:  # the ladder (step/policies/pure/ladder.py): released to fp32, then prepared on the new rung
            cfg = self.config.replace(**rung)  # validated before anything changes
            self._switch("fp32", "precision_switch", {"reason": reason})
            self.config = cfg.replace(precision=self.precision.name)
        return self._switch(precision, "precision_switch", {"reason": reason})

    def _switch(
        self, precision: Union[str, torch.dtype, Precision], kind: str, data: dict[str, Any]
    ) -> Precision:
        new, cfg, rungs = rung_move(
            self.config, self.precision.name, precision, self.device_info
        )  # or a rung
        if self._window.micro != 0:
            raise RuntimeError(
                f"switch() called inside an accumulation window ({self._window.micro} of "
                f"{self._window.current_size} micro-steps done); switch after step()"
            )
        old = self.precision
        if (
            new.name == old.name
        ):  # the same rung: nothing to do; another rung: via fp32, as switch(masters=...)
            if rungs.get("from_rung") == rungs.get("to_rung"):
                return old
            self._become(resolve_precision("fp32", self.device_info))
        self.config = cfg.replace(precision=new.name)
        self._become(new)
        self._fallback.reset()
        self._emit(kind, {"from": old.name, "to": new.name, **rungs, **data})
        return new

    def _become(
        self, new: Precision, scaler: Optional[LossScaler] = None, rerung: bool = False
    ) -> None:
        """Train in ``new`` from here on: the old policy releases, the new one prepares (between steps)."""
        if scaler is None and new.needs_scaler != self.precision.needs_scaler:
            scaler = self._make_scaler(new)
        if scaler is not None:
            count = (
                self._scaler.overflow_count
            )  # keep the replaced scaler's skips (a device add, no sync)
            if count is not None:
                self._skipped_before = (
                    count.clone() if self._skipped_before is None else self._skipped_before + count
                )
            self._scaler = scaler
        old, self.precision = self.precision, new
        if new.name == old.name and not rerung:
            return  # (a resume in the same precision and rung: the model keeps its form)
        self._policy.release()
        self._policy = policy_for(
            new, self.config, self.device, shards_params=self._parallel.shards_params
        )
        if self._model is not None:
            self._parallel.retarget(new)  # FSDP2: the all-gather/reduce dtypes follow the precision
            self._prepare(self._model)

    def set_fallback(self, fallback: Union[bool, str]) -> None:
        """Turn the fallback chain on (``True`` or ``"fp16,bf16,fp32"``) or off, between steps; validated first."""
        cfg = self.config.replace(fallback=fallback)
        self._fallback, self.config = make_fallback(cfg, self.precision.name, self.device_info), cfg

    def _act(self, trigger: Trigger) -> None:
        """Fall back to the chain's next precision, or raise :class:`NumericsError` (end of the chain;
        with the fallback off, the loss scale exhausted)."""
        name, diagnosis = self.precision.name, self._last_diagnosis
        if (
            trigger.reason == "recover"
        ):  # fallback_recover_after: N clean steps, retry the faster precision
            self._switch(trigger.target or name, "fallback_retry", recover_data(trigger))
            return
        if trigger.reason == "scale_exhausted":
            data, error = scale_exhausted(trigger, name, diagnosis)
            self._emit("scale_exhausted", data)
            raise error
        nxt = self._fallback.next_precision(name, self.config)
        if nxt is None:
            data, error = chain_exhausted(trigger, name, self._fallback.chain, diagnosis)
            self._emit("fallback_exhausted", data)
            raise error
        self._switch(nxt, "fallback", fallback_data(trigger, diagnosis))
        self._last_diagnosis = None

    def _named_grads(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Model parameters by name, each paired with the tensor the optimizer steps (its master)."""
        if self._model is not None:
            stepped = self._policy.stepped
            for name, p in self._model.named_parameters():
                yield name, stepped(p)

    # ------------------------------------------------------------------ reading and saving (these sync)
    @property
    def optimizer_steps(self) -> int:
        """Accumulation boundaries reached (optimizer steps attempted, skipped ones included)."""
        return self._steps

    def stats(self) -> dict[str, Any]:
        """Precision, scale, steps, skipped steps, overflow rate, events. **Syncs** (reads device counters)."""
        overflows = self._scaler.overflow_count
        skipped = (
            int(overflows.item()) if overflows is not None and self._scaler.is_enabled() else 0
        )
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
            "pending_micro_steps": self._window.micro,
            "parallel": self._parallel.name,
            "world_size": self._parallel.world_size,  # parallel: none / ddp / fsdp
            "events": [e.to_dict() for e in self._stream.kept],
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: precision (after switches), config, scaler, counters, events,
        the policy's state (the fp32 masters of a pure precision), an open accumulation window's
        gradients (:mod:`.window_state`). **Syncs**."""
        return {
            "precision": self.precision.name,
            "config": self.config.to_dict(),
            "scaler": self._scaler.state_dict(),
            "optimizer_steps": self._steps,
            "micro_steps": self._window.micro,
            "window": window_state(self),  # None between windows
            "skipped_before": int(self._skipped_before.item())
            if self._skipped_before is not None
            else 0,
            "events": [e.to_dict() for e in self._stream.kept],
            "masters": self._policy.state_dict() or None,
            "fallback": self._fallback.state_dict(),
            "manifest": self._manifest.saved(self),
            "diagnosis": d.to_dict() if (d := self._last_diagnosis) else None,  # pending
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from :meth:`state_dict`. Validates everything before changing anything."""
        if not isinstance(state, dict) or "precision" not in state or "config" not in state:
            raise ValueError(
                "not a MixedPrecision state dict: expected keys 'precision', 'config', 'scaler', ..."
            )
        cfg = MixedPrecisionConfig.from_dict(state["config"])
        diagnosis = NonFiniteReport.from_dict(state.get("diagnosis"))
        new = resolve_precision(state["precision"], self.device_info, emulate_fp8=cfg.fp8_emulate)
        (old_config, old_precision), self.config = (self.config, self.precision.name), cfg
        try:
            scaler = self._make_scaler(new)
            if state.get("scaler"):
                scaler.load_state_dict(state["scaler"])
            fallback = make_fallback(cfg, new.name, self.device_info)
        except Exception:
            self.config = old_config
            raise
        self._become(
            new, scaler, rerung=ladder_form(new.name, cfg) != ladder_form(new.name, old_config)
        )
        before = int(state.get("skipped_before", 0))
        self._skipped_before = torch.tensor(float(before), device=self.device) if before else None
        self._steps = int(state.get("optimizer_steps", 0))
        self._stream.kept = [Event.from_dict(e) for e in state.get("events", [])]
        self._fallback = fallback
        fallback.load_state_dict(state.get("fallback"))
        if state.get("masters"):
            self._policy.load_state_dict(state["masters"])
        restore_window(self, state, cfg.accumulation_steps)  # (on the masters just loaded)
        self._manifest.resumed(self, state.get("manifest"))  # diffs against the saved manifest
        self._last_diagnosis = diagnosis
        warn_replaced(old_config, cfg, (old_precision, new.name), "load_state_dict")

    # ------------------------------------------------------------------ internals
    def _require_setup(self, verb: str) -> None:
        if self._model is None:
            raise RuntimeError(
                f"{verb}() called before setup(); call model, optimizer = amp.setup(model, optimizer) first"
            )

    def __repr__(self) -> str:
        return (
            f"MixedPrecision(precision={self.precision.name!r}, device={str(self.device)!r}, "
            f"accumulation_steps={self.config.accumulation_steps})"
        )
