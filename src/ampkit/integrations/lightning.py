"""ampkit's engine as a Lightning precision plugin: ``Trainer(plugins=[AmpkitPrecision("bf16-pure")])``.

Every ampkit precision works, including the pure ones with fp32 masters (``bf16-pure`` is
Lightning's ``bf16-true`` with masters), loss scaling with ampkit's scaler, the fallback chain
and ``keep_fp32`` overrides; a skipped step (non-finite gradients) is not counted by the
step-interval learning-rate schedulers. How each Lightning verb maps onto the engine:

* ``connect`` (after ``configure_optimizers``): ``amp.setup(model, *optimizers)`` -- casts and
  masters for the pure precisions -- and the engine's window set to ``accumulate_grad_batches``;
  step-interval schedulers are wrapped so that they do not step after a skipped step.
* ``forward_context``: ``amp.autocast()``.
* ``backward``: ``amp.backward(loss, normalized=True)`` (Lightning already divided the loss by
  ``accumulate_grad_batches``).
* ``optimizer_step``: closure, unscale (fp16), Lightning's hooks and clipping on the unscaled
  gradients, then ``amp.step(optimizer, flush=True)``; returns None when the step was skipped.

``AmpkitFabricPrecision`` is the same for Fabric (``Fabric(plugins=[...])``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Generator
from typing import Any, Callable, Optional, Union

import torch

from ..loop.checkpoint import CheckpointError
from ..step.engine import MixedPrecision
from ..step.precision import Precision, precision_row
from .common import SkipAwareScheduler, make_engine, require, skipped, stepped_params

_pl = require("lightning.pytorch", "lightning", "ampkit.integrations.lightning")
_fabric_precision = require(
    "lightning.fabric.plugins.precision", "lightning", "ampkit.integrations.lightning"
)

__all__ = ["AmpkitFabricPrecision", "AmpkitPrecision"]


class _Engine:
    """The engine glue both plugins share: built lazily on the model's device, stepped with flush."""

    def _init_engine(
        self,
        precision: Union[str, torch.dtype, Precision, None],
        amp: Optional[MixedPrecision],
        device: Union[str, torch.device, None],
        overrides: dict[str, Any],
    ) -> None:
        if amp is not None or device is not None:
            self.amp: Optional[MixedPrecision] = make_engine(precision, amp, device, overrides)
            name = self.amp.precision.name
        else:
            self.amp = None  # built in connect/convert_module, on the model's device
            name = make_engine(
                precision, None, "cpu", overrides
            ).precision.name  # validates the name and settings now
        self._spec = (precision, overrides)
        self.last_step_skipped = False
        # Lightning's name for the same kind of training, for code that reads ``trainer.precision``
        self.precision = precision_row(name).lightning_name

    def _engine_for(self, model: torch.nn.Module) -> MixedPrecision:
        if self.amp is None:
            device = next((t.device for t in model.parameters()), torch.device("cpu"))
            self.amp = make_engine(self._spec[0], None, device, dict(self._spec[1]))
            self.precision = self.amp.precision.row.lightning_name
        return self.amp

    def _require(self) -> MixedPrecision:
        if self.amp is None:
            raise RuntimeError(
                "the ampkit precision plugin has no model yet: Lightning calls connect() "
                "(Trainer.fit) or convert_module() (Fabric.setup) first"
            )
        return self.amp

    def _step(self, optimizer: Any) -> Any:
        """The engine's boundary; returns its :class:`StepResult` (``last_step_skipped`` set)."""
        amp = self._require()
        raw = getattr(
            optimizer, "optimizer", optimizer
        )  # Lightning/Fabric wrap the torch optimizer
        if isinstance(raw, torch.optim.LBFGS):
            raise ValueError(
                "the ampkit precision plugin cannot step LBFGS (it re-evaluates a closure); "
                "use a first-order optimizer"
            )
        result = amp.step(raw, flush=True, zero_grad=False)  # Lightning/Fabric zero the gradients
        self.last_step_skipped = skipped(result)
        return result

    def _unscale(self, optimizer: Any) -> None:
        amp = self._require()
        if amp.precision.needs_scaler:
            amp.scaler.unscale_(getattr(optimizer, "optimizer", optimizer))

    @contextlib.contextmanager
    def _forward(self) -> Generator[None, None, None]:
        if self.amp is None:  # (e.g. a sanity check before any set-up)
            yield
            return
        with self.amp.autocast():
            yield

    def main_params(self, optimizer: Any) -> Any:
        return [p for g in optimizer.param_groups for p in g["params"]]

    def state_dict(self) -> dict[str, Any]:
        return self.amp.state_dict() if self.amp is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if state_dict:
            self._require().load_state_dict(state_dict)


class AmpkitPrecision(_Engine, _pl.plugins.precision.Precision):
    """A ``lightning.pytorch`` precision plugin that trains through :class:`ampkit.MixedPrecision`.

    Args:
        precision: any ampkit precision or alias (``"bf16"``, ``"fp16"``, ``"bf16-pure"``,
            ``"bf16-true"``, ``"fp8"``, ...).
        amp: an engine already configured (instead of ``precision`` and ``settings``).
        device: where the engine runs (default: the model's device when Lightning connects it).
        diagnose: on the run's first skipped step, re-run that step's batch through
            ``training_step`` with :meth:`ampkit.MixedPrecision.diagnose` to name the module that
            produced the inf/NaN (a ``diagnosis`` event, attached to the next ``fallback``), as
            ampkit's own Trainer does. An extra forward and backward, once.
        settings: :class:`ampkit.MixedPrecisionConfig` fields (``fallback=True``,
            ``keep_fp32=...``, ``init_scale=...``); ``accumulation_steps`` comes from the Trainer.

    ``last_step_skipped`` says whether the last optimizer step was skipped; ``amp.stats()`` and
    ``amp.events`` hold the engine's counters and events. Clipping (``gradient_clip_val``) runs on
    unscaled gradients (the fp32 masters' for the pure precisions). Lightning's
    ``LightningModule.backward`` override is not called: the engine runs the backward.
    """

    def __init__(
        self,
        precision: Union[str, torch.dtype, Precision, None] = None,
        *,
        amp: Optional[MixedPrecision] = None,
        device: Union[str, torch.device, None] = None,
        diagnose: bool = True,
        **settings: Any,
    ) -> None:
        self._init_engine(precision, amp, device, settings)
        self.diagnose = diagnose
        self.diagnosis: Any = None  # the NonFiniteReport of the first skipped step
        self._batch: Any = None
        self._fitting: Any = None  # the Trainer that connected the plugin (connect: fit only)

    def convert_input(self, data: Any) -> Any:
        self._batch = data  # (Lightning passes every training batch here: kept for a diagnosis)
        return data

    def connect(
        self, model: Any, optimizers: list[Any], lr_schedulers: list[Any]
    ) -> tuple[Any, list[Any], list[Any]]:
        amp = self._engine_for(model)
        trainer = getattr(model, "_trainer", None)
        self._fitting = trainer
        accumulate = getattr(trainer, "accumulate_grad_batches", 1) or 1
        if accumulate != amp.config.accumulation_steps:
            amp.set_accumulation_steps(accumulate)
        amp.setup(model, *optimizers)
        for config in lr_schedulers:
            if (
                config.interval == "step"
                and not config.reduce_on_plateau
                and not isinstance(config.scheduler, SkipAwareScheduler)
            ):
                config.scheduler = SkipAwareScheduler(
                    config.scheduler, lambda: self.last_step_skipped
                )
        return model, optimizers, lr_schedulers

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """A fit resumed from a checkpoint without this plugin's entry would go on with a fresh
        engine (counters restarted, a pure precision's masters rebuilt from the half weights), not
        the run that was saved: refused. Validating or testing from it needs no engine state."""
        key = type(self).__qualname__  # (the entry Lightning saves the plugin's state_dict under)
        fitting = self._fitting is not None and self._fitting.state.fn == "fit"
        if fitting and key not in checkpoint:
            why = (
                "it holds weights only (ModelCheckpoint(save_weights_only=True): no optimizer or "
                "engine state)"
                if "optimizer_states" not in checkpoint
                else "it was written with another precision plugin, or lost it"
            )
            raise CheckpointError(
                f"the checkpoint has no {key!r} entry (the ampkit engine's state: the precision "
                "after fallbacks, the loss scale, the step counters and, for the pure precisions, "
                f"the fp32 master weights): {why}. Resuming the fit would go on with a fresh "
                "engine, not the run that was saved, so nothing was resumed; resume it with the "
                "precision that wrote it, or load its weights (load_from_checkpoint) and start a "
                "new fit"
            )

    def forward_context(self) -> Any:
        return self._forward()

    def backward(
        self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any
    ) -> None:
        if args:
            raise TypeError(
                f"the ampkit precision plugin passes keyword arguments only to backward, got {args!r}"
            )
        self._require().backward(tensor, normalized=True, **kwargs)

    def optimizer_step(
        self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any
    ) -> Any:
        """Run the closure (forward and backward), unscale (fp16) so that Lightning's
        ``on_before_optimizer_step`` and clipping see true gradients, then the engine's step.
        Returns the closure's loss, or None when the step was skipped (non-finite gradients)."""
        if kwargs:
            raise TypeError(
                f"the ampkit precision plugin takes no optimizer.step() arguments, got {sorted(kwargs)}"
            )
        closure_result = closure()
        if closure_result is None and getattr(model, "automatic_optimization", True):
            self.last_step_skipped = False  # training_step returned None: nothing to step
            return None
        self._unscale(optimizer)
        self._after_closure(model, optimizer)
        result = self._step(optimizer)
        if (
            self.last_step_skipped
            and self.diagnose
            and self.diagnosis is None
            and self._batch is not None
        ):
            self._diagnose(model, result)
        return None if self.last_step_skipped else closure_result

    def _diagnose(self, model: Any, result: Any) -> None:
        batch, index, amp = (
            self._batch,
            model.trainer.fit_loop.epoch_loop.batch_idx,
            self._require(),
        )

        def loss() -> torch.Tensor:
            with amp.autocast():
                out = model.training_step(batch, index)
            return out["loss"] if isinstance(out, dict) else out

        scale = (
            float(result.scale) if result.scale is not None else None
        )  # the skipped step's scale
        self.diagnosis = amp.diagnose(loss, scale=scale)

    def clip_grad_by_norm(self, optimizer: Any, clip_val: Union[int, float]) -> None:
        model = self._require().model
        params = (
            stepped_params(self.amp, model) if model is not None else self.main_params(optimizer)
        )
        torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], clip_val)

    def teardown(self) -> None:
        """Leave the engine's model as it is (the pure precisions keep their half weights)."""


class AmpkitFabricPrecision(_Engine, _fabric_precision.Precision):
    """The same engine as a Fabric precision plugin: ``Fabric(plugins=[AmpkitFabricPrecision("bf16")])``.

    Fabric gives the plugin the model but not the optimizers: for the pure precisions, call
    ``plugin.amp.setup(model, optimizer)`` (with a ``device=``-given plugin) before
    ``fabric.setup(model, optimizer)``. ``fabric.backward(loss)`` takes the loss as you
    normalise it; up to ``accumulation_steps`` backward calls may precede each ``optimizer.step()``.
    ``optimizer.step()`` returns None and ``last_step_skipped`` is True when it was skipped.
    """

    def __init__(
        self,
        precision: Union[str, torch.dtype, Precision, None] = None,
        *,
        amp: Optional[MixedPrecision] = None,
        device: Union[str, torch.device, None] = None,
        **settings: Any,
    ) -> None:
        self._init_engine(precision, amp, device, settings)

    def convert_module(self, module: torch.nn.Module) -> torch.nn.Module:
        amp = self._engine_for(module)
        if amp.model is not module:
            amp.setup(module)
        return module

    def forward_context(self) -> Any:
        return self._forward()

    def backward(
        self, tensor: torch.Tensor, model: Optional[torch.nn.Module], *args: Any, **kwargs: Any
    ) -> None:
        if args:
            raise TypeError(
                f"the ampkit precision plugin passes keyword arguments only to backward, got {args!r}"
            )
        self._require().backward(tensor, normalized=True, **kwargs)

    def _register(self, optimizer: Any) -> None:
        """Fabric never shows the plugin an optimizer before its first step: set it up then."""
        amp, raw = self._require(), getattr(optimizer, "optimizer", optimizer)
        if any(o is raw for o in amp.optimizers):
            return
        if amp.policy.keeps_masters:
            raise RuntimeError(
                f"precision {amp.precision.name} keeps fp32 masters in the optimizer: call "
                "plugin.amp.setup(model, optimizer) before fabric.setup(model, optimizer)"
            )
        assert amp.model is not None
        amp.setup(
            amp.model, *amp.optimizers, raw
        )  # (no casts for these precisions: gradients untouched)

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise TypeError(
                f"the ampkit precision plugin takes no optimizer.step() arguments, got {sorted(kwargs)}"
            )
        self._register(optimizer)
        self._step(optimizer)
        return None

    def unscale_gradients(self, optimizer: Any) -> None:
        self._register(optimizer)
        self._unscale(optimizer)
