"""A one-pass fused Adam/AdamW step on the memory ladder's own storage (``ampkit_adam`` in
``_bits.c``, built and cached with the other native kernels: :mod:`.native`).

The ladder's generic step (any optimizer) widens each piece's weights and bf16 states into fp32
scratch, calls the user's optimizer, and rounds the result back: three passes over the states and
two over the weights besides the optimizer's own. For ``torch.optim.Adam``/``AdamW`` with
``fused=True`` on the CPU this kernel does all of it in one pass per element: it reads the rung's
weight (``split``: bf16 + int16 remainder; ``stochastic``: bf16; ``fp32``: the master), the fp32
gradient and the states (bf16 or fp32), computes what torch's CPU fused kernel computes
(``aten/src/ATen/native/cpu/FusedAdamKernel.cpp``) and writes the rung's form back -- the split,
the stochastic rounding with the ladder's counter-based stream, or the master and its bf16 copy.

**Bitwise, or not used.** The kernel's arithmetic is torch 2.13's x86-64 build as found by probing
it: its compiler fused ``a * b + c`` into one rounding in places, its vector loop and scalar tail
(the last ``n % vl`` elements of each tensor) differ in one of them, and where two NaNs meet in one
operation the one it returns is fixed per operation. A binary built otherwise could differ, so on
first use :func:`variant` runs the kernel against torch's own ``torch._fused_adam_`` /
``torch._fused_adamw_`` followed by the ladder's eager rounding, on random inputs with tails, ties,
subnormals, infinities and NaNs of distinct payloads in every input, both modes, with and without
weight decay, several step counts and hyper-parameters, on one and two threads, for every (weight
kind, state kind) and each candidate (vector width, how ``1 - lr * weight_decay`` is rounded); the
first candidate equal on every bit of the rung's storage is used, and a kind with none stays on
the generic path (one ``DEBUG`` line on the ``"ampkit"`` logger). ``maximize`` is not covered
(:func:`covers`). ``AMPKIT_NO_NATIVE=1`` turns it off with the other kernels.

**Only where faster.** The library's clones are x86-64-v4 (AVX-512), x86-64-v3 (AVX2 + FMA) and
baseline; it says which one runs (:func:`isa`), and :func:`faster` keeps the generic step where
the kernel measured slower (no FMA instruction: every ``fmaf`` a libm call; fp32 states without
AVX-512; fp32 masters with fp32 states).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Sequence
from typing import Any, Optional

import torch

from ..logs import logger
from . import native
from .pure import eager

__all__ = ["Tensors", "covers", "faster", "isa", "kind", "step", "variant"]


def kind(rung: str) -> Optional[int]:
    """The kernel's number for a rung's weights (``masters``): 0 an fp32 master (+ the model's bf16
    copy), 1 ``split`` (bf16 + int16 remainder), 2 ``stochastic`` (bf16); None: not covered."""
    if rung == "fp32":
        return 0
    if rung == "split":
        return 1
    return 2 if rung == "stochastic" else None


#: candidates tried in order: (torch's float vector width, ``1 - lr * wd`` as one fused multiply-add)
CANDIDATES = ((8, 1), (8, 0), (16, 1), (16, 0))

_lock = threading.Lock()
_found: dict[tuple[int, int], Optional[tuple[int, int]]] = {}
_P, _N = ctypes.c_void_p, ctypes.c_int64
_typed: set[int] = set()
_isa: dict[int, int] = {}  # (by the library's id: asked once)


class Tensors:
    """One kernel call's tensors, flat and contiguous, one entry per (piece of a) weight: ``w`` the
    weight (bf16, or the fp32 master), ``wx`` the remainders (int16, ``split``) or the model's bf16
    weight (``fp32`` masters) or None, ``g`` the fp32 gradient, ``m``/``v`` exp_avg/exp_avg_sq,
    ``hp`` (lr, beta1, beta2, eps, weight_decay, step) and ``flags`` (1: decoupled weight decay,
    AdamW)."""

    def __init__(self) -> None:
        self.w: list[torch.Tensor] = []
        self.wx: list[Optional[torch.Tensor]] = []
        self.g: list[torch.Tensor] = []
        self.m: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.hp: list[float] = []
        self.flags: list[int] = []

    def add(
        self,
        w: torch.Tensor,
        wx: Optional[torch.Tensor],
        g: torch.Tensor,
        m: torch.Tensor,
        v: torch.Tensor,
        hp: Sequence[float],
        flags: int,
    ) -> None:
        self.w.append(w)
        self.wx.append(wx)
        self.g.append(g)
        self.m.append(m)
        self.v.append(v)
        self.hp.extend(float(x) for x in hp)
        self.flags.append(flags)


def variant(wk: int, sk: int) -> Optional[tuple[int, int]]:
    """The (vector width, fused decay) with which the kernel is bitwise torch's fused step followed
    by the ladder's rounding, for weight kind ``wk`` and state kind ``sk`` (probed once); None:
    the kernels are off, or no candidate matched."""
    if os.environ.get("AMPKIT_NO_NATIVE", "") not in ("", "0"):
        return None
    lib = native.library()
    if lib is None:
        return None
    if (wk, sk) not in _found:
        # Stochastic rounding hides a last-bit difference of the fp32 result from a small probe
        # (it shows in 1 of 2**16 roundings): that kind only takes a candidate proven exactly on
        # the deterministic ``split`` weights with the same states.
        proven = None if wk != 2 else tuple(c for c in [variant(1, sk)] if c is not None)
        with _lock:
            if (wk, sk) not in _found:
                try:
                    _found[(wk, sk)] = _probe(lib, wk, sk, proven)
                except Exception as e:  # pragma: no cover - a torch without the fused ops
                    logger.debug("ampkit fused Adam probe failed: %s", e)
                    _found[(wk, sk)] = None
                if _found[(wk, sk)] is None:
                    logger.debug(
                        "ampkit fused Adam kernel (weights %d, states %d) differs from torch's "
                        "fused step here; the ladder keeps its generic step",
                        wk,
                        sk,
                    )
    return _found[(wk, sk)]


def step(
    rung: str,
    state_bf16: bool,
    t: Tensors,
    wofs: Sequence[int],
    sofs: Sequence[int],
    kw: int,
    ks: int,
    threads: Optional[int] = None,
    lib: Optional[ctypes.CDLL] = None,
    var: Optional[tuple[int, int]] = None,
) -> bool:
    """Step every tensor of ``t`` in one call, in place: torch's fused Adam/AdamW arithmetic, the
    weights written back in the rung's form and the states in theirs (bf16: rounded stochastically,
    key ``ks``, exp_avg of tensor s at element ``sofs[s]`` of the stream and exp_avg_sq at ``sofs[s]
    + numel``; ``stochastic`` weights: key ``kw``, from ``wofs[s]``). False: not done (the kernel is
    not in use, or a tensor is not a plain contiguous CPU tensor of its dtype and size); nothing was
    written."""
    wk, sk = kind(rung), int(state_bf16)
    if wk is None:
        return False
    var = var if var is not None else variant(wk, sk)
    lib = lib if lib is not None else native.library()
    if var is None or lib is None:
        return False
    return _run(lib, wk, sk, t, wofs, sofs, kw, ks, var, threads or torch.get_num_threads())


def _checked(wk: int, sk: int, t: Tensors) -> bool:
    wdt = torch.float32 if wk == 0 else torch.bfloat16
    xdt = {0: torch.bfloat16, 1: torch.int16, 2: None}[wk]
    sdt = torch.bfloat16 if sk else torch.float32
    for w, wx, g, m, v in zip(t.w, t.wx, t.g, t.m, t.v):
        n = w.numel()
        if not (_plain(w, wdt) and _plain(g, torch.float32) and _plain(m, sdt) and _plain(v, sdt)):
            return False
        if (wx is None) != (xdt is None) or (wx is not None and not _plain(wx, xdt)):
            return False
        if any(x.numel() != n for x in (g, m, v) + (() if wx is None else (wx,))):
            return False
    return True


def _plain(t: torch.Tensor, dtype: Optional[torch.dtype]) -> bool:
    return native.plain(t, dtype) if dtype is not None else False


def _call(
    lib: ctypes.CDLL,
    wk: int,
    sk: int,
    t: Tensors,
    wofs: Sequence[int],
    sofs: Sequence[int],
    kw: int,
    ks: int,
    var: tuple[int, int],
    nt: int,
) -> None:
    fn = lib.ampkit_adam
    if id(lib) not in _typed:  # (first use of this library: the signature)
        fn.argtypes = [
            _N,
            ctypes.POINTER(_N),
            *[ctypes.POINTER(_P)] * 5,
            ctypes.POINTER(ctypes.c_double),
            ctypes.POINTER(ctypes.c_int32),
            *[ctypes.POINTER(_N)] * 2,
            *[ctypes.c_int32] * 2,
            *[ctypes.c_uint64] * 2,
            *[ctypes.c_int32] * 2,
            ctypes.c_uint16,
            ctypes.c_int,
        ]
        fn.restype = None
        _typed.add(id(lib))
    k = len(t.w)
    ptrs = _P * k
    fn(
        k,
        (_N * k)(*[w.numel() for w in t.w]),
        ptrs(*[w.data_ptr() for w in t.w]),
        ptrs(*[None if x is None else x.data_ptr() for x in t.wx]),
        ptrs(*[g.data_ptr() for g in t.g]),
        ptrs(*[m.data_ptr() for m in t.m]),
        ptrs(*[v.data_ptr() for v in t.v]),
        (ctypes.c_double * len(t.hp))(*t.hp),
        (ctypes.c_int32 * k)(*t.flags),
        (_N * k)(*wofs),
        (_N * k)(*sofs),
        wk,
        sk,
        kw,
        ks,
        var[0],
        var[1],
        native.nan_bits(),
        nt,
    )


# ---------------------------------------------------------------------------------- the probe
def _configs() -> list[tuple[bool, bool, float, float, float, float, float, float]]:
    """(adamw, maximize, lr, beta1, beta2, eps, weight_decay, step): both modes, with and without
    weight decay and maximize, a small and a large lerp weight (1 - beta1 below / above 0.5), the
    first step and later ones, and a decay that tells the two roundings of ``1 - lr * wd`` apart."""
    out = []
    for adamw in (True, False):
        for maximize in (False,):  # (maximize: the generic step, :func:`covers`)
            for wd, b1, step in (
                (0.0, 0.9, 1.0),
                (0.1, 0.9, 7.0),
                (3.0, 0.3, 1000.0),
                (0.01, 0.0, 2.0),
            ):
                out.append(
                    (adamw, maximize, 1e-3 if step != 7.0 else 0.37, b1, 0.999, 1e-8, wd, step)
                )
    # lr 0 (AdamW's decay by exactly 1), the lerp weight 1 - beta1 at 0.5 (torch's large-weight
    # form), beta2 near 1, and a step count whose bias corrections are 1 (Adam's coupled decay)
    out.append((True, False, 0.0, 0.5, 0.99999, 1e-8, 0.1, 3.0))
    out.append((False, False, 1e-3, 0.9, 0.99999, 1e-6, 0.01, 1e6))
    # A pair for which ``1 - lr * wd`` rounds to another float with one fused multiply-add than
    # with two roundings (1 - 2**-24 vs 1.0): it tells the decay's candidates apart.
    out.append((True, False, 2.0**-25 * (1 + 2.0**-30), 0.9, 0.999, 1e-8, 1 + 2.0**-30, 3.0))
    return out


def _inputs(wk: int, sk: int, sizes: Sequence[int], seed: int) -> dict[str, list[Any]]:
    """Random rung storage, gradients and states with edge values among them."""
    g = torch.Generator().manual_seed(seed)
    special = torch.tensor(
        [0.0, -0.0, 1e-40, -3e-39, 1e-45, float("inf"), -float("inf"), float("nan"), 3.4e38, 1.0],
        dtype=torch.float32,
    )
    out: dict[str, list[Any]] = {k: [] for k in ("w", "wx", "g", "m", "v")}
    for n in sizes:
        x = torch.randn(n, generator=g, dtype=torch.float32)
        grad = (
            torch.randn(n, generator=g, dtype=torch.float32)
            * 10.0 ** torch.randint(-7, 3, (n,), generator=g).float()
        )
        m = torch.randn(n, generator=g, dtype=torch.float32) * 0.05
        v = torch.rand(n, generator=g, dtype=torch.float32) * 1e-3
        # a tensor of 2048 or more: its first 1024 elements finite (the kernel's blocks without a
        # non-finite input take a faster loop), the specials in the rest
        edge = torch.arange(n) >= (1024 if n >= 2048 else 0)
        for tag, t in enumerate((x, grad, m, v)):
            pick = (torch.rand(n, generator=g) < 0.08) & edge
            t[pick] = special[torch.randint(0, len(special), (int(pick.sum()),), generator=g)]
            # NaNs of distinct payloads (tagged by input), quiet and signalling, both signs: where
            # two meet, which one survives is the order of torch's operands
            nans = torch.randint(0, 1 << 20, (n,), generator=g, dtype=torch.int32) * 4 + tag
            nans |= 0x7F800001 | torch.randint(0, 2, (n,), generator=g, dtype=torch.int32) << 31
            pick = (torch.rand(n, generator=g) < 0.1) & edge
            t[pick] = nans.view(torch.float32)[pick]
        v[v < 0] = 0.25
        # quiet NaNs with every mantissa bit above the low half set: ``split`` stores them as a
        # weight of +-0 or -0 (0x8000) and a negative remainder (the fast loop must not take them)
        hidden = torch.tensor([0x7FFFFFFF, -32767, 0x7FFF8000, -1], dtype=torch.int32)
        pick = (torch.rand(n, generator=g) < 0.02) & edge
        x[pick] = hidden.view(torch.float32)[torch.randint(0, 4, (int(pick.sum()),), generator=g)]
        v[torch.rand(n, generator=g) < 0.03] = 1e-42
        if wk == 0:
            out["w"].append(x)
            out["wx"].append(x.to(torch.bfloat16))
        elif wk == 1:
            hi, rem = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.int16)
            eager.split_fp32(x.clone(), hi, rem)
            out["w"].append(hi)
            out["wx"].append(rem)
        else:
            out["w"].append(x.to(torch.bfloat16))
            out["wx"].append(None)
        out["g"].append(grad)
        out["m"].append(m.to(torch.bfloat16) if sk else m)
        out["v"].append(v.to(torch.bfloat16) if sk else v)
    return out


def _generic(wk: int, sk: int, d: dict[str, list[Any]], cfg: tuple, kw: int, ks: int) -> list[Any]:
    """The ladder's generic path on ``d`` (copies): widen, torch's fused step, round back."""
    adamw, maximize, lr, b1, b2, eps, wd, step = cfg
    ps, ms, vs = [], [], []
    for w, wx, m, v in zip(d["w"], d["wx"], d["m"], d["v"]):
        if wk == 0:
            ps.append(w.clone())
        elif wk == 1:
            ps.append(eager.join_split(w, wx, torch.empty(w.numel(), dtype=torch.float32)))
        else:
            ps.append(w.float())
        ms.append(m.float() if sk else m.clone())
        vs.append(v.float() if sk else v.clone())
    fn = torch._fused_adamw_ if adamw else torch._fused_adam_
    fn(
        ps,
        [g.clone() for g in d["g"]],
        ms,
        vs,
        [],
        [torch.tensor(step, dtype=torch.float32) for _ in ps],
        lr=lr,
        beta1=b1,
        beta2=b2,
        weight_decay=wd,
        eps=eps,
        amsgrad=False,
        maximize=maximize,
    )
    out: list[Any] = []
    start = 0
    for p in ps:
        if wk == 0:
            out += [p, p.to(torch.bfloat16)]
        elif wk == 1:
            hi, rem = (
                torch.empty(p.numel(), dtype=torch.bfloat16),
                torch.empty_like(p, dtype=torch.int16),
            )
            eager.split_fp32(p.clone(), hi, rem)
            out += [hi, rem]
        else:
            hi = torch.empty(p.numel(), dtype=torch.bfloat16)
            eager.stochastic_round(p.clone(), hi, kw, start)
            out.append(hi)
        start += p.numel()
    start = 0
    for m, v in zip(ms, vs):
        for s in (m, v):
            if sk:
                o = torch.empty(s.numel(), dtype=torch.bfloat16)
                eager.stochastic_round(s.clone(), o, ks, start)
                out.append(o)
                start += s.numel()
            else:
                out.append(s)
    return out


def _fused(
    lib: ctypes.CDLL,
    wk: int,
    sk: int,
    d: dict[str, list[Any]],
    cfg: tuple,
    kw: int,
    ks: int,
    var: tuple[int, int],
    nt: int,
) -> list[Any]:
    adamw, maximize, lr, b1, b2, eps, wd, step = cfg
    t = Tensors()
    c = {k: [x.clone() if x is not None else None for x in d[k]] for k in d}
    for w, wx, g, m, v in zip(c["w"], c["wx"], c["g"], c["m"], c["v"]):
        t.add(w, wx, g, m, v, (lr, b1, b2, eps, wd, step), int(adamw))
    ns = [w.numel() for w in t.w]
    wofs = [sum(ns[:i]) for i in range(len(ns))]
    if not _run(lib, wk, sk, t, wofs, [2 * o for o in wofs], kw, ks, var, nt):
        raise RuntimeError("probe: the fused Adam kernel refused its own inputs")
    out: list[Any] = []
    for w, wx in zip(t.w, t.wx):
        out += [w] if wx is None else [w, wx]
    for m, v in zip(t.m, t.v):
        out += [m, v]
    return out


def _run(
    lib: ctypes.CDLL,
    wk: int,
    sk: int,
    t: Tensors,
    wofs: Sequence[int],
    sofs: Sequence[int],
    kw: int,
    ks: int,
    var: tuple[int, int],
    nt: int,
) -> bool:
    """:func:`step` by kind numbers, with a given library and candidate; False: a tensor does not
    qualify (nothing written)."""
    if not _checked(wk, sk, t):
        return False
    _call(lib, wk, sk, t, wofs, sofs, kw, ks, var, nt)
    return True


def covers(rung: str, state_bf16: bool, maximize: bool) -> bool:
    """Whether the fused step runs for this rung and option here (loaded, probed, covered, and
    :func:`faster` than the generic step on this CPU). Not with ``maximize``: there torch's
    compiler folded the negated gradient into later operations differently in each of its loops
    (which sign a NaN or a zero ends with), which this kernel does not follow."""
    wk = kind(rung)
    if wk is None or maximize:
        return False
    lib = native.library() if variant(wk, int(state_bf16)) is not None else None
    return lib is not None and faster(wk, int(state_bf16), isa(lib))


def isa(lib: ctypes.CDLL) -> int:
    """Which of the kernel's loops runs on this CPU (``ampkit_adam_isa``): 2 its x86-64-v4
    (AVX-512) clone, 1 x86-64-v3 (AVX2 + FMA), 0 one without a fused multiply-add instruction."""
    if id(lib) not in _isa:
        fn = lib.ampkit_adam_isa
        fn.argtypes, fn.restype = [], ctypes.c_int
        _isa[id(lib)] = int(fn())
    return _isa[id(lib)]


def faster(wk: int, sk: int, level: int) -> bool:
    """Whether the kernel (weight kind ``wk``, state kind ``sk``) beats the generic step with loops
    of ISA ``level`` (:func:`isa`), as measured, one thread, 1M-element pieces (docs/benchmarks.md,
    "Fused Adam without AVX-512"): never without a fused multiply-add instruction (each ``fmaf`` a
    libm call: 2-7x slower); with AVX2 + FMA only with bf16 states (0.7-0.85x the generic step;
    fp32 states 1.05-1.1x); with AVX-512 every kind but fp32 masters with fp32 states (there the
    generic step is torch's own kernel on the masters and a bf16 copy: 1.1-1.3x)."""
    if level <= 0:
        return False
    if sk == 1:
        return True
    return level >= 2 and wk != 0


def _probe(
    lib: ctypes.CDLL, wk: int, sk: int, candidates: Optional[Sequence[tuple[int, int]]] = None
) -> Optional[tuple[int, int]]:
    """The first of ``candidates`` (default :data:`CANDIDATES`) bitwise equal to the generic path
    on every config, or None."""
    left = list(CANDIDATES if candidates is None else candidates)
    if not left:
        return None
    sizes = [1, 5, 7, 8, 9, 15, 16, 17, 23, 31, 33, 100, 1029, 2053]
    keys = (0x0123456789ABCDEF, 0x7FFFFFFFFFFFFFFF)
    for i, cfg in enumerate(_configs()):
        d = _inputs(wk, sk, sizes, 100 * wk + 10 * sk + i)
        want = _generic(wk, sk, d, cfg, *keys)
        left = [c for c in left if _same(_fused(lib, wk, sk, d, cfg, *keys, c, 1), want)]
        if not left:
            return None
    # the threaded path (one tensor cut between two threads, a tail at its end)
    d = _inputs(wk, sk, [3, 70_001], 7)
    cfg = _configs()[1]
    want = _generic(wk, sk, d, cfg, *keys)
    left = [c for c in left if _same(_fused(lib, wk, sk, d, cfg, *keys, c, 2), want)]
    return left[0] if left else None


def _same(a: Sequence[torch.Tensor], b: Sequence[torch.Tensor]) -> bool:
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        it = torch.int32 if x.element_size() == 4 else torch.int16
        if x.dtype != y.dtype or not torch.equal(x.view(it), y.view(it)):
            return False
    return True
