"""Hugging Face ``transformers.Trainer`` through ampkit's engine, and a callback for ampkit's figures.

``AmpkitTrainer(model, args, ..., amp=MixedPrecision("bf16"))`` is a ``Trainer`` whose step runs
through :class:`ampkit.MixedPrecision`: the forward (and loss) under ``amp.autocast()``, the
backward through ``amp.backward`` (loss scaling for fp16, half gradients into fp32 masters for
the pure precisions), clipping on unscaled gradients, and the optimizer step by ``amp.step``
(skipped on non-finite gradients, the fallback chain, ...). A skipped step does not step the
learning-rate scheduler. Leave ``args.bf16``/``args.fp16`` off: the precision is ``amp``'s.

Where Hugging Face and ampkit both do the same thing the parameters are bitwise equal: ``bf16``
here equals ``TrainingArguments(bf16=True)`` with gradient accumulation and ``max_grad_norm``.
Unlike ``TrainingArguments(fp16=True, use_cpu=True)`` (which trains in fp32), ``fp16`` really
trains in fp16 with loss scaling on a CPU.

``AmpkitCallback(amp, sinks=[...])`` adds the engine's figures (scale, skipped steps) to the
Trainer's logs and writes ampkit's step records to ampkit sinks (JSONL, TensorBoard, MLflow, W&B).
"""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Sequence
from typing import Any, Optional

import torch

from ..loop.checkpoint import CheckpointError, save_checkpoint, torch_reason
from ..loop.digest import check_digest
from ..observe.monitor import Monitor
from ..step.engine import MixedPrecision
from .common import SkipAwareScheduler, require, skipped, stepped_params

_tf = require("transformers", "hf", "ampkit.integrations.hf")

__all__ = ["AMP_STATE", "AmpkitCallback", "AmpkitOptimizer", "AmpkitTrainer"]

#: the engine's state in a Hugging Face checkpoint directory
AMP_STATE = "ampkit_amp.pt"


class AmpkitOptimizer:
    """The Trainer's optimizer: ``step()`` is ``amp.step(optimizer, flush=True)``; the rest (param
    groups, state, ``state_dict``) is the wrapped torch optimizer's."""

    def __init__(self, optimizer: torch.optim.Optimizer, trainer: AmpkitTrainer) -> None:
        self.optimizer = optimizer
        self._trainer = trainer

    def step(self, closure: Any = None) -> None:
        if closure is not None:
            raise ValueError("AmpkitTrainer's optimizer step takes no closure")
        trainer = self._trainer
        result = trainer.amp.step(
            self.optimizer, flush=True
        )  # flush: the epoch's last window may be short
        trainer.last_step_skipped = skipped(result)
        trainer.unscaled = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name: str) -> Any:  # only reached for names this class does not define
        return getattr(self.__dict__["optimizer"], name)


class AmpkitTrainer(_tf.Trainer):
    """A ``transformers.Trainer`` whose training step runs through ``amp`` (keyword-only).

    ``amp.setup(model, optimizer)`` runs when the Trainer creates its optimizer;
    ``accumulation_steps`` is taken from ``args.gradient_accumulation_steps``. The loss reaches
    ``amp.backward`` as Hugging Face normalises it (over the window's items, or divided by the
    accumulation steps), hence ``normalized=True``. ``last_step_skipped`` says whether the last
    optimizer step was skipped.
    """

    def __init__(self, *args: Any, amp: MixedPrecision, **kwargs: Any) -> None:
        if not isinstance(amp, MixedPrecision):
            raise TypeError(f"amp must be an ampkit.MixedPrecision, got {type(amp).__name__}")
        self.amp = amp
        self.last_step_skipped = False
        self.unscaled = False  # unscale_ ran since the last step (LossScaler allows one per step)
        super().__init__(*args, **kwargs)
        if self.args.bf16 or self.args.fp16:
            raise ValueError(
                f"AmpkitTrainer got TrainingArguments(bf16={self.args.bf16}, fp16={self.args.fp16}): "
                f"the precision is amp's ({amp.precision.name}); leave bf16 and fp16 off"
            )
        accumulate = self.args.gradient_accumulation_steps
        if amp.config.accumulation_steps != accumulate:
            amp.set_accumulation_steps(accumulate)

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        # Trainer.training_step ends in ``self.accelerator.backward(loss)``: sending that one call to
        # the engine keeps the rest of Hugging Face's step (loss normalisation, logging) as it is.
        self.accelerator.backward = self._backward

    def _backward(self, loss: torch.Tensor, **kwargs: Any) -> None:
        steps = self.accelerator.gradient_accumulation_steps
        if steps != 1:  # (as Accelerator.backward; the Trainer sets it to 1)
            loss = loss / steps
        self.amp.backward(loss, normalized=True, **kwargs)

    def compute_loss_context_manager(self) -> contextlib.ExitStack:
        stack = super().compute_loss_context_manager()
        stack.enter_context(self.amp.autocast())
        return stack

    def create_optimizer(self, model: Any = None) -> Any:
        super().create_optimizer(model) if model is not None else super().create_optimizer()
        if not isinstance(self.optimizer, AmpkitOptimizer):
            raw = self.optimizer
            self.amp.setup(
                self.model, raw
            )  # the pure precisions: half weights, fp32 masters in raw
            self.optimizer = AmpkitOptimizer(raw, self)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        if optimizer is None or isinstance(optimizer, AmpkitOptimizer):
            opt = optimizer or self.optimizer
            optimizer = opt.optimizer if isinstance(opt, AmpkitOptimizer) else opt
        sched = super().create_scheduler(num_training_steps, optimizer=optimizer)
        if not isinstance(sched, (SkipAwareScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)):
            self.lr_scheduler = SkipAwareScheduler(sched, lambda: self.last_step_skipped)
        return self.lr_scheduler

    # Hugging Face saves and restores its GradScaler through these two hooks; the engine's state
    # (precision after fallbacks, scale, counters, events, the masters of a pure precision) takes
    # its place, so that a resumed run goes on with the scale it had. It is written as ampkit's
    # checkpoints are (atomically, its SHA-256 beside it) and checked before it is loaded: a
    # damaged file is a CheckpointError naming it, never wrong masters. (A file of the old form,
    # a bare torch.save without a digest, loads unverified, unless the engine states of the
    # checkpoint-N directories beside it have their digests.) A checkpoint that holds the
    # optimizer's state but no engine state is refused: resuming it would go on with a fresh
    # engine (counters restarted, the masters rebuilt from the half weights), not the saved run.
    def _save_scaler(self, output_dir: str) -> None:
        save_checkpoint(self.amp.state_dict(), os.path.join(output_dir, AMP_STATE))

    def _load_scaler(self, checkpoint: Optional[str]) -> None:
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, AMP_STATE)
        if not os.path.isfile(path):
            _no_engine_state(checkpoint)
            return
        damage = check_digest(path, peers=_peers(checkpoint))
        if damage is not None:
            raise CheckpointError(f"checkpoint {path!r} {damage}; it was not loaded")
        try:
            state = torch.load(path, map_location=self.amp.device, weights_only=True)
            state.pop("ampkit_checkpoint", None)  # save_checkpoint's marker
            self.amp.load_state_dict(state)
        except Warning:  # (warnings raised as errors: the state was read; not a corrupt file)
            raise
        except Exception as e:  # noqa: BLE001 - unverified bytes: whatever they break, name the file
            raise CheckpointError(
                f"checkpoint {path!r} is corrupt or not an ampkit engine state and was not loaded "
                f"({type(e).__name__}: {torch_reason(e)})"
            ) from None

    def _unscale(self) -> None:
        if self.amp.precision.needs_scaler and not self.unscaled:
            for opt in self.amp.optimizers:
                self.amp.scaler.unscale_(opt)
            self.unscaled = True

    def _clip_grad_norm(self, model: Any) -> torch.Tensor:
        """Clip the unscaled gradients (the fp32 masters' for the pure precisions), model order."""
        self._unscale()
        params = [p for p in stepped_params(self.amp, self.model) if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, self.args.max_grad_norm)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        if grad_norm is None:  # no clipping: the norm of the unscaled gradients, for the logs
            self._unscale()
            grads = [p.grad for p in stepped_params(self.amp, self.model) if p.grad is not None]
            grad_norm = torch.nn.utils.get_total_norm(grads)
        return super()._get_grad_norm(model, grad_norm=grad_norm)


def _peers(checkpoint: str) -> list[str]:
    """The engine states of the ``checkpoint-N`` directories beside ``checkpoint``."""
    parent = os.path.dirname(os.path.abspath(checkpoint))
    own = os.path.basename(os.path.abspath(checkpoint))
    try:
        names = sorted(os.listdir(parent))
    except OSError:
        return []
    return [
        os.path.join(parent, n, AMP_STATE)
        for n in names
        if n != own and os.path.isdir(os.path.join(parent, n))
    ]


def _no_engine_state(checkpoint: str) -> None:
    """A checkpoint without ``ampkit_amp.pt``: refused when it holds the training state that
    Hugging Face resumes (the optimizer's, the scheduler's, the RNG's: the engine's belongs with
    them); a model-only checkpoint (``save_only_model``) goes on with a fresh engine, said."""
    try:
        names = os.listdir(checkpoint)
    except OSError:
        names = []
    if any(n.startswith(("optimizer", "scheduler", "rng_state")) for n in names):
        raise CheckpointError(
            f"checkpoint {checkpoint!r} has no {AMP_STATE} (the ampkit engine's state: the "
            "precision after fallbacks, the loss scale, the step counters and, for the pure "
            "precisions, the fp32 master weights) although it holds the optimizer's: it lost the "
            "file, or was written without ampkit. Resuming it would go on with a fresh engine, "
            "not the run that was saved, so nothing was resumed; resume from a checkpoint-N that "
            "has it, or load its weights (from_pretrained) and start a new run"
        )
    warnings.warn(
        f"checkpoint {checkpoint!r} holds no training state (saved with save_only_model?): the "
        f"optimizer and ampkit's engine ({AMP_STATE}) start fresh",
        stacklevel=3,
    )


class AmpkitCallback(_tf.TrainerCallback):
    """ampkit's figures in a Hugging Face run (any ``Trainer`` whose steps go through ``amp``).

    * ``on_log``: adds ``amp_scale``, ``amp_skipped_steps``, ``amp_precision`` and
      ``amp_overflow_rate`` to the logs Hugging Face reports (syncs, at logging steps only);
    * with ``sinks``: a :class:`ampkit.Monitor` on ``amp`` from ``on_train_begin`` to
      ``on_train_end`` writes ampkit's step records and events to them (``log_every`` steps a batch);
    * ``events``: the engine's notable events (fallbacks, precision switches) seen so far.
    """

    def __init__(
        self, amp: MixedPrecision, sinks: Sequence[Any] = (), *, log_every: int = 10
    ) -> None:
        if not isinstance(amp, MixedPrecision):
            raise TypeError(f"amp must be an ampkit.MixedPrecision, got {type(amp).__name__}")
        self.amp, self.sinks, self.log_every = amp, list(sinks), log_every
        self.monitor: Optional[Monitor] = None
        self.summary: Optional[dict[str, Any]] = None

    @property
    def events(self) -> list[dict[str, Any]]:
        return [e.to_dict() for e in self.amp.events]

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.sinks and self.monitor is None:
            self.monitor = Monitor(self.amp, self.sinks, log_every=self.log_every)

    def on_log(
        self,
        args: Any,
        state: Any,
        control: Any,
        logs: Optional[dict[str, Any]] = None,
        **kwargs: Any,
    ) -> None:
        if logs is None:
            return
        stats = self.amp.stats()
        logs["amp_precision"] = stats["precision"]
        logs["amp_skipped_steps"] = stats["skipped_steps"]
        logs["amp_overflow_rate"] = stats["overflow_rate"]
        if stats["scale"] is not None:
            logs["amp_scale"] = stats["scale"]

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.monitor is not None:
            self.summary = self.monitor.close()
            self.monitor = None
