"""One-pass native kernels for the ``split`` and ``kahan`` rungs (``_bits.c`` beside this file).

The eager functions of :mod:`.ladder` (``split_fp32``, ``join_split``, ``kahan_split``,
``kahan_join``) make 3--4 element-wise passes each; these kernels make one, bitwise the same. The
C source has no torch headers: on first use it is compiled with the system C compiler (``$CC``,
else Python's ``sysconfig`` ``CC``, else ``cc``) in well under a second into a per-user cache
(``native/`` under ``$AMPKIT_CACHE_DIR``, default ``~/.cache/ampkit``; the file name is a hash of
the source, compiler, flags and platform; written to a temporary file and renamed, so concurrent
processes are safe), loaded with ctypes and checked bitwise against the eager functions on a probe
of edge cases (NaNs, infinities, ties, subnormals, random bits). On x86-64 Linux the kernels are
built twice (AVX2 and baseline; the loader picks one for the CPU), so a shared cache stays safe.

NaNs: torch's fp32 -> bf16 copy gives every NaN one bit pattern that depends on the layout (here
0xFFFF when contiguous, 0x7FC0 when strided); the kernels take the contiguous one, read from torch
at load time, as they only ever replace contiguous passes.

Each wrapper returns ``True`` when it did the work and ``False`` when the caller must run the eager
passes: ``AMPKIT_NO_NATIVE=1``, no compiler, a failed compile or probe (one ``DEBUG`` line on the
``"ampkit"`` logger), a tensor not on the CPU, not contiguous, a subclass (fake tensors of
``ampkit plan``) or of another dtype.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import threading
from pathlib import Path
from typing import Any, Optional

import torch

from ..logs import logger

__all__ = ["FLAGS", "SOURCE", "cache_dir", "enabled", "join", "kahan_join", "kahan_split", "library", "split"]

SOURCE = Path(__file__).with_name("_bits.c")
#: no -ffast-math (the kernels are bitwise IEEE); -ffp-contract=off keeps x - h and h + c unfused
FLAGS = ("-O3", "-std=c99", "-shared", "-fPIC", "-ffp-contract=off")

_PLAIN = (torch.Tensor, torch.nn.Parameter)  # not subclasses: fake tensors (``ampkit plan``) have no data
_lock = threading.Lock()
_state: dict[str, Any] = {}  # "lib": the loaded library or None once tried; "nan": torch's bf16 NaN bits


def cache_dir() -> Path:
    """Where compiled kernels are kept (per user; the auto-precision cache's directory)."""
    return Path(os.environ.get("AMPKIT_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ampkit"))


def enabled() -> bool:
    """Whether the native kernels are in use in this process (compiling and checking them once)."""
    return os.environ.get("AMPKIT_NO_NATIVE", "") in ("", "0") and library() is not None


def library() -> Optional[ctypes.CDLL]:
    """The loaded, checked kernels, or None (the reason logged at DEBUG once)."""
    if "lib" not in _state:
        with _lock:
            if "lib" not in _state:
                try:
                    _state["lib"] = _load()
                except Exception as e:  # no compiler, a failed compile or load, a failed probe
                    logger.debug("ampkit native ladder kernels unavailable, using the eager passes: %s", e)
                    _state["lib"] = None
    return _state["lib"]


def _compiler() -> list[str]:
    cc = os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc"
    argv = shlex.split(cc)
    if not argv or shutil.which(argv[0]) is None:
        argv = ["cc"]
        if shutil.which("cc") is None:
            raise RuntimeError(f"no C compiler ({cc!r} not found)")
    return argv


def _load() -> ctypes.CDLL:
    if sys.byteorder != "little":
        raise RuntimeError("big-endian machine")
    cc, src = _compiler(), SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join([src, *(a.encode() for a in cc + list(FLAGS)), platform.machine().encode(),
                                     sys.platform.encode()])).hexdigest()[:20]
    out = cache_dir() / "native" / f"ladder-bits-{key}.so"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            r = subprocess.run([*cc, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                raise RuntimeError(f"{' '.join(cc)} failed: {r.stderr.strip()[-500:]}")
            os.replace(tmp, out)  # atomic: another process sees the old state or the whole file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(out))
    p, n = ctypes.c_void_p, ctypes.c_int64
    for name, extra in (("split", [ctypes.c_uint16]), ("join", []), ("kahan_split", [ctypes.c_uint16]),
                        ("kahan_join", [])):
        fn = getattr(lib, f"ampkit_{name}")
        fn.argtypes, fn.restype = [p, p, p, n, *extra], None
    nan = torch.tensor([float("nan")]).to(torch.bfloat16).view(torch.int16).item() & 0xFFFF
    _state["nan"] = nan
    _probe(lib, nan)
    return lib


def _probe(lib: ctypes.CDLL, nan: int) -> None:
    """Raise unless every kernel is bitwise the eager function on edge cases and random bits."""
    from . import ladder  # the references (imported here: ladder imports this module)

    g = torch.Generator().manual_seed(0)
    special = torch.tensor([0, -0x80000000, 1, -0x7FFFFFFF, 0x7F800000, -0x800000, 0x7FC00000, -0x400000,
                            0x7F800001, 0x7F808000, 0x7FFF8000, 0x7FFFFFFF, -0x7F8000, -1, 0x7F7F8000,
                            0x7F7F7FFF, 0x3F808000, -0x407F8000, 0x3F818000, 0x00008000, 0x0000FFFF],
                           dtype=torch.int32)
    bits = torch.cat([special, torch.randint(-2**31, 2**31, (4133,), generator=g, dtype=torch.int32)])
    x = bits.view(torch.float32)
    n = x.numel()
    halves = torch.randint(-2**15, 2**15, (2, n), generator=g, dtype=torch.int16)  # (weight, remainder) bits
    halves[:, :special.numel()] = special.view(torch.int16).view(-1, 2).t().flip(0)  # the specials' halves
    scratch = {torch.int16: torch.empty(n, dtype=torch.int32), torch.bfloat16: torch.empty(n)}
    for native, eager, dt in ((split, ladder.split_fp32, torch.int16), (kahan_split, ladder.kahan_split, torch.bfloat16)):
        a = [torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=dt)]
        b = [torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=dt)]
        ok = native(x.clone(), *a, lib=lib)
        eager(x.clone(), *b, *([scratch[dt].view(torch.float32)] if dt == torch.bfloat16 else []), native=False)
        if not ok or any(not torch.equal(u.view(torch.int16), v.view(torch.int16)) for u, v in zip(a, b)):
            raise RuntimeError(f"probe: the native {native.__name__} differs from the eager passes")
    hi = halves[0].view(torch.bfloat16)
    for native, eager, dt in ((join, ladder.join_split, torch.int16), (kahan_join, ladder.kahan_join, torch.bfloat16)):
        a, b = torch.empty(n), torch.empty(n)
        ok = native(hi, halves[1].view(dt), a, lib=lib)
        eager(hi, halves[1].view(dt), b, scratch[dt], native=False)
        if not ok or not torch.equal(a.view(torch.int32), b.view(torch.int32)):
            raise RuntimeError(f"probe: the native {native.__name__} differs from the eager passes")


def _ready(lib: Optional[ctypes.CDLL], tensors: tuple[torch.Tensor, ...], dtypes: tuple[torch.dtype, ...]
           ) -> Optional[ctypes.CDLL]:
    """The library when every tensor is a plain contiguous CPU tensor of its dtype and the same size."""
    if lib is None and os.environ.get("AMPKIT_NO_NATIVE", "") not in ("", "0"):
        return None
    n = tensors[0].numel()
    for t, dt in zip(tensors, dtypes):
        if type(t) not in _PLAIN or not t.is_cpu or t.dtype != dt or t.numel() != n or not t.is_contiguous():
            return None
    return library() if lib is None else lib


def split(x: torch.Tensor, hi: torch.Tensor, rem: torch.Tensor, lib: Optional[ctypes.CDLL] = None) -> bool:
    """:func:`.ladder.split_fp32` in one pass (``x`` is left unchanged); False: not done, run the eager one."""
    lib = _ready(lib, (x, hi, rem), (torch.float32, torch.bfloat16, torch.int16))
    if lib is None:
        return False
    lib.ampkit_split(x.data_ptr(), hi.data_ptr(), rem.data_ptr(), x.numel(), _state["nan"])
    return True


def join(hi: torch.Tensor, rem: torch.Tensor, out: torch.Tensor, lib: Optional[ctypes.CDLL] = None) -> bool:
    """:func:`.ladder.join_split` in one pass; False: not done."""
    lib = _ready(lib, (out, hi, rem), (torch.float32, torch.bfloat16, torch.int16))
    if lib is None:
        return False
    lib.ampkit_join(hi.data_ptr(), rem.data_ptr(), out.data_ptr(), out.numel())
    return True


def kahan_split(x: torch.Tensor, hi: torch.Tensor, comp: torch.Tensor, lib: Optional[ctypes.CDLL] = None) -> bool:
    """:func:`.ladder.kahan_split` in one pass (``x`` is left unchanged); False: not done."""
    lib = _ready(lib, (x, hi, comp), (torch.float32, torch.bfloat16, torch.bfloat16))
    if lib is None:
        return False
    lib.ampkit_kahan_split(x.data_ptr(), hi.data_ptr(), comp.data_ptr(), x.numel(), _state["nan"])
    return True


def kahan_join(hi: torch.Tensor, comp: torch.Tensor, out: torch.Tensor, lib: Optional[ctypes.CDLL] = None) -> bool:
    """:func:`.ladder.kahan_join` in one pass; False: not done."""
    lib = _ready(lib, (out, hi, comp), (torch.float32, torch.bfloat16, torch.bfloat16))
    if lib is None:
        return False
    lib.ampkit_kahan_join(hi.data_ptr(), comp.data_ptr(), out.data_ptr(), out.numel())
    return True
