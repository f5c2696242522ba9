"""One-pass native kernels for the ``split`` and ``kahan`` rungs and for stochastic rounding
(``_bits.c`` beside this file).

The eager functions of :mod:`.pure.eager` (``split_fp32``, ``join_split``, ``kahan_split``,
``kahan_join``) make 3--4 element-wise passes each; these kernels make one, bitwise the same, over
every tensor of a step's chunk in one call (:func:`compact`, :func:`expand`; :func:`stochastic`:
:func:`.pure.eager.stochastic_round` with its counter-based random bits), cut into one slice per
thread of torch's intra-op pool: built with ``-fopenmp``, the library's ``libgomp.so.1`` is the one
torch's Linux wheels already loaded, so the kernels run on torch's own threads (a compiler without
OpenMP: the same kernels on one thread; :func:`threads` says which). The
C source has no torch headers: on first use it is compiled with the system C compiler (``$CC``,
else Python's ``sysconfig`` ``CC``, else ``cc``) in about two seconds into a per-user cache
(``native/`` under ``$AMPKIT_CACHE_DIR``, default ``~/.cache/ampkit``; the file name is a hash of
the source, compiler, flags and platform; written to a temporary file and renamed, so concurrent
processes are safe), loaded with ctypes and checked bitwise against the eager functions on a probe
of edge cases (NaNs, infinities, ties, subnormals, random bits; :mod:`.native_probe`). Beside each library a record
``<name>.sha256`` (``<sha256>  <size>``) is written, atomically, once the library is complete; the
library is loaded only when its size and SHA-256 match the record: a damaged cache file (truncated:
``dlopen`` would map pages past its end, and touching them kills the process with SIGBUS; a flipped
byte: any behaviour) is reported with a ``WARNING`` naming it and rebuilt, a file without a record
(built before ampkit recorded them, or a build interrupted between the two renames) is rebuilt
quietly. Builders in several processes take turns (an ``flock`` on ``native/.lock``). On x86-64
Linux the kernels are built twice (AVX2 and baseline; the loader picks one for the CPU), so a
shared cache stays safe.

NaNs: torch's fp32 -> bf16 copy gives every NaN one bit pattern that depends on the layout (here
0xFFFF when contiguous, 0x7FC0 when strided); the kernels take the contiguous one, read from torch
at load time, as they only ever replace contiguous passes.

The fused Adam/AdamW step of the ladder is in the same library, with its own wrapper and check
(:mod:`.native_adam`).

Each wrapper returns ``True`` when it did the work and ``False`` when the caller must run the eager
passes: ``AMPKIT_NO_NATIVE=1``, no compiler, a failed compile or probe (one ``DEBUG`` line on the
``"ampkit"`` logger), a tensor not on the CPU, not contiguous, a subclass (fake tensors of
``ampkit plan``) or of another dtype.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import fcntl
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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Optional

import torch

from ..logs import logger

__all__ = [
    "FLAGS",
    "OPENMP",
    "SOURCE",
    "cache_dir",
    "compact",
    "enabled",
    "expand",
    "join",
    "kahan_join",
    "kahan_split",
    "library",
    "nan_bits",
    "plain",
    "split",
    "stochastic",
    "threads",
]

SOURCE = Path(__file__).with_name("_bits.c")
#: no -ffast-math (the kernels are bitwise IEEE); -ffp-contract=off keeps x - h and h + c unfused (the
#: fused Adam kernel writes its fused multiply-adds as fmaf); -fno-math-errno lets sqrtf vectorize
#: (it only drops errno, never a value)
FLAGS = ("-O3", "-std=c99", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno")
#: tried first: the kernels on torch's OpenMP threads (a compiler without OpenMP: FLAGS alone, one thread)
OPENMP = ("-fopenmp",)
#: tried after: a compiler that rejects the ``target_clones`` targets (GCC before 11, older clang)
NO_CLONES = ("-DAMPKIT_NO_CLONES",)

_PLAIN = (
    torch.Tensor,
    torch.nn.Parameter,
)  # not subclasses: fake tensors (``ampkit plan``) have no data
_lock = threading.Lock()
_state: dict[
    str, Any
] = {}  # "lib": the loaded library or None once tried; "nan": torch's bf16 NaN bits


def cache_dir() -> Path:
    """Where compiled kernels are kept (per user; the auto-precision cache's directory)."""
    return Path(
        os.environ.get("AMPKIT_CACHE_DIR")
        or os.path.join(os.path.expanduser("~"), ".cache", "ampkit")
    )


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
                    logger.debug(
                        "ampkit native ladder kernels unavailable, using the eager passes: %s", e
                    )
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
    errors = []
    for flags in (FLAGS + OPENMP, FLAGS + OPENMP + NO_CLONES, FLAGS, FLAGS + NO_CLONES):
        try:
            out = _build(cc, src, flags)
            break
        except RuntimeError as e:
            errors.append(str(e))
    else:
        raise RuntimeError("; ".join(errors))
    lib = ctypes.CDLL(str(out))
    p, n = ctypes.c_void_p, ctypes.c_int64
    many = [
        n,
        ctypes.POINTER(n),
        p,
        ctypes.POINTER(p),
        ctypes.POINTER(p),
    ]  # k, sizes, fp32 run, halves, extras
    for name, extra in (
        ("split", [ctypes.c_uint16]),
        ("join", []),
        ("kahan_split", [ctypes.c_uint16]),
        ("kahan_join", []),
    ):
        fn = getattr(lib, f"ampkit_{name}")
        fn.argtypes, fn.restype = [*many, *extra, ctypes.c_int], None
    lib.ampkit_stochastic.argtypes = [
        n,
        ctypes.POINTER(n),
        ctypes.POINTER(p),
        ctypes.POINTER(p),
        ctypes.c_uint64,
        ctypes.c_uint16,
        ctypes.c_int,
    ]
    lib.ampkit_stochastic.restype = None
    lib.ampkit_openmp.argtypes, lib.ampkit_openmp.restype = [], ctypes.c_int
    lib.ampkit_nonfinite.argtypes = [n, p, ctypes.c_int]  # k, the packed array's address, threads
    lib.ampkit_nonfinite.restype = ctypes.c_int
    nan = (
        torch.tensor([float("nan")], dtype=torch.float32)
        .to(torch.bfloat16)
        .view(torch.int16)
        .item()
        & 0xFFFF
    )
    _state["nan"] = nan
    from .native_probe import probe  # (a first load only)

    probe(lib, nan, sys.modules[__name__])
    return lib


def _build(cc: list[str], src: bytes, flags: tuple[str, ...]) -> Path:
    """The compiled library for these flags: the cached one when it matches its record, else
    compiled now (a damaged cached one reported and replaced)."""
    key = hashlib.sha256(
        b"\0".join(
            [
                src,
                *(a.encode() for a in cc + list(flags)),
                platform.machine().encode(),
                sys.platform.encode(),
            ]
        )
    ).hexdigest()[:20]
    out = cache_dir() / "native" / f"ladder-bits-{key}.so"
    if _damage(out) is None:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _locked(out.parent / ".lock"):
        damage = _damage(out)  # another process may have built it while this one waited
        if damage is None:
            return out
        if damage != "missing":
            (logger.info if damage.startswith("has no record") else logger.warning)(
                "ampkit native kernels: the cached library %s %s; rebuilding it", out, damage
            )
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".so", dir=out.parent)
        os.close(fd)
        try:
            r = subprocess.run(
                [*cc, *flags, "-o", tmp, str(SOURCE), "-lm"],
                capture_output=True,
                text=True,
                timeout=120,
            )
            if r.returncode != 0:
                raise RuntimeError(
                    f"{' '.join(cc + list(flags))} failed: {r.stderr.strip()[-500:]}"
                )
            record = f"{_sha256(tmp)}  {os.path.getsize(tmp)}\n"
            # atomic: a process that mapped the old file keeps it; the next one reads the whole file
            os.replace(tmp, out)
            _write(_record(out), record)  # after the library: it always describes a complete file
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    if (damage := _damage(out)) is not None:
        raise RuntimeError(f"the library {out} just built {damage}")
    return out


def _record(lib: Path) -> Path:
    return lib.with_name(lib.name + ".sha256")


def _sha256(path: Any) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _damage(lib: Path) -> Optional[str]:
    """None when ``lib`` matches its record (size, then SHA-256); else what is wrong, in words."""
    if not lib.exists():
        return "missing"
    try:
        want_sha, want_size = _record(lib).read_text().split()
        size = lib.stat().st_size
    except FileNotFoundError:
        return "has no record of its size and digest beside it"
    except (OSError, ValueError, UnicodeDecodeError):
        return f"has a damaged record ({_record(lib).name})"
    if str(size) != want_size:
        return f"is damaged: {size} bytes where its record says {want_size}"
    if _sha256(lib) != want_sha:
        return "is damaged: its SHA-256 does not match its record"
    return None


def _write(path: Path, text: str) -> None:
    """``text`` to ``path`` through a unique temporary file and a rename."""
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path`` (builders in several processes take turns; the kernel
    drops it when a process dies)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def threads() -> int:
    """How many threads a large kernel call uses: torch's intra-op count where the kernels were built
    with OpenMP, else 1."""
    lib = library()
    return torch.get_num_threads() if lib is not None and lib.ampkit_openmp() else 1


#: the ``split`` / ``kahan`` rungs' extra tensor dtype
EXTRA = {"split": torch.int16, "kahan": torch.bfloat16}
#: the finite check's element widths (fp32 0, bf16 1, fp16 2, fp64 3)
WIDTH = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}


def any_nonfinite(
    tensors: Sequence[torch.Tensor],
    lib: Optional[ctypes.CDLL] = None,
    threads: Optional[int] = None,
) -> Optional[bool]:
    """Whether any element of ``tensors`` (plain contiguous CPU tensors, fp32/bf16/fp16/fp64) is inf
    or NaN, every tensor read once in one C call (the CPU finite check, :func:`ampkit.step.gradcheck.
    cpu_all_finite`); ``threads`` > 1 cuts it into one slice per OpenMP thread (from 65536 elements
    in all). The default is 1: split over torch's 2 threads the step measured no faster (within
    noise), and on a loaded machine a parallel region waits for a descheduled thread (median 28 ms
    vs 0.2 ms; docs/benchmarks.md, "Step overhead (issue 34 section 6), follow-up"). None where the
    kernels are not in use or a tensor does not qualify. No sync (the CPU is the device)."""
    if lib is None:
        if os.environ.get("AMPKIT_NO_NATIVE", "") not in ("", "0"):
            return None
        lib = library()
        if lib is None:
            return None
    ns, ptrs, widths = [], [], []
    try:
        for t in tensors:  # (one loop, no comprehensions: this runs every step)
            w = WIDTH.get(t.dtype)
            if w is None or type(t) not in _PLAIN or not t.is_cpu or not t.is_contiguous():
                return None
            ns.append(t.numel())
            ptrs.append(t.data_ptr())
            widths.append(w)
    except RuntimeError:  # a sparse tensor has no is_contiguous()
        return None
    packed = array.array("q", ns + ptrs + widths)  # the C call's one array: sizes, addresses, widths
    return bool(lib.ampkit_nonfinite(len(ns), packed.buffer_info()[0], threads or 1))


def _args(
    lib: Optional[ctypes.CDLL],
    rung: str,
    fp32: torch.Tensor,
    his: Sequence[torch.Tensor],
    extras: Sequence[torch.Tensor],
) -> Optional[tuple[ctypes.CDLL, tuple[Any, ...]]]:
    """The library and the leading arguments of a kernel call, or None: not every tensor is a plain
    contiguous CPU tensor of its dtype, or ``fp32``'s size is not the halves' sizes summed."""
    if lib is None and os.environ.get("AMPKIT_NO_NATIVE", "") not in ("", "0"):
        return None
    k, extra = len(his), EXTRA[rung]
    if len(extras) != k or not plain(fp32, torch.float32):
        return None
    ns = []
    for h, e in zip(his, extras):
        if not (plain(h, torch.bfloat16) and plain(e, extra)) or e.numel() != h.numel():
            return None
        ns.append(h.numel())
    if sum(ns) != fp32.numel():
        return None
    lib = library() if lib is None else lib
    if lib is None:
        return None
    ptrs = ctypes.c_void_p * k
    return lib, (
        k,
        (ctypes.c_int64 * k)(*ns),
        fp32.data_ptr(),
        ptrs(*[h.data_ptr() for h in his]),
        ptrs(*[e.data_ptr() for e in extras]),
    )


def plain(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether ``t`` is a plain (not a subclass) contiguous CPU tensor of ``dtype``: what the
    kernels take."""
    return type(t) in _PLAIN and t.dtype == dtype and t.is_cpu and t.is_contiguous()


def nan_bits() -> int:
    """The bf16 bits torch's contiguous fp32 -> bf16 copy gives a NaN (read when the kernels load)."""
    return int(_state["nan"])


def compact(
    rung: str,
    x: torch.Tensor,
    his: Sequence[torch.Tensor],
    extras: Sequence[torch.Tensor],
    lib: Optional[ctypes.CDLL] = None,
    threads: Optional[int] = None,
) -> bool:
    """fp32 ``x`` (the tensors' values back to back) into each bf16 weight of ``his`` and its remainder
    (``rung="split"``, int16) or compensation (``"kahan"``, bf16) in ``extras``: :func:`.pure.eager.split_fp32`
    / :func:`.pure.eager.kahan_split` of every tensor in one call, on torch's intra-op threads (``x`` is
    left unchanged; ``threads``: how many, default torch's count). False: not done, run the eager passes."""
    got = _args(lib, rung, x, his, extras)
    if got is None:
        return False
    fn = got[0].ampkit_split if rung == "split" else got[0].ampkit_kahan_split
    fn(*got[1], _state["nan"], threads or torch.get_num_threads())
    return True


def expand(
    rung: str,
    his: Sequence[torch.Tensor],
    extras: Sequence[torch.Tensor],
    out: torch.Tensor,
    lib: Optional[ctypes.CDLL] = None,
    threads: Optional[int] = None,
) -> bool:
    """The fp32 values of each (weight, extra) pair back to back into contiguous ``out``:
    :func:`.pure.eager.join_split` / :func:`.pure.eager.kahan_join` of every tensor in one call. False: not done."""
    got = _args(lib, rung, out, his, extras)
    if got is None:
        return False
    fn = got[0].ampkit_join if rung == "split" else got[0].ampkit_kahan_join
    fn(*got[1], threads or torch.get_num_threads())
    return True


def split(
    x: torch.Tensor, hi: torch.Tensor, rem: torch.Tensor, lib: Optional[ctypes.CDLL] = None
) -> bool:
    """:func:`.pure.eager.split_fp32` in one pass (``x`` is left unchanged); False: not done, run the eager one."""
    return compact("split", x, [hi], [rem], lib)


def join(
    hi: torch.Tensor, rem: torch.Tensor, out: torch.Tensor, lib: Optional[ctypes.CDLL] = None
) -> bool:
    """:func:`.pure.eager.join_split` in one pass; False: not done."""
    return expand("split", [hi], [rem], out, lib)


def kahan_split(
    x: torch.Tensor, hi: torch.Tensor, comp: torch.Tensor, lib: Optional[ctypes.CDLL] = None
) -> bool:
    """:func:`.pure.eager.kahan_split` in one pass (``x`` is left unchanged); False: not done."""
    return compact("kahan", x, [hi], [comp], lib)


def kahan_join(
    hi: torch.Tensor, comp: torch.Tensor, out: torch.Tensor, lib: Optional[ctypes.CDLL] = None
) -> bool:
    """:func:`.pure.eager.kahan_join` in one pass; False: not done."""
    return expand("kahan", [hi], [comp], out, lib)


def stochastic(
    xs: Sequence[torch.Tensor],
    outs: Sequence[torch.Tensor],
    key: int,
    lib: Optional[ctypes.CDLL] = None,
    threads: Optional[int] = None,
) -> bool:
    """Each fp32 tensor of ``xs`` rounded stochastically into the bf16 tensor of ``outs`` of its size:
    :func:`.pure.eager.stochastic_round` keyed by ``key`` (an int in [0, 2**64)), the element counter
    running across the tensors in order, in one call on torch's intra-op threads (``xs`` left
    unchanged). False: not done (a tensor not plain, contiguous, on the CPU or of its dtype)."""
    if lib is None and os.environ.get("AMPKIT_NO_NATIVE", "") not in ("", "0"):
        return False
    k = len(xs)
    if len(outs) != k:
        return False
    for x, o in zip(xs, outs):
        if not (plain(x, torch.float32) and plain(o, torch.bfloat16)) or x.numel() != o.numel():
            return False
    lib = library() if lib is None else lib
    if lib is None:
        return False
    ptrs = ctypes.c_void_p * k
    lib.ampkit_stochastic(
        k,
        (ctypes.c_int64 * k)(*[x.numel() for x in xs]),
        ptrs(*[x.data_ptr() for x in xs]),
        ptrs(*[o.data_ptr() for o in outs]),
        key,
        _state["nan"],
        threads or torch.get_num_threads(),
    )
    return True
