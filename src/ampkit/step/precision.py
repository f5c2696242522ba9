"""Precisions: a small frozen value object, parsed once from a string or dtype, resolved per device.

``resolve_precision("auto", "cuda")`` answers "what should I train in here, and why?";
``resolve_precision("fp16", "cpu")`` answers "what does fp16 mean here, can it run, and why?".
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from .hardware import DeviceInfo, device_info

__all__ = ["CANONICAL", "NAMES", "Precision", "PrecisionError", "parse_precision", "precision_dtypes",
           "resolve_precision"]


class PrecisionError(ValueError):
    """An unknown precision name, or one the device cannot run. The message names the valid choices."""


# The one list of precisions. name -> (param dtype, compute dtype, needs loss scaling,
# reduced-precision fp32 matmuls, family). The family names the policy that runs it
# (:mod:`ampkit.step.policies`): full, autocast, pure or fp8.
_TABLE: dict[str, tuple[torch.dtype, torch.dtype, bool, bool, str]] = {
    "fp32": (torch.float32, torch.float32, False, False, "full"),
    "tf32": (torch.float32, torch.float32, False, True, "full"),
    "bf16": (torch.float32, torch.bfloat16, False, False, "autocast"),
    "fp16": (torch.float32, torch.float16, True, False, "autocast"),
    "bf16-pure": (torch.bfloat16, torch.bfloat16, False, False, "pure"),
    "fp16-pure": (torch.float16, torch.float16, True, False, "pure"),
    "fp8": (torch.float32, torch.bfloat16, False, False, "fp8"),
}
#: The concrete precisions, in the order of the table in DESIGN.md; every one runs in the engine.
NAMES: tuple[str, ...] = tuple(_TABLE)
CANONICAL: tuple[str, ...] = ("auto", *NAMES)

# Spellings users already know from torch.amp / apex / Lightning / Accelerate (apex O0/O1/O2 too).
_ALIASES: dict[str, str] = {
    "no": "fp32", "o0": "fp32", "32": "fp32", "32-true": "fp32", "float32": "fp32",
    "float": "fp32", "torch.float32": "fp32", "torch.float": "fp32", "full": "fp32",
    "o1": "auto", "mixed": "auto",
    "o2": "o2",  # the pure form of auto's dtype: only resolve_precision can finish it
    "16": "fp16", "16-mixed": "fp16", "half": "fp16", "float16": "fp16", "torch.float16": "fp16",
    "torch.half": "fp16",
    "bf16-mixed": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
    "bf16-true": "bf16-pure", "16-true": "fp16-pure",
    "tf32-mixed": "tf32",
}
_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

DESCRIPTIONS = {
    "fp32": "full fp32 weights and compute; reduced-precision matmul internals off",
    "tf32": "fp32 weights; fp32 matmuls with reduced-precision internals (TF32 on CUDA, bf16 on AMX CPUs)",
    "bf16": "fp32 weights; autocast to bfloat16; no loss scaling needed",
    "fp16": "fp32 weights; autocast to float16; dynamic loss scaling",
    "bf16-pure": "bfloat16 weights and compute; fp32 master weights",
    "fp16-pure": "float16 weights and compute; fp32 master weights; dynamic loss scaling",
    "fp8": "fp8 matmuls through torchao; bf16 autocast elsewhere",
}


@dataclass(frozen=True)
class Precision:
    """A resolved precision: what to cast, what to autocast to, and whether to scale the loss.

    Attributes:
        name: canonical name (``fp32``, ``tf32``, ``bf16``, ``fp16``, ``bf16-pure``, ``fp16-pure``, ``fp8``).
        param_dtype: dtype the model's weights are stored in while training.
        compute_dtype: dtype matmuls and convolutions run in (the autocast dtype).
        needs_scaler: whether dynamic loss scaling is required (fp16 forms).
        device_type: ``"cpu"``, ``"cuda"`` or ``"mps"``.
        reason: one human sentence: why this precision (for ``auto``) or what it does here.
        requested: what the user wrote, before aliases and ``auto`` were resolved.
    """

    name: str
    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    needs_scaler: bool
    device_type: str
    reason: str = ""
    requested: str = ""

    @property
    def autocast_enabled(self) -> bool:
        """True when the forward pass runs under ``torch.autocast``."""
        return self.compute_dtype != self.param_dtype

    @property
    def reduced_matmul(self) -> bool:
        """True for ``tf32``: fp32 matmuls may use reduced-precision internals."""
        return _TABLE[self.name][3]

    @property
    def is_pure(self) -> bool:
        """True for the pure forms (half weights with fp32 masters: the ``pure`` family)."""
        return self.family == "pure"

    @property
    def family(self) -> str:
        """The policy family that runs it: ``full``, ``autocast``, ``pure`` or ``fp8``."""
        return _TABLE[self.name][4]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "param_dtype": str(self.param_dtype).replace("torch.", ""),
            "compute_dtype": str(self.compute_dtype).replace("torch.", ""),
            "needs_scaler": self.needs_scaler, "device_type": self.device_type,
            "reason": self.reason, "requested": self.requested,
        }

    def __str__(self) -> str:
        return self.name


def _unknown(spec: object) -> PrecisionError:
    text = str(spec).strip().lower()
    close = difflib.get_close_matches(text, list(CANONICAL) + list(_ALIASES), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return PrecisionError(
        f"unknown precision {spec!r}{hint}; choose one of: {', '.join(CANONICAL)} "
        f"(aliases: O0, O1, O2, no, 16-mixed, bf16-mixed, bf16-true, 16-true, 32, half, "
        f"bfloat16, float16, float32)"
    )


def parse_precision(spec: Union[str, torch.dtype, Precision]) -> str:
    """Map any accepted spelling (name, alias, ``torch.dtype``) to a canonical name or ``"auto"``/``"o2"``.

    Case and surrounding whitespace are ignored. ``"O2"`` is returned as ``"o2"``: it means the
    pure form of whatever ``auto`` picks, so only :func:`resolve_precision` can finish it.
    Raises :class:`PrecisionError` for anything else.
    """
    if isinstance(spec, Precision):
        return spec.name
    if isinstance(spec, torch.dtype):
        if spec in _DTYPES:
            return _DTYPES[spec]
        raise _unknown(spec)
    if isinstance(spec, int) and not isinstance(spec, bool):
        spec = str(spec)
    if not isinstance(spec, str):
        raise PrecisionError(f"precision must be a string or torch.dtype, got {type(spec).__name__} "
                             f"{spec!r}; choose one of: {', '.join(CANONICAL)}")
    text = spec.strip().lower().replace("_", "-")
    if text in _TABLE or text == "auto":
        return text
    if text in _ALIASES:
        return _ALIASES[text]
    # Tolerate "bf16 pure"/"fp16pure" spacing variants.
    squashed = text.replace(" ", "-")
    if squashed in _TABLE:
        return squashed
    raise _unknown(spec)


def _auto(info: DeviceInfo) -> tuple[str, str]:
    """The rule behind ``auto``: (name, reason)."""
    if info.type == "cuda":
        cap = f"{info.capability[0]}.{info.capability[1]}" if info.capability else "?"
        if info.bf16:
            return "bf16", (f"{info.name} (compute capability {cap}) has native bf16 tensor cores; "
                            "bf16 keeps fp32's range, so no loss scaling is needed")
        if info.capability and info.capability >= (7, 0):
            return "fp16", (f"{info.name} (compute capability {cap}) has fp16 tensor cores but no "
                            "bf16; fp16 with dynamic loss scaling")
        return "fp32", (f"{info.name} (compute capability {cap}) has no half-precision tensor "
                        "cores; reduced precision would not be faster")
    if info.type == "mps":
        return "fp16", "Apple GPUs run fp16 natively; fp16 with dynamic loss scaling"
    if info.type == "cpu":
        cpu = info.cpu
        if cpu is not None and cpu.native_bf16:
            which = "AMX-BF16" if "amx_bf16" in cpu.flags else "AVX512-BF16"
            return "bf16", f"the CPU ({cpu.model}) has {which}, so bf16 matmuls run natively"
        model = cpu.model if cpu else "this CPU"
        return "fp32", (f"the CPU ({model}) has neither AMX-BF16 nor AVX512-BF16; bf16 and fp16 "
                        "would be emulated and slower than fp32")
    return "fp32", f"no reduced-precision support known for device type {info.type!r}"


def _unsupported(name: str, info: DeviceInfo) -> Optional[str]:
    """Why ``name`` cannot run on ``info``, or None when it can."""
    dtype = _TABLE[name][1]
    where = f"{info.name} ({info.type}"
    where += f", compute capability {info.capability[0]}.{info.capability[1]})" if info.capability else ")"
    if name == "fp8":
        if info.type != "cuda":
            return f"fp8 needs an NVIDIA GPU with fp8 tensor cores (Ada/Hopper, compute capability >= 8.9); {where} has none"
        if not info.fp8:
            return f"fp8 needs compute capability >= 8.9 (Ada/Hopper); {where} is older"
        return None
    if name == "tf32" and info.type == "cuda" and info.capability and info.capability < (8, 0):
        return f"TF32 needs compute capability >= 8.0 (Ampere); {where} is older"
    if dtype == torch.bfloat16 and not info.bf16:
        return f"bf16 is not supported on {where}"
    if dtype == torch.float16 and not info.fp16:
        return f"fp16 is not supported on {where}"
    return None


def cpu_emulation_note(name: str, info: DeviceInfo) -> str:
    """'' or why ``name`` runs emulated (slower than fp32) on this CPU."""
    if info.type != "cpu" or info.cpu is None or name not in _TABLE:
        return ""
    dtype = _TABLE[name][1]
    if dtype == torch.bfloat16 and not info.cpu.native_bf16:
        return "emulated on this CPU: no AMX-BF16/AVX512-BF16, expect it slower than fp32"
    if dtype == torch.float16 and not info.cpu.native_fp16:
        return "emulated on this CPU: no AVX512-FP16/AMX-FP16, expect it slower than fp32"
    return ""


def resolve_precision(
    spec: Union[str, torch.dtype, Precision] = "auto",
    device: Union[str, torch.device, DeviceInfo, None] = None,
    *,
    emulate_fp8: bool = False,
) -> Precision:
    """Resolve ``spec`` against ``device`` (default: the best available device).

    ``emulate_fp8=True`` lets ``fp8`` run where there are no fp8 tensor cores (a CPU, an older
    GPU): torchao emulates the fp8 casts and matmuls -- fp8 numerics, no fp8 speed (for tests).

    Returns a frozen :class:`Precision` whose ``reason`` says why (for ``auto``) or what it does.
    Raises :class:`PrecisionError` for unknown names, and for a precision the device cannot
    run (naming the device and the reason). Never picks ``fp8`` for ``auto``.
    """
    info = device if isinstance(device, DeviceInfo) else device_info(device)
    requested = spec.requested if isinstance(spec, Precision) else str(spec)
    name = parse_precision(spec)
    reason = ""
    if name in ("auto", "o2"):
        picked, reason = _auto(info)
        if name == "o2":
            if picked == "fp32":
                reason += "; O2 (pure half weights) falls back to fp32 here"
            else:
                picked, reason = picked + "-pure", reason + "; O2 keeps the weights in that dtype with fp32 master copies"
        name = picked
    elif name == "fp8" and emulate_fp8 and _unsupported(name, info):
        reason = (f"{DESCRIPTIONS[name]} (emulated by torchao: fp8 numerics without fp8 tensor cores; "
                  f"{_unsupported(name, info)})")
    else:
        why_not = _unsupported(name, info)
        if why_not:
            hint = " (or fp8_emulate=True to emulate it, for tests)" if name == "fp8" else ""
            raise PrecisionError(f"precision {name!r} cannot run here: {why_not}. "
                                 f"Choose one this device supports, or 'auto'{hint}.")
        reason = DESCRIPTIONS[name]
        if info.type == "cpu" and info.cpu is not None:
            note = cpu_emulation_note(name, info)
            if note:
                reason += f" ({note})"
    param, compute, scaler, _, _ = _TABLE[name]
    return Precision(name=name, param_dtype=param, compute_dtype=compute, needs_scaler=scaler,
                     device_type=info.type, reason=reason, requested=requested)


def precision_dtypes(name: str) -> tuple[torch.dtype, torch.dtype]:
    """``(param dtype, compute dtype)`` of a canonical precision name, without a device.

    Raises :class:`PrecisionError` for ``auto``/``O2`` (resolve them for a device first) and unknown names.
    """
    canonical = parse_precision(name)
    if canonical not in _TABLE:
        raise PrecisionError(f"{name!r} depends on the device: resolve it first "
                             "(ampkit.resolve_precision(name, ampkit.device_info(device)))")
    return _TABLE[canonical][0], _TABLE[canonical][1]
