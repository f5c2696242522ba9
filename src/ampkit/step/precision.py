"""Precisions: a small frozen value object, parsed once from a string or dtype, resolved per device.

``resolve_precision("auto", "cuda")`` answers "what should I train in here, and why?";
``resolve_precision("fp16", "cpu")`` answers "what does fp16 mean here, can it run, and why?".
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from .aliases import PRECISION_ALIASES, SHOWN_PRECISION_ALIASES
from .hardware import DeviceInfo, device_info

__all__ = [
    "CANONICAL",
    "NAMES",
    "OPT_LEVELS",
    "PLAN_PRECISIONS",
    "REFERENCE",
    "REGISTRY",
    "Precision",
    "PrecisionError",
    "PrecisionRow",
    "opt_level_form",
    "parse_precision",
    "precision_dtypes",
    "precision_row",
    "resolve_precision",
]


class PrecisionError(ValueError):
    """An unknown precision name, or one the device cannot run. The message names the valid choices."""


@dataclass(frozen=True)
class PrecisionRow:
    """Everything ampkit knows about one precision, in one frozen row of :data:`REGISTRY`.

    Other modules ask the row (``precision_row(name).lightning_name``) or the policy, never the
    name: adding a precision is adding a row (and, for a new family, a policy file).

    Attributes:
        name: canonical name.
        param_dtype / compute_dtype: the weights' storage dtype and the matmul (autocast) dtype.
        family: the policy that runs it (:mod:`ampkit.step.policies`): full, autocast, pure or fp8.
        description: one sentence for ``ampkit info`` and ``reason``.
        needs_scaler: dynamic loss scaling is required (fp16 forms).
        reduced_matmul: fp32 matmuls may use reduced-precision internals (tf32).
        hardware: the :class:`~ampkit.step.hardware.DeviceInfo` flag that must be true (``"fp8"``).
        min_capability: the CUDA compute capability it needs, where older GPUs cannot run it.
        requirement: the hardware requirement as a sentence (``"<name> needs <requirement>"``).
        emulable: ``fp8_emulate=True`` lets it run without the hardware (numerics, no speed).
        fp8_recipe: the torchao float8 recipe the row fixes; ``None``: the config's ``fp8_recipe``.
        opt_level: the apex opt level it amounts to (``O0``, ``O1``, ``O2``, ``-`` for none).
        o1_form / o2_form: what ``--amp_opt_level O1`` / ``O2`` make of it (``bf16`` O2 ->
            ``bf16-pure``); ``None``: the pair contradicts itself.
        lightning_name / accelerate_name: the same kind of training in Lightning / Accelerate.
        successor: the next precision of the default fallback chain (``None``: the end).
        measures_activations: the activation estimate can follow its forward (torchao's fp8
            casts are not followed yet).
        planned: one of the default precisions of ``ampkit plan`` (:data:`PLAN_PRECISIONS`).
        twin: the precision whose steps differ only by the loss scaler's scalars.
        keeps_masters: half weights with fp32 master copies kept by ampkit (the pure forms).
        has_ladder: the memory ladder (``masters``, ``state_dtype``) applies.
    """

    name: str
    param_dtype: torch.dtype
    compute_dtype: torch.dtype
    family: str
    description: str
    needs_scaler: bool = False
    reduced_matmul: bool = False
    hardware: Optional[str] = None
    min_capability: Optional[tuple[int, int]] = None
    requirement: str = ""
    emulable: bool = False
    fp8_recipe: Optional[str] = None
    opt_level: str = "-"
    o1_form: Optional[str] = None
    o2_form: Optional[str] = None
    lightning_name: str = "32-true"
    accelerate_name: str = "no"
    successor: Optional[str] = "fp32"
    measures_activations: bool = True
    planned: bool = False
    twin: Optional[str] = None
    keeps_masters: bool = False
    has_ladder: bool = False


_F32, _BF16, _F16 = torch.float32, torch.bfloat16, torch.float16
_FP8_GPU = "an NVIDIA GPU with fp8 tensor cores (Ada/Hopper, compute capability >= 8.9)"

#: The one list of precisions, in the order of the table in DESIGN.md; every one runs in the engine.
REGISTRY: dict[str, PrecisionRow] = {
    r.name: r
    for r in (
        PrecisionRow(
            "fp32",
            _F32,
            _F32,
            "full",
            "full fp32 weights and compute; reduced-precision matmul internals off",
            opt_level="O0",
            successor=None,
            planned=True,
        ),
        PrecisionRow(
            "tf32",
            _F32,
            _F32,
            "full",
            "fp32 weights; fp32 matmuls with reduced-precision "
            "internals (TF32 on CUDA, bf16 on AMX CPUs)",
            reduced_matmul=True,
            min_capability=(8, 0),
            requirement="compute capability >= 8.0 (Ampere) for TF32",
        ),
        PrecisionRow(
            "bf16",
            _F32,
            _BF16,
            "autocast",
            "fp32 weights; autocast to bfloat16; no loss scaling needed",
            opt_level="O1",
            o1_form="bf16",
            o2_form="bf16-pure",
            lightning_name="bf16-mixed",
            accelerate_name="bf16",
            planned=True,
            twin="fp16",
        ),
        PrecisionRow(
            "fp16",
            _F32,
            _F16,
            "autocast",
            "fp32 weights; autocast to float16; dynamic loss scaling",
            needs_scaler=True,
            opt_level="O1",
            o1_form="fp16",
            o2_form="fp16-pure",
            lightning_name="16-mixed",
            accelerate_name="fp16",
            successor="bf16",
            planned=True,
            twin="bf16",
        ),
        PrecisionRow(
            "bf16-pure",
            _BF16,
            _BF16,
            "pure",
            "bfloat16 weights and compute; fp32 master weights",
            opt_level="O2",
            o2_form="bf16-pure",
            lightning_name="bf16-true",
            accelerate_name="bf16",
            planned=True,
            twin="fp16-pure",
            keeps_masters=True,
            has_ladder=True,
        ),
        PrecisionRow(
            "fp16-pure",
            _F16,
            _F16,
            "pure",
            "float16 weights and compute; fp32 master weights; dynamic loss scaling",
            needs_scaler=True,
            opt_level="O2",
            o2_form="fp16-pure",
            lightning_name="16-true",
            accelerate_name="fp16",
            successor="bf16-pure",
            planned=True,
            twin="bf16-pure",
            keeps_masters=True,
        ),
        PrecisionRow(
            "fp8",
            _F32,
            _BF16,
            "fp8",
            "fp8 matmuls through torchao; bf16 autocast elsewhere",
            hardware="fp8",
            requirement=_FP8_GPU,
            emulable=True,
            o1_form="fp8",
            lightning_name="bf16-mixed",
            accelerate_name="fp8",
            successor="bf16",
            measures_activations=False,
        ),
        PrecisionRow(
            "fp8-rowwise",
            _F32,
            _BF16,
            "fp8",
            "fp8 matmuls through torchao with a scale per row (recipe rowwise: more "
            "accurate than fp8's tensorwise); bf16 autocast elsewhere",
            hardware="fp8",
            requirement=_FP8_GPU,
            emulable=True,
            fp8_recipe="rowwise",
            o1_form="fp8-rowwise",
            lightning_name="bf16-mixed",
            accelerate_name="fp8",
            successor="bf16",
            measures_activations=False,
        ),
    )
}
#: The concrete precisions, in the order of the table in DESIGN.md; every one runs in the engine.
NAMES: tuple[str, ...] = tuple(REGISTRY)
CANONICAL: tuple[str, ...] = ("auto", *NAMES)
#: The reference every other precision is measured against (and what O0 and fallbacks end in).
REFERENCE = "fp32"
#: The precisions ``ampkit plan`` and the service's planner compare by default.
PLAN_PRECISIONS: tuple[str, ...] = tuple(n for n, r in REGISTRY.items() if r.planned)
#: apex's optimisation levels: O0 fp32, O1 autocast over fp32 weights, O2 half weights with fp32
#: masters. (apex's O3, half weights without masters, is not offered: the pure forms keep masters.)
OPT_LEVELS: tuple[str, ...] = ("O0", "O1", "O2")
_LEVEL_MEANS = {"O1": "autocast over fp32 weights", "O2": "half weights with fp32 masters"}


def opt_level_form(precision: Optional[str], level: str) -> str:
    """What ``level`` (an :data:`OPT_LEVELS` entry, any case) makes of ``precision`` (a canonical
    name, ``auto`` or ``O2``; None: no precision given), read from the rows' ``o1_form`` and
    ``o2_form``: O0 is fp32 whatever the precision, O1 keeps an autocast precision (``bf16`` ->
    ``bf16``), O2 makes it pure (``bf16`` -> ``bf16-pure``); ``auto`` stays ``auto`` with O1 and is
    ``O2`` (the pure form of auto's dtype) with O2, as is no precision.

    Raises :class:`PrecisionError` for an unknown level, and for a pair that contradicts itself
    (``fp32`` with O2, ``bf16-pure`` with O1), naming the precisions the level takes."""
    level = str(level).strip().upper()
    if level not in OPT_LEVELS:
        raise PrecisionError(f"unknown opt level {level!r}; choose one of: {', '.join(OPT_LEVELS)}")
    if level == "O0":
        return REFERENCE
    if precision in (None, "auto"):
        return "auto" if level == "O1" else "O2"
    row = REGISTRY.get(precision)
    form = (
        "O2"
        if precision == "O2" and level == "O2"
        else None
        if row is None
        else row.o1_form
        if level == "O1"
        else row.o2_form
    )
    if form is None:
        takes = [n for n, r in REGISTRY.items() if (r.o1_form if level == "O1" else r.o2_form)]
        raise PrecisionError(
            f"{level} means {_LEVEL_MEANS[level]}, which {precision} is not; with {level} "
            f"give one of: auto, {', '.join(takes)}"
        )
    return form


_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}

DESCRIPTIONS = {n: r.description for n, r in REGISTRY.items()}


def precision_row(spec: Union[str, torch.dtype, Precision]) -> PrecisionRow:
    """The :data:`REGISTRY` row of any accepted spelling but ``auto``/``O2`` (device-dependent).

    Raises :class:`PrecisionError` for unknown names and for ``auto``/``O2``."""
    name = parse_precision(spec)
    if name not in REGISTRY:
        raise PrecisionError(
            f"{spec!r} depends on the device: resolve it first "
            "(ampkit.resolve_precision(name, ampkit.device_info(device)))"
        )
    return REGISTRY[name]


@dataclass(frozen=True)
class Precision:
    """A resolved precision: what to cast, what to autocast to, and whether to scale the loss.

    Attributes:
        name: canonical name (a key of :data:`REGISTRY`: ``fp32``, ``bf16``, ``fp8-rowwise``, ...).
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
    def row(self) -> PrecisionRow:
        """Its :data:`REGISTRY` row: everything ampkit knows about this precision."""
        return REGISTRY[self.name]

    @property
    def reduced_matmul(self) -> bool:
        """True for ``tf32``: fp32 matmuls may use reduced-precision internals."""
        return self.row.reduced_matmul

    @property
    def is_pure(self) -> bool:
        """True for the pure forms (half weights with fp32 masters: the ``pure`` family)."""
        return self.family == "pure"

    @property
    def family(self) -> str:
        """The policy family that runs it: ``full``, ``autocast``, ``pure`` or ``fp8``."""
        return self.row.family

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "param_dtype": str(self.param_dtype).replace("torch.", ""),
            "compute_dtype": str(self.compute_dtype).replace("torch.", ""),
            "needs_scaler": self.needs_scaler,
            "device_type": self.device_type,
            "reason": self.reason,
            "requested": self.requested,
        }

    def __str__(self) -> str:
        return self.name


def _unknown(spec: object) -> PrecisionError:
    text = str(spec).strip().lower()
    close = difflib.get_close_matches(text, list(CANONICAL) + list(PRECISION_ALIASES), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return PrecisionError(
        f"unknown precision {spec!r}{hint}; choose one of: {', '.join(CANONICAL)} "
        f"(aliases: {', '.join(SHOWN_PRECISION_ALIASES)})"
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
        raise PrecisionError(
            f"precision must be a string or torch.dtype, got {type(spec).__name__} "
            f"{spec!r}; choose one of: {', '.join(CANONICAL)}"
        )
    text = spec.strip().lower().replace("_", "-")
    if text in REGISTRY or text == "auto":
        return text
    if text in PRECISION_ALIASES:
        return PRECISION_ALIASES[text]
    # Tolerate "bf16 pure"/"fp16pure" spacing variants.
    squashed = text.replace(" ", "-")
    if squashed in REGISTRY:
        return squashed
    raise _unknown(spec)


def _auto(info: DeviceInfo) -> tuple[str, str]:
    """The rule behind ``auto``: (name, reason)."""
    if info.type == "cuda":
        cap = f"{info.capability[0]}.{info.capability[1]}" if info.capability else "?"
        if info.bf16:
            return "bf16", (
                f"{info.name} (compute capability {cap}) has native bf16 tensor cores; "
                "bf16 keeps fp32's range, so no loss scaling is needed"
            )
        if info.capability and info.capability >= (7, 0):
            return "fp16", (
                f"{info.name} (compute capability {cap}) has fp16 tensor cores but no "
                "bf16; fp16 with dynamic loss scaling"
            )
        return "fp32", (
            f"{info.name} (compute capability {cap}) has no half-precision tensor "
            "cores; reduced precision would not be faster"
        )
    if info.type == "mps":
        return "fp16", "Apple GPUs run fp16 natively; fp16 with dynamic loss scaling"
    if info.type == "cpu":
        cpu = info.cpu
        if cpu is not None and cpu.native_bf16:
            which = "AMX-BF16" if "amx_bf16" in cpu.flags else "AVX512-BF16"
            return "bf16", f"the CPU ({cpu.model}) has {which}, so bf16 matmuls run natively"
        model = cpu.model if cpu else "this CPU"
        return "fp32", (
            f"the CPU ({model}) has neither AMX-BF16 nor AVX512-BF16; bf16 and fp16 "
            "would be emulated and slower than fp32"
        )
    return "fp32", f"no reduced-precision support known for device type {info.type!r}"


def _unsupported(name: str, info: DeviceInfo) -> Optional[str]:
    """Why ``name`` cannot run on ``info``, or None when it can."""
    row = REGISTRY[name]
    dtype = row.compute_dtype
    where = f"{info.name} ({info.type}"
    where += (
        f", compute capability {info.capability[0]}.{info.capability[1]})"
        if info.capability
        else ")"
    )
    if row.hardware is not None:
        if not getattr(info, row.hardware):
            lacks = "is older" if info.type == "cuda" else "has none"
            return f"{name} needs {row.requirement}; {where} {lacks}"
        return None
    cap = info.capability if info.type == "cuda" else None
    if row.min_capability and cap and cap < row.min_capability:
        return f"{name} needs {row.requirement}; {where} is older"
    if dtype == torch.bfloat16 and not info.bf16:
        return f"bf16 is not supported on {where}"
    if dtype == torch.float16 and not info.fp16:
        return f"fp16 is not supported on {where}"
    return None


def cpu_emulation_note(name: str, info: DeviceInfo) -> str:
    """'' or why ``name`` runs emulated (slower than fp32) on this CPU."""
    if info.type != "cpu" or info.cpu is None or name not in REGISTRY:
        return ""
    dtype = REGISTRY[name].compute_dtype
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
                picked, reason = (
                    picked + "-pure",
                    reason + "; O2 keeps the weights in that dtype with fp32 master copies",
                )
        name = picked
    elif REGISTRY[name].emulable and emulate_fp8 and _unsupported(name, info):
        reason = (
            f"{DESCRIPTIONS[name]} (emulated by torchao: fp8 numerics without fp8 tensor cores; "
            f"{_unsupported(name, info)})"
        )
    else:
        why_not = _unsupported(name, info)
        if why_not:
            emulable = REGISTRY[name].emulable
            hint = " (or fp8_emulate=True to emulate it, for tests)" if emulable else ""
            raise PrecisionError(
                f"precision {name!r} cannot run here: {why_not}. "
                f"Choose one this device supports, or 'auto'{hint}."
            )
        reason = DESCRIPTIONS[name]
        if info.type == "cpu" and info.cpu is not None:
            note = cpu_emulation_note(name, info)
            if note:
                reason += f" ({note})"
    row = REGISTRY[name]
    return Precision(
        name=name,
        param_dtype=row.param_dtype,
        compute_dtype=row.compute_dtype,
        needs_scaler=row.needs_scaler,
        device_type=info.type,
        reason=reason,
        requested=requested,
    )


def precision_dtypes(name: str) -> tuple[torch.dtype, torch.dtype]:
    """``(param dtype, compute dtype)`` of a canonical precision name, without a device.

    Raises :class:`PrecisionError` for ``auto``/``O2`` (resolve them for a device first) and unknown names.
    """
    row = precision_row(name)
    return row.param_dtype, row.compute_dtype
