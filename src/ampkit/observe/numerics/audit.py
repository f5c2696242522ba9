"""Per-module precision audit against an fp64/fp32 reference (one-off, **syncs**)."""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Optional, Union

import torch

from ...step.localize import FP16_MAX, FP16_TINY, float_tensors, nonfinite
from ...step.overrides import apply_fp32_overrides
from ...step.precision import Precision, resolve_precision

__all__ = ["SENSITIVE", "AuditReport", "ModuleAudit", "audit"]


# ---------------------------------------------------------------------------- audit

SENSITIVE: dict[type, str] = {
    torch.nn.modules.batchnorm._BatchNorm: "BatchNorm running statistics lose precision in half-precision weights; "
    "keep BatchNorm in fp32 (autocast already computes it in fp32)",
    torch.nn.Softmax: "softmax is a large reduction: autocast runs it in fp32, but in pure half weights or outside "
    "autocast it runs in half; keep it in fp32",
    torch.nn.LogSoftmax: "log-softmax is a large reduction: run it in fp32 (autocast does; pure half weights do not)",
    torch.nn.LayerNorm: "LayerNorm's mean/variance reductions need fp32: autocast keeps them fp32, "
    "pure half weights do not",
    torch.nn.GroupNorm: "GroupNorm's reductions need fp32: autocast keeps them fp32, pure half weights do not",
    torch.nn.modules.loss._Loss: "a loss computed on half logits loses precision: compute it on logits.float() "
    "(autocast does this for cross_entropy and friends)",
}


@dataclass(frozen=True)
class ModuleAudit:
    """One module's numerics under the audited precision, against a high-precision reference."""

    name: str
    type: str
    output_dtype: Optional[str]
    rel_error: Optional[float]
    max_abs: Optional[float]
    headroom_bits: Optional[float]  # log2(dtype max / largest output magnitude); < 0 means overflow
    nonfinite: bool
    grad_underflow_scale1: Optional[
        float
    ]  # share of non-zero fp32 grads that flush to zero in fp16 at scale 1
    grad_underflow_recommended: Optional[float]  # the same at the recommended init_scale
    keep_fp32: bool
    reasons: tuple[str, ...] = ()
    note: str = ""


@dataclass(frozen=True)
class AuditReport:
    """Per-module audit, ranked (worst first), with recommendations."""

    precision: str
    reference_dtype: str
    modules: list[ModuleAudit]
    recommended_keep_fp32: list[str]
    recommended_init_scale: Optional[float]
    max_grad: Optional[float]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["modules"] = [asdict(m) for m in self.modules]
        return d

    def table(self, limit: int = 30) -> Any:
        from rich.table import Table

        t = Table(title=f"numerics audit: {self.precision} vs {self.reference_dtype} reference")
        t.add_column("module", no_wrap=True)
        t.add_column("type", no_wrap=True)
        for col in ("rel err", "headroom bits", "underflow @1", "@rec", "fp32?", "why / note"):
            t.add_column(col, overflow="fold")
        for m in self.modules[:limit]:
            t.add_row(
                m.name,
                m.type,
                _g(m.rel_error),
                _g(m.headroom_bits),
                _pct(m.grad_underflow_scale1),
                _pct(m.grad_underflow_recommended),
                "[bold red]yes[/]" if m.keep_fp32 else "",
                "; ".join(m.reasons) or m.note,
            )
        return t


def _g(v: Optional[float]) -> str:
    return "—" if v is None else f"{v:.3g}"


def _pct(v: Optional[float]) -> str:
    return "—" if v is None else f"{100 * v:.1f}%"


def _first_outputs(
    model: torch.nn.Module, call: Callable[[], Any]
) -> tuple[dict[str, Any], Any, dict[str, bool]]:
    """First-call outputs of every named module, and whether each module's inputs were finite."""
    outs: dict[str, Any] = {}
    finite_in: dict[str, bool] = {}
    handles = []
    for name, m in model.named_modules():
        if not name:
            continue

        def pre(mod: torch.nn.Module, args: Any, _n: str = name) -> None:
            if _n not in finite_in:
                finite_in[_n] = not nonfinite(args)

        def hook(mod: torch.nn.Module, args: Any, out: Any, _n: str = name) -> None:
            if _n not in outs:
                outs[_n] = tuple(t.detach() for t in float_tensors(out))

        handles.append(m.register_forward_pre_hook(pre))
        handles.append(m.register_forward_hook(hook))
    try:
        result = call()
    finally:
        for h in handles:
            h.remove()
    return outs, result, finite_in


def _default_loss(out: Any) -> torch.Tensor:
    ts = float_tensors(out)
    if len(ts) == 1 and ts[0].numel() == 1:
        return ts[0]
    # a proxy objective with well-scaled gradients everywhere
    return sum(t.float().pow(2).mean() for t in ts)  # type: ignore[return-value]


def _cast_inputs(inputs: Any, dtype: torch.dtype) -> Any:
    if isinstance(inputs, torch.Tensor):
        return inputs.to(dtype) if inputs.is_floating_point() else inputs
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(_cast_inputs(i, dtype) for i in inputs)
    if isinstance(inputs, dict):
        return {k: _cast_inputs(v, dtype) for k, v in inputs.items()}
    return inputs


def _call(model: torch.nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, (tuple, list)):
        return model(*inputs)
    return model(inputs)


def audit(
    model: torch.nn.Module,
    example_inputs: Any,
    precision: Union[str, Precision] = "fp16",
    loss_fn: Optional[Callable[[Any], torch.Tensor]] = None,
    *,
    reference: str = "auto",
    max_fp64_params: int = 50_000_000,
) -> AuditReport:
    """Compare every module's output under ``precision`` with an fp64 (or fp32) reference.

    For each module: relative error of its (first) output, largest magnitude and headroom to the
    compute dtype's max, whether it went non-finite, and — from the reference gradients — the
    share of its parameters' non-zero gradient elements that would flush to zero in fp16 at scale 1
    and at the recommended ``init_scale``. Recommends modules to keep in fp32 (non-finite, < 1 bit
    of headroom, or relative error above 16 ulps of the dtype) and an ``init_scale`` (the largest
    power of two that keeps the largest reference gradient 8x below fp16's max). Flags module types
    known to need care (:data:`SENSITIVE`). ``loss_fn(output)`` gives the loss (default: the
    output if it is a scalar, else the mean of squares). The model is not modified. Synchronizes.
    """
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    p = precision if isinstance(precision, Precision) else resolve_precision(precision, device)
    n_params = sum(q.numel() for q in model.parameters())
    ref_dtype = (
        torch.float64
        if (
            reference == "fp64"
            or (reference == "auto" and n_params <= max_fp64_params and device.type == "cpu")
        )
        else torch.float32
    )
    ref_outs, ref_grads = _reference(
        model, example_inputs, ref_dtype, device, loss_fn or _default_loss
    )
    max_grad, rec_scale = _recommended_scale(ref_grads)
    test_model = copy.deepcopy(model)
    if p.is_pure:
        test_model = test_model.to(p.param_dtype)
    test_inputs = _cast_inputs(example_inputs, p.param_dtype) if p.is_pure else example_inputs
    test_outs, test_finite_in = _forward(test_model, test_inputs, p, device)
    ulp = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7, torch.float32: 2.0**-23}
    threshold = 16 * ulp.get(p.compute_dtype, 2.0**-23)
    rows = [
        _module_row(
            name,
            m,
            test_outs.get(name),
            ref_outs.get(name),
            not test_finite_in.get(name, True),
            ref_grads.get(name) or [],
            rec_scale,
            p,
            threshold,
        )
        for name, m in model.named_modules()
        if name
    ]
    rows.sort(key=lambda r: (not r.keep_fp32, -(r.rel_error or 0.0)))
    keep = [r.name for r in rows if r.keep_fp32]
    # A container is flagged when a child inside it is: recommend the innermost modules only.
    keep = [k for k in keep if not any(o != k and o.startswith(k + ".") for o in keep)]
    by_name = {r.name: r for r in rows}
    notes = _follow_overflows(test_model, test_inputs, p, device, keep, by_name)
    rows = sorted(by_name.values(), key=lambda r: (not r.keep_fp32, -(r.rel_error or 0.0)))
    if not p.needs_scaler:
        notes.append(
            f"{p.name} needs no loss scaling; the underflow columns show what fp16 would do"
        )
    return AuditReport(
        precision=p.name,
        reference_dtype=str(ref_dtype).replace("torch.", ""),
        modules=rows,
        recommended_keep_fp32=keep,
        recommended_init_scale=rec_scale,
        max_grad=max_grad,
        notes=notes,
    )


def _reference(
    model: torch.nn.Module,
    inputs: Any,
    dtype: torch.dtype,
    device: torch.device,
    loss_fn: Callable[[Any], torch.Tensor],
) -> tuple[dict[str, Any], dict[str, list[torch.Tensor]]]:
    """A ``dtype`` copy's first outputs per module and its parameters' gradients per module."""
    ref_model = copy.deepcopy(model).to(dtype)
    ref_model.train(model.training)
    ref_inputs = _cast_inputs(inputs, dtype)
    with torch.autocast(device.type, enabled=False):
        ref_outs, ref_result, _ = _first_outputs(ref_model, lambda: _call(ref_model, ref_inputs))
        loss_fn(ref_result).backward()
    ref_grads = {
        n: [q.grad.detach() for q in m.parameters(recurse=False) if q.grad is not None]
        for n, m in ref_model.named_modules()
        if n
    }
    return ref_outs, ref_grads


def _recommended_scale(
    grads: dict[str, list[torch.Tensor]],
) -> tuple[Optional[float], Optional[float]]:
    """The largest reference gradient, and the largest power of two (1 to 2**24) that keeps it 8x
    below fp16's max."""
    max_grad = max((float(g.abs().max()) for gs in grads.values() for g in gs), default=None)
    if not (max_grad and max_grad > 0):
        return max_grad, None
    scale = float(2 ** math.floor(math.log2(FP16_MAX / (8 * max_grad))))
    return max_grad, min(max(scale, 1.0), 2.0**24)


def _forward(
    model: torch.nn.Module, inputs: Any, p: Precision, device: torch.device
) -> tuple[dict[str, Any], dict[str, bool]]:
    """First outputs per module under ``p``'s autocast (no gradients), and which inputs were finite."""
    with (
        torch.no_grad(),
        torch.autocast(device.type, dtype=p.compute_dtype, enabled=p.autocast_enabled),
    ):
        outs, _, finite_in = _first_outputs(model, lambda: _call(model, inputs))
    return outs, finite_in


def _output_numbers(
    t_out: Any, r_out: Any
) -> tuple[Optional[str], bool, Optional[float], Optional[float], Optional[float]]:
    """(dtype, non-finite?, largest finite magnitude, headroom bits, relative error) of a module's
    first output against the reference's."""
    if not (t_out and r_out):
        return None, False, None, None, None
    t, r = t_out[0], r_out[0]
    nonfinite = not bool(torch.isfinite(t).all())
    finite = t[torch.isfinite(t)]
    maxabs = float(finite.abs().max()) if finite.numel() else None
    dmax = torch.finfo(t.dtype).max if t.is_floating_point() else None
    headroom = math.log2(dmax / maxabs) if maxabs and dmax else None
    rel = None
    if not nonfinite and t.shape == r.shape:
        denom = float(r.double().norm())
        rel = float((t.double() - r.double()).norm()) / denom if denom > 0 else 0.0
    return str(t.dtype).replace("torch.", ""), nonfinite, maxabs, headroom, rel


def _underflow(
    grads: list[torch.Tensor], scale: Optional[float]
) -> tuple[Optional[float], Optional[float]]:
    """Shares of the non-zero gradient elements that flush to zero in fp16 at scale 1 and at ``scale``."""
    if not grads:
        return None, None
    flat = torch.cat([g.flatten().abs() for g in grads])
    nz = flat[flat > 0]
    if not nz.numel():
        return None, None
    at_one = float((nz < FP16_TINY).float().mean())
    return at_one, float((nz * scale < FP16_TINY).float().mean()) if scale else None


def _module_row(
    name: str,
    m: torch.nn.Module,
    t_out: Any,
    r_out: Any,
    input_nonfinite: bool,
    grads: list[torch.Tensor],
    rec_scale: Optional[float],
    p: Precision,
    threshold: float,
) -> ModuleAudit:
    """One module's audit: its output's numbers, its gradients' underflow, why to keep it in fp32."""
    dtype, nonfinite, maxabs, headroom, rel = _output_numbers(t_out, r_out)
    u1, urec = _underflow(grads, rec_scale)
    # Non-finite because its input already is: a consequence of an earlier module, which carries
    # the recommendation.
    inherited = nonfinite and input_nonfinite
    reasons = []
    if not inherited and nonfinite:
        reasons.append("non-finite output")
    elif not inherited and headroom is not None and headroom < 1:
        reasons.append(f"only {headroom:.2f} bits of headroom to {dtype} max")
    if not inherited and rel is not None and rel > threshold and p.compute_dtype != torch.float32:
        reasons.append(
            f"relative error {rel:.2g} > {threshold:.2g} (16 ulps of {str(p.compute_dtype)[6:]})"
        )
    note = (
        "non-finite because its input already is"
        if inherited
        else next((why for cls, why in SENSITIVE.items() if isinstance(m, cls)), "")
    )
    return ModuleAudit(
        name=name,
        type=type(m).__name__,
        output_dtype=dtype,
        rel_error=rel,
        max_abs=maxabs,
        headroom_bits=headroom,
        nonfinite=nonfinite,
        grad_underflow_scale1=u1,
        grad_underflow_recommended=urec,
        keep_fp32=bool(reasons),
        reasons=tuple(reasons),
        note=note,
    )


def _follow_overflows(
    test_model: torch.nn.Module,
    inputs: Any,
    p: Precision,
    device: torch.device,
    keep: list[str],
    by_name: dict[str, ModuleAudit],
) -> list[str]:
    """An overflow hides the ones after it (their inputs are already inf): re-run with the
    recommendations applied until no new module overflows. Extends ``keep`` and ``by_name`` in
    place; returns notes on what each round found."""
    notes = []
    for _ in range(8):
        if not any(by_name[k].nonfinite for k in keep):
            break
        trial = copy.deepcopy(test_model)
        apply_fp32_overrides(trial, keep, device.type)
        outs, fin = _forward(trial, inputs, p, device)
        new = [
            n
            for n, o in outs.items()
            if o
            and fin.get(n, True)
            and not bool(torch.isfinite(o[0]).all())
            and not any(n == k or n.startswith(k + ".") or k.startswith(n + ".") for k in keep)
        ]
        new = [n for n in new if not any(o != n and o.startswith(n + ".") for o in new)]
        if not new:
            break
        for n in new:
            by_name[n] = dataclasses.replace(
                by_name[n],
                keep_fp32=True,
                note="",
                reasons=(f"non-finite output once {', '.join(keep)} run in fp32",),
            )
        keep += new
        notes.append(
            f"after keeping {', '.join(keep[: -len(new)])} in fp32, {', '.join(new)} overflowed next"
        )
    return notes
