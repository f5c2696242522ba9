"""Name the first module whose forward or backward produced inf/NaN (one-off, **syncs**)."""

from __future__ import annotations

import copy
import warnings
from dataclasses import asdict, dataclass, fields
from typing import Any, Callable, Optional

import torch

from .overrides import to_fp32

__all__ = [
    "FP16_MAX",
    "FP16_TINY",
    "NonFiniteReport",
    "float_tensors",
    "localize_nonfinite",
    "nonfinite",
]

FP16_MAX = torch.finfo(torch.float16).max
FP16_TINY = 2.0**-24  # smallest fp16 subnormal: smaller magnitudes flush to zero


# ---------------------------------------------------------------------------- helpers


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    if isinstance(obj, dict):
        return [t for o in obj.values() for t in _tensors(o)]
    return []


def float_tensors(obj: Any) -> list[torch.Tensor]:
    return [t for t in _tensors(obj) if t.is_floating_point()]


def nonfinite(obj: Any) -> bool:
    return any(not bool(torch.isfinite(t).all()) for t in float_tensors(obj))


def _max_finite(obj: Any) -> Optional[float]:
    best = None
    for t in float_tensors(obj):
        t = t.detach()
        finite = t[torch.isfinite(t)]
        if finite.numel():
            v = float(finite.abs().max())
            best = v if best is None else max(best, v)
    return best


def _dtype(obj: Any) -> Optional[str]:
    ts = float_tensors(obj)
    return str(ts[0].dtype).replace("torch.", "") if ts else None


# ---------------------------------------------------------------------------- localization


@dataclass(frozen=True)
class NonFiniteReport:
    """The first module whose output (forward) or input gradient (backward) was non-finite.

    ``found`` is False when every output and gradient stayed finite (the problem is elsewhere,
    e.g. the loss computation or the data). ``fp32_finite`` says whether the same module on the
    same inputs (and, for backward, the same output gradient) in fp32 stays finite: True means
    precision is the cause, and keeping that module in fp32 (``keep_fp32``) or a lower loss scale
    will fix it.
    """

    found: bool
    module: Optional[str] = None
    module_type: Optional[str] = None
    phase: Optional[str] = (
        None  # "forward", "backward" (its input gradient), "backward-output" (arrived non-finite)
    )
    dtype: Optional[str] = None
    input_max: Optional[float] = None
    output_max: Optional[float] = None
    fp32_finite: Optional[bool] = None
    loss_finite: Optional[bool] = None
    scale: Optional[float] = None
    message: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, saved: Any) -> Optional[NonFiniteReport]:
        """A report back from :meth:`to_dict` (None stays None: nothing pending); anything else is
        refused, naming the keys a report has."""
        if saved is None:
            return None
        names = {f.name for f in fields(cls)}
        if not isinstance(saved, dict) or "found" not in saved or not set(saved) <= names:
            raise ValueError(
                f"not a diagnosis report: expected a dict with keys from {sorted(names)} "
                f"('found' required), got {saved!r:.200}"
            )
        return cls(**saved)

    def __str__(self) -> str:
        return self.message


def localize_nonfinite(
    model: torch.nn.Module,
    closure: Callable[[], torch.Tensor],
    *,
    scale: Optional[float] = None,
) -> NonFiniteReport:
    """Re-run one forward + backward with hooks on every module; name the first non-finite one.

    ``closure()`` must run the forward on the failing batch and return the scalar loss (run it
    under the autocast you train with, e.g. ``with amp.autocast(): return model(x, y)``).
    ``scale`` multiplies the loss before backward, as the loss scaler does (an fp16 gradient
    overflow only reproduces at the scale that caused it). The model's existing ``.grad``s are
    restored afterwards, and every hook is removed, also when the closure raises. The random
    generators (CPU, and the CUDA devices of the model) and the module buffers (BatchNorm's running
    statistics) are left as they were: a diagnosis changes nothing training reads next, whether
    and whenever it runs. Synchronizes.
    """
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with torch.random.fork_rng(devices=cuda):
            return _localize(model, closure, scale)
    finally:
        with torch.no_grad():
            for b, kept in buffers:
                b.copy_(kept)


def _localize(
    model: torch.nn.Module, closure: Callable[[], torch.Tensor], scale: Optional[float]
) -> NonFiniteReport:
    saved_grads = {p: p.grad for p in model.parameters()}
    for p in saved_grads:
        p.grad = None
    names = {m: n or "(root)" for n, m in model.named_modules()}
    inputs: dict[torch.nn.Module, Any] = {}
    fwd: list[tuple[torch.nn.Module, Any, Any]] = []
    bwd: list[tuple[torch.nn.Module, Any, Any]] = []
    handles = []

    def pre(m: torch.nn.Module, args: tuple) -> None:
        inputs.setdefault(m, args)

    def post(m: torch.nn.Module, args: tuple, out: Any) -> None:
        if not fwd and nonfinite(out):
            fwd.append((m, args, out))

    def back(m: torch.nn.Module, grad_in: Any, grad_out: Any) -> None:
        if not bwd and (nonfinite(grad_in) or nonfinite(grad_out)):
            bwd.append((m, grad_in, grad_out))

    try:
        for m in names:
            handles.append(m.register_forward_pre_hook(pre))
            handles.append(m.register_forward_hook(post))
            if m is not model:
                handles.append(m.register_full_backward_hook(back))
        loss = closure()
        if not isinstance(loss, torch.Tensor) or not loss.is_floating_point() or loss.numel() != 1:
            raise ValueError(
                f"the closure must return a scalar floating-point loss tensor, got "
                f"{type(loss).__name__}{'' if not isinstance(loss, torch.Tensor) else tuple(loss.shape)}"
            )
        if not loss.requires_grad:
            raise ValueError(
                "the closure's loss does not require grad: compute it from the model's outputs, "
                "outside torch.no_grad()"
            )
        loss_finite = bool(torch.isfinite(loss))
        if not fwd:
            with warnings.catch_warnings():
                # Modules fed integer inputs (embeddings) get output-only backward hooks; that is fine here.
                warnings.filterwarnings("ignore", message="Full backward hook is firing")
                (loss * scale if scale is not None else loss).backward()
    finally:
        for h in handles:
            h.remove()
        for p, g in saved_grads.items():
            p.grad = g

    rep = _findings(model, names, inputs, fwd, bwd, loss_finite, scale)
    return NonFiniteReport(**rep, message=_message(rep))


def _findings(
    model: torch.nn.Module,
    names: dict[torch.nn.Module, str],
    inputs: dict[torch.nn.Module, Any],
    fwd: list[tuple[torch.nn.Module, Any, Any]],
    bwd: list[tuple[torch.nn.Module, Any, Any]],
    loss_finite: bool,
    scale: Optional[float],
) -> dict[str, Any]:
    """The report's fields from the first non-finite forward output or backward gradient."""
    if fwd:
        m, args, out = fwd[0]
        ref = None if isinstance(m, torch.nn.ModuleList) else _forward_fp32(m, args)
        fp32_ok = ref is not None and not nonfinite(ref)
        rep = dict(
            found=True,
            module=names[m],
            module_type=type(m).__name__,
            phase="forward",
            dtype=_dtype(out),
            input_max=_max_finite(args),
            output_max=_max_finite(out),
            fp32_finite=fp32_ok,
            loss_finite=loss_finite,
            scale=scale,
        )
    elif bwd:
        m, grad_in, grad_out = bwd[0]
        if nonfinite(grad_out):
            # The gradient was already non-finite on arrival: it overflowed between this module's
            # output and the loss, typically when an fp32 gradient was cast to the module's half
            # output dtype. In fp32 that cast does not exist.
            rep = dict(
                found=True,
                module=names[m],
                module_type=type(m).__name__,
                phase="backward-output",
                dtype=_dtype(grad_out),
                input_max=None,
                output_max=_max_finite(grad_in),
                fp32_finite=_dtype(grad_out) in ("float16", "bfloat16") or None,
                loss_finite=loss_finite,
                scale=scale,
            )
        else:
            fp32_ok = _backward_fp32_finite(m, inputs.get(m), grad_out)
            rep = dict(
                found=True,
                module=names[m],
                module_type=type(m).__name__,
                phase="backward",
                dtype=_dtype(grad_in),
                input_max=_max_finite(grad_out),
                output_max=_max_finite(grad_in),
                fp32_finite=fp32_ok,
                loss_finite=loss_finite,
                scale=scale,
            )
    else:
        rep = dict(found=False, loss_finite=loss_finite, scale=scale)
    return rep


def _device_type(model: torch.nn.Module) -> str:
    p = next(model.parameters(), None)
    return p.device.type if p is not None else "cpu"


def _forward_fp32(m: torch.nn.Module, args: Any) -> Any:
    """The module's output in fp32: on an fp32 copy when its parameters are half (pure precisions);
    None when it cannot run so."""
    half = any(p.dtype != torch.float32 for p in m.parameters() if p.is_floating_point())
    try:
        with torch.no_grad(), torch.autocast(_device_type(model=m), enabled=False):
            return (copy.deepcopy(m).float() if half else m)(*to_fp32(args))
    except (RuntimeError, TypeError):
        return None


def _backward_fp32_finite(m: torch.nn.Module, args: Any, grad_out: Any) -> Optional[bool]:
    """Re-run the module's forward and backward in fp32 with the same output gradient."""
    if args is None:
        return None
    try:
        xs = [
            a.detach().float().requires_grad_(True)
            if isinstance(a, torch.Tensor) and a.is_floating_point()
            else a
            for a in args
        ]
        with (
            torch.enable_grad(),
            torch.autocast(_device_type(m) if list(m.parameters()) else "cpu", enabled=False),
        ):
            ref = copy.deepcopy(m).float()
            out = ref(*xs)
            outs = float_tensors(out)
            gouts = [g.detach().float() for g in float_tensors(grad_out)]
            if len(outs) != len(gouts):
                return None
            targets = [x for x in xs if isinstance(x, torch.Tensor) and x.requires_grad] + list(
                ref.parameters()
            )
            grads = torch.autograd.grad(outs, targets, gouts, allow_unused=True)
        return not nonfinite([g for g in grads if g is not None])
    except Exception:  # a module whose backward cannot be replayed alone: say we don't know
        return None


def _message(r: dict[str, Any]) -> str:
    if not r["found"]:
        return "no module produced a non-finite output or gradient" + (
            ""
            if r["loss_finite"]
            else "; the loss itself is non-finite (check the loss function and the data)"
        )
    where = f"{r['module']} ({r['module_type']})"
    if r["phase"] == "forward":
        msg = (
            f"first non-finite value in the forward output of {where}, dtype {r['dtype']}; "
            f"largest finite input magnitude {r['input_max']:.3g}"
            if r["input_max"] is not None
            else f"first non-finite value in the forward output of {where}, dtype {r['dtype']}"
        )
    elif r["phase"] == "backward-output":
        msg = (
            f"the gradient reaching the output of {where} is already non-finite ({r['dtype']}): it overflowed "
            f"between that output and the loss, typically in the cast of an fp32 gradient to {r['dtype']}"
        )
        if r.get("scale"):
            msg += f" at loss scale {r['scale']:g}"
    else:
        msg = (
            f"first non-finite gradient flows out of {where} in backward (dtype {r['dtype']}); "
            f"largest finite incoming gradient {r['input_max']:.3g}"
            if r["input_max"] is not None
            else f"first non-finite gradient flows out of {where} in backward (dtype {r['dtype']})"
        )
        if r.get("scale"):
            msg += f" at loss scale {r['scale']:g}"
    if r["fp32_finite"]:
        msg += (
            f"; in fp32 the same module stays finite: keep it in fp32 (keep_fp32=['{r['module']}'])"
        )
        if r["phase"] != "forward":
            msg += " or lower the loss scale"
    elif r["fp32_finite"] is False:
        msg += "; it is non-finite in fp32 too: the problem is not precision (check inputs, learning rate, init)"
    return msg
