"""What the hardware can do: CUDA capability, half/bf16/fp8 support, CPU ISA flags.

Everything here is a *probe*: it reads facts and never changes global state. The results are
plain frozen dataclasses so the CLI can print them and the tests can construct them by hand
(``DeviceInfo(...)``) to exercise :func:`ampkit.step.precision.resolve_precision` for hardware this
machine does not have.
"""

from __future__ import annotations

import difflib
import functools
import platform
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Union

import torch

__all__ = ["CpuFeatures", "DeviceInfo", "cpu_features", "device_info", "normalize_device"]

# The CPU flags that decide how fast reduced precision runs on x86 (names as /proc/cpuinfo
# spells them). AMX-BF16 and AVX512-BF16 have native bf16 dot products; AVX512-FP16 and
# AMX-FP16 native fp16 arithmetic. Without them oneDNN emulates, and bf16 is *slower* than fp32.
_CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_bf16", "amx_fp16", "amx_tile")


@dataclass(frozen=True)
class CpuFeatures:
    """ISA features of the host CPU that matter for reduced precision."""

    model: str
    flags: tuple[str, ...]
    capability: str  # what ATen's dispatcher chose: "AVX512", "AVX2", "DEFAULT", ...

    @property
    def native_bf16(self) -> bool:
        """True when the CPU has bf16 dot-product instructions (AMX-BF16 or AVX512-BF16)."""
        return "amx_bf16" in self.flags or "avx512_bf16" in self.flags

    @property
    def native_fp16(self) -> bool:
        """True when the CPU has fp16 arithmetic instructions (AVX512-FP16 or AMX-FP16)."""
        return "avx512_fp16" in self.flags or "amx_fp16" in self.flags

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "flags": list(self.flags),
            "native_bf16": self.native_bf16,
            "native_fp16": self.native_fp16,
        }


@dataclass(frozen=True)
class DeviceInfo:
    """One device and what reduced precisions it supports.

    ``type`` is the ``torch.device`` type (``"cpu"``, ``"cuda"``, ``"mps"``); ``capability`` is
    the CUDA compute capability (``(8, 0)`` for A100) or ``None``.
    """

    type: str
    name: str
    index: Optional[int] = None
    capability: Optional[tuple[int, int]] = None
    bf16: bool = False
    fp16: bool = True
    fp8: bool = False
    memory_bytes: Optional[int] = None
    cpu: Optional[CpuFeatures] = field(default=None, compare=False)

    @property
    def torch_device(self) -> torch.device:
        return (
            torch.device(self.type, self.index)
            if self.index is not None
            else torch.device(self.type)
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["capability"] = list(self.capability) if self.capability else None
        d["cpu"] = self.cpu.to_dict() if self.cpu else None
        return d


def _read_proc_cpuinfo() -> tuple[str, set[str]]:
    model, flags = platform.processor() or platform.machine(), set()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and model in ("", platform.machine(), platform.processor()):
                    model = value.strip()
                elif key == "flags":
                    flags = set(value.split())
                    break
    except OSError:  # not Linux: fall back on what torch itself can tell
        pass
    return model, flags


@functools.lru_cache(maxsize=1)
def cpu_features() -> CpuFeatures:
    """Probe the host CPU once (cached). Reads ``/proc/cpuinfo`` and ATen's own checks."""
    model, flags = _read_proc_cpuinfo()
    # torch's own probes cover non-Linux hosts and containers that hide /proc/cpuinfo flags.
    probes = {
        "avx2": "_is_avx2_supported",
        "avx512f": "_is_avx512_supported",
        "avx512_bf16": "_is_avx512_bf16_supported",
        "amx_tile": "_is_amx_tile_supported",
        "amx_fp16": "_is_amx_fp16_supported",
    }
    for flag, fn in probes.items():
        probe = getattr(torch.cpu, fn, None)
        try:
            if probe is not None and probe():
                flags.add(flag)
        except RuntimeError:
            pass
    if "amx_tile" in flags and "amx_bf16" not in flags and "avx512_bf16" in flags:
        flags.add("amx_bf16")  # every AMX part ships AMX-BF16 (Sapphire Rapids onwards)
    capability = torch.backends.cpu.get_cpu_capability()
    return CpuFeatures(
        model=model, flags=tuple(f for f in _CPU_FLAGS if f in flags), capability=capability
    )


def normalize_device(device: Union[str, torch.device, None]) -> torch.device:
    """The device to train on: the given one, else CUDA if present, else MPS, else CPU."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        mps = getattr(torch.backends, "mps", None)
        if mps is not None and mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        kind = str(device).partition(":")[0]
        close = difflib.get_close_matches(kind, ["cpu", "cuda", "mps", "xpu"], n=1, cutoff=0.6)
        why = f" (did you mean {close[0]!r}?)" if close and close[0] != kind else f": {e}"
        raise ValueError(
            f"invalid device {device!r}{why}; use e.g. 'cpu', 'cuda', 'cuda:1', 'mps'"
        ) from None
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def device_info(device: Union[str, torch.device, None] = None) -> DeviceInfo:
    """Describe ``device`` (default: the best available) and its reduced-precision support.

    Raises ``ValueError`` when a CUDA/MPS device is asked for but not available.
    """
    dev = normalize_device(device)
    if dev.type == "cpu":
        cpu = cpu_features()
        # bf16 and fp16 always *run* on CPU (emulated when not native); "supported" here means
        # the kernels exist. How fast they are is reported separately through `cpu`.
        return DeviceInfo(type="cpu", name=cpu.model, bf16=True, fp16=True, fp8=False, cpu=cpu)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {str(dev)!r} was asked for, but CUDA is not available here "
                f"(torch {torch.__version__}); use 'cpu'"
            )
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        cap = (props.major, props.minor)
        # fp8 tensor cores: Ada (8.9) and Hopper (9.0) onwards.
        return DeviceInfo(
            type="cuda",
            name=props.name,
            index=index,
            capability=cap,
            bf16=cap >= (8, 0),
            fp16=cap >= (5, 3),
            fp8=cap >= (8, 9),
            memory_bytes=props.total_memory,
            cpu=cpu_features(),
        )
    if dev.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise ValueError(
                f"device {str(dev)!r} was asked for, but MPS is not available here (Apple silicon "
                f"with a torch built for it; torch {torch.__version__}); use 'cpu'"
            )
        return DeviceInfo(type="mps", name="Apple MPS", bf16=False, fp16=True, cpu=None)
    return DeviceInfo(type=dev.type, name=dev.type, index=dev.index, bf16=False, fp16=False)
