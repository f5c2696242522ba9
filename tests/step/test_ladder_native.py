"""The native one-pass kernels of the split/kahan rungs (step/policies/native.py, _bits.c): bitwise
the eager passes of ladder.py, and the silent fallback to them."""

from __future__ import annotations

import copy
import logging
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from ampkit import MixedPrecision
from ampkit.step.policies import native
from ampkit.step.policies.pure.rounding import (
    BLOCK,
    join_split,
    kahan_join,
    kahan_split,
    split_fp32,
)

needs_native = pytest.mark.skipif(
    not native.enabled(), reason="native kernels off (no C compiler, or AMPKIT_NO_NATIVE=1)"
)

SIZES = [0, 1, 3, 7, 8, 15, 16, 17, 31, 33, 255, 1000, BLOCK + 13]
# zeros, the smallest subnormals, the largest subnormal, ties (x.5 in bf16 units) of both signs and
# parities, one below / above a tie, bf16's max and the tie above it (rounds to inf), infinities,
# NaNs: quiet/signalling, both signs, a low half >= 0x8000 (0x7FFF8000 + 0x8000 wraps to -0.0)
SPECIAL = [
    0x00000000,
    -0x80000000,
    0x00000001,
    -0x7FFFFFFF,
    0x007FFFFF,
    0x3F808000,
    0x3F818000,
    -0x407F8000,
    -0x407E8000,
    0x3F807FFF,
    0x3F808001,
    0x7F7F0000,
    0x7F7F7FFF,
    0x7F7F8000,
    0x7F7FFFFF,
    0x7F800000,
    -0x800000,
    0x7FC00000,
    -0x400000,
    0x7F800001,
    0x7F808000,
    0x7FBF8000,
    0x7FFF8000,
    0x7FFFFFFF,
    -0x7F8000,
    -0x8000,
    -1,
    0x00008000,
    0x0000FFFF,
    0x00018000,
]


def _fp32_bits(n: int, seed: int) -> torch.Tensor:
    """fp32 values of every kind: random bits (NaNs and subnormals among them), random normals, the specials."""
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31, (n,), generator=g, dtype=torch.int32)
    normal = (torch.randn(n, generator=g) * 1e-2).view(torch.int32)
    bits = torch.where(torch.rand(n, generator=g) < 0.5, bits, normal)
    special = torch.tensor(SPECIAL, dtype=torch.int32)
    k = min(n, special.numel())
    if k:
        bits[torch.randperm(n, generator=g)[:k]] = special[
            torch.randperm(special.numel(), generator=g)[:k]
        ]
    return bits.view(torch.float32)


def _halves(n: int, seed: int) -> torch.Tensor:
    """(2, n) int16: random bits for a weight and its remainder/compensation, some of them the specials'."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randint(-(2**15), 2**15, (2, n), generator=g, dtype=torch.int16)
    pairs = (
        torch.tensor(SPECIAL, dtype=torch.int32).view(torch.int16).view(-1, 2)
    )  # (low, high) per value
    k = min(n, pairs.shape[0])
    h[0, :k], h[1, :k] = pairs[:k, 1], pairs[:k, 0]
    h[0, k : 2 * k] = pairs[: min(k, max(n - k, 0)), 1]  # special weights beside random remainders
    return h


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(
        a.view(torch.int16 if a.element_size() == 2 else torch.int32),
        b.view(torch.int16 if b.element_size() == 2 else torch.int32),
    )


@needs_native
@pytest.mark.parametrize("n", SIZES)
def test_split_and_kahan_split_are_bitwise_the_eager_passes(n: int) -> None:
    x = _fp32_bits(n, seed=n)
    for fn, extra_dtype, scratch in (
        (split_fp32, torch.int16, ()),
        (kahan_split, torch.bfloat16, (torch.empty(n),)),
    ):
        fast = [torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=extra_dtype)]
        slow = [torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=extra_dtype)]
        fn(x.clone(), *fast, *scratch)
        fn(x.clone(), *slow, *scratch, native=False)
        assert _same(fast[0], slow[0]) and _same(fast[1], slow[1]), fn.__name__


@needs_native
@pytest.mark.parametrize("n", SIZES)
def test_join_and_kahan_join_are_bitwise_the_eager_passes(n: int) -> None:
    h = _halves(n, seed=n + 1)
    hi = h[0].view(torch.bfloat16)
    for fn, extra, scratch in (
        (join_split, h[1], torch.int32),
        (kahan_join, h[1].view(torch.bfloat16), torch.float32),
    ):
        fast = fn(hi, extra, torch.empty(n), torch.empty(n, dtype=scratch))
        slow = fn(hi, extra, torch.empty(n), torch.empty(n, dtype=scratch), native=False)
        assert _same(fast, slow), fn.__name__


@needs_native
def test_split_round_trip_and_nan_quirk_match_eager() -> None:
    """A NaN whose low half is >= 0x8000 does not come back (its weight rounds past the NaN range):
    the native split gives the same bits as the eager one, and the join the same value back."""
    x = torch.tensor([0x7FFF8000, -0x8000, 0x7F808000, 0x7FC01234], dtype=torch.int32).view(
        torch.float32
    )
    out = []
    for nat in (True, False):
        hi, rem = torch.empty(4, dtype=torch.bfloat16), torch.empty(4, dtype=torch.int16)
        split_fp32(x.clone(), hi, rem, native=nat)
        out.append((hi, rem, join_split(hi, rem, torch.empty(4), native=nat)))
    for a, b in zip(*out):
        assert _same(a, b)
    assert out[0][0].view(torch.int16)[:2].tolist() == [
        -0x8000,
        0,
    ]  # -0.0 and +0.0: the wrap of the quirk


@needs_native
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("rung", ["split", "kahan"])
def test_many_tensors_in_one_call_on_several_threads_are_bitwise_the_eager_passes(
    rung: str, threads: int
) -> None:
    """One call over several tensors (empty ones, odd sizes, one cut between threads: the slices are
    16-element aligned, the tensors are not) gives each tensor's eager bits, whatever the thread count."""
    sizes = [0, 5, 65536 + 7, 0, 1, 33, 3 * 65536 + 11, 2]
    n = sum(sizes)
    x, h = _fp32_bits(n, seed=threads), _halves(n, seed=threads + 7)
    dt = torch.int16 if rung == "split" else torch.bfloat16
    eager_split, eager_join = (
        (split_fp32, join_split) if rung == "split" else (kahan_split, kahan_join)
    )
    want = [torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=dt)]
    eager_split(x.clone(), *want, *([torch.empty(n)] if rung == "kahan" else []), native=False)
    got = [
        [torch.empty(k, dtype=torch.bfloat16) for k in sizes],
        [torch.empty(k, dtype=dt) for k in sizes],
    ]
    x0 = x.clone()
    assert native.compact(rung, x, *got, threads=threads)
    assert _same(x, x0)  # the fp32 run is read only
    assert _same(torch.cat(got[0]), want[0]) and _same(torch.cat(got[1]), want[1])
    hi, extra = h[0].view(torch.bfloat16), h[1].view(dt)
    joined = eager_join(
        hi,
        extra,
        torch.empty(n),
        torch.empty(n, dtype=torch.int32 if rung == "split" else torch.float32),
        native=False,
    )
    out = torch.full((n,), 7.0)
    assert native.expand(
        rung, list(hi.split(sizes)), list(extra.split(sizes)), out, threads=threads
    )
    assert _same(out, joined)
    assert not native.expand(
        rung, list(hi.split(sizes)), list(extra.split(sizes)), torch.empty(n + 1)
    )  # sizes differ
    assert not native.compact(rung, x, got[0][:-1], got[1])  # one extra tensor short


def _train(masters: str, steps: int = 4):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 40), torch.nn.LayerNorm(40), torch.nn.GELU(), torch.nn.Linear(40, 3)
    )
    amp = MixedPrecision("bf16-pure", masters=masters)
    model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 3, generator=g)
        with amp.autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        amp.backward(loss)
        amp.step(opt)
    return (
        [p.detach().clone() for p in model.parameters()],
        amp.full_precision_state_dict(),
        [e.clone() for e in amp.state_dict()["masters"]["extra"].values()],
    )


@needs_native
@pytest.mark.parametrize("masters", ["split", "kahan"])
def test_training_is_bitwise_the_same_with_ampkit_no_native(
    masters: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    for name in ("split", "join", "kahan_split", "kahan_join", "compact", "expand"):
        real = getattr(native, name)
        monkeypatch.setattr(
            native,
            name,
            lambda *a, _real=real, _name=name: calls.append((_name, _real(*a))) or calls[-1][1],
        )
    fast = _train(masters)
    assert calls and all(done for _, done in calls)  # the native kernels did the work
    assert {"compact", "expand"} <= {
        name for name, _ in calls
    }  # the step: one call per chunk each way
    monkeypatch.setenv("AMPKIT_NO_NATIVE", "1")
    calls.clear()
    slow = _train(masters)
    assert calls and not any(done for _, done in calls)  # ... and here the eager passes
    for a, b in zip(
        fast[0] + list(fast[1].values()) + fast[2], slow[0] + list(slow[1].values()) + slow[2]
    ):
        assert _same(a, b)


def test_non_contiguous_other_device_or_dtype_use_the_eager_passes() -> None:
    n = 300
    x = _fp32_bits(2 * n, seed=5)
    hi, rem = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.int16)
    assert not native.split(x[::2], hi, rem)  # strided
    assert not native.split(x[:n], torch.empty(2 * n, dtype=torch.bfloat16)[::2], rem)
    assert not native.join(hi, rem, torch.empty(n, 2)[:, 0])
    assert not native.split(x[:n], hi, rem.view(torch.bfloat16))  # wrong dtype
    assert not native.kahan_join(hi, rem.view(torch.bfloat16), torch.empty(n - 1))  # wrong size
    meta = [
        torch.empty(n, device="meta", dtype=d)
        for d in (torch.float32, torch.bfloat16, torch.bfloat16)
    ]
    assert not native.kahan_split(*meta) and not native.kahan_join(meta[1], meta[2], meta[0])
    kahan_split(
        meta[0], meta[1], meta[2], torch.empty(n, device="meta")
    )  # the eager passes run on meta
    # a strided split is the eager one's, whose NaN bits depend on the layout: torch's strided
    # fp32 -> bf16 copy gives 0x7FC0 where the contiguous (vectorized) one gives 0xFFFF
    split_fp32(x.clone()[::2], hi, rem)  # (x is scratch)
    hi2, rem2 = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.int16)
    split_fp32(x.clone()[::2], hi2, rem2, native=False)
    assert _same(hi, hi2) and _same(rem, rem2)
    assert hi[torch.isnan(hi)].view(torch.int16).unique().tolist() == [0x7FC0]
    if torch.cuda.is_available():  # pragma: no cover - CPU CI
        cuda = [t.cuda() for t in (x[:n], hi, rem)]
        assert not native.split(*cuda)


def test_no_native_env_and_failed_compile_fall_back(
    monkeypatch: pytest.MonkeyPatch, tmp_path, caplog
) -> None:
    x = _fp32_bits(100, seed=9)
    hi, rem = torch.empty(100, dtype=torch.bfloat16), torch.empty(100, dtype=torch.int16)
    monkeypatch.setenv("AMPKIT_NO_NATIVE", "1")
    assert not native.enabled() and not native.split(x, hi, rem)
    monkeypatch.delenv("AMPKIT_NO_NATIVE")
    monkeypatch.setattr(native, "_state", {})  # as in a fresh process
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # a "compiler" that always fails
    with caplog.at_level(logging.DEBUG, logger="ampkit"):
        assert not native.split(x, hi, rem)
    assert "native ladder kernels unavailable" in caplog.text
    assert not native.enabled()
    split_fp32(x.clone(), hi, rem)  # the eager passes, silently
    hi2, rem2 = torch.empty(100, dtype=torch.bfloat16), torch.empty(100, dtype=torch.int16)
    split_fp32(x.clone(), hi2, rem2, native=False)
    assert _same(hi, hi2) and _same(rem, rem2)
    assert not list(tmp_path.rglob("*.so")) and not list(
        tmp_path.rglob("*.tmp*")
    )  # no half-written file left


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_compiled_once_into_the_cache_concurrently(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("AMPKIT_NO_NATIVE", raising=False)
    monkeypatch.setattr(native, "_state", {})
    libs, errors = [], []

    def load() -> None:
        try:
            libs.append(native._load())
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=load) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(libs) == 2
    files = sorted(p.name for p in (tmp_path / "native").iterdir())
    # one library and its record (the temporary files renamed or removed), the builders' lock
    assert len(files) == 3 and files[0] == ".lock" and files[1].endswith(".so")
    assert files[2] == files[1] + ".sha256"
    assert native.enabled()  # loads the cached file


def _built(tmp_path) -> Path:
    """Compile the kernels into the cache under ``tmp_path`` (not loading them); the library."""
    flags = native.FLAGS + native.OPENMP
    out = native._build(native._compiler(), native.SOURCE.read_bytes(), flags)
    assert out.parent == tmp_path / "native"
    return out


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_cached_library_is_reported_rebuilt_and_never_loaded(
    damage: str, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """A cache file truncated to 4096 bytes used to kill every split/kahan run with SIGBUS (dlopen
    maps pages past its end); a flipped byte could do anything. Both are named in a warning, and
    the library is rebuilt and used, in a fresh process."""
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("AMPKIT_NO_NATIVE", raising=False)
    lib = _built(tmp_path)
    good = lib.read_bytes()
    mid = len(good) // 2
    flipped = good[:mid] + bytes([good[mid] ^ 0x10]) + good[mid + 1 :]
    data = good[:4096] if damage == "truncate" else flipped
    lib.write_bytes(data)  # in place, as a full disk or a bad sector would leave it
    code = "from ampkit.step.policies import native; print('enabled', native.enabled())"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
    assert "enabled True" in r.stdout
    assert f"the cached library {lib} is damaged" in r.stderr, r.stderr[-2000:]
    assert "rebuilding it" in r.stderr
    assert native._damage(lib) is None and len(lib.read_bytes()) == len(good)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_a_cached_library_without_its_record_is_rebuilt_quietly(
    monkeypatch: pytest.MonkeyPatch, tmp_path, caplog
) -> None:
    """A library cached before records were written (or a build interrupted between the library's
    rename and its record's) is never trusted: it is rebuilt, with an INFO line, no warning."""
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    lib = _built(tmp_path)
    record = lib.with_name(lib.name + ".sha256")
    assert record.is_file()
    record.unlink()
    before = lib.stat().st_ino
    with caplog.at_level(logging.INFO, logger="ampkit"):
        assert _built(tmp_path) == lib
    assert lib.stat().st_ino != before  # a new file ...
    assert native._damage(lib) is None  # ... matching its new record
    assert [r.levelname for r in caplog.records] == ["INFO"] and "no record" in caplog.text


class _Replacing(torch.optim.SGD):
    """Steps by giving each parameter new storage (``p.data = ...``), as some third-party optimizers do."""

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None:
                    p.data = p.data - g["lr"] * p.grad
        return None


@pytest.mark.parametrize("masters", ["split", "kahan"])
def test_an_optimizer_that_replaces_the_parameter_storage_is_stepped_exactly(
    masters: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The chunk's one-call re-split reads the chunk buffer; a stand-in moved to new storage by the
    optimizer is re-split from where it now is (the per-tensor path), so nothing is lost: bitwise the
    eager passes, and for ``split`` bitwise plain fp32 masters stepped the same way."""
    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 8))

    def run(rung: str) -> dict[str, torch.Tensor]:
        model = copy.deepcopy(base)
        amp = MixedPrecision("bf16-pure", masters=rung)
        model, opt = amp.setup(model, _Replacing(model.parameters(), lr=0.1))
        g = torch.Generator().manual_seed(2)
        for _ in range(3):
            with amp.autocast():
                loss = model(torch.randn(4, 64, generator=g)).float().square().mean()
            amp.backward(loss)
            amp.step(opt)
        return amp.full_precision_state_dict()

    fast = run(masters)
    monkeypatch.setenv("AMPKIT_NO_NATIVE", "1")
    slow = run(masters)
    ref = run("fp32") if masters == "split" else slow
    for k, v in ref.items():
        assert _same(fast[k], slow[k]) and _same(fast[k], v), k


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_a_compiler_without_the_clone_targets_still_builds_the_kernels(
    monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """A compiler that rejects the kernels' ``target_clones`` (the stochastic kernel's
    ``arch=x86-64-v4``: GCC before 11, older clang) still gets the kernels, built without clones --
    not the eager passes for every kernel."""
    old = tmp_path / "old-cc"
    old.write_text(
        '#!/bin/sh\ncase "$*" in *AMPKIT_NO_CLONES*) exec cc "$@";; esac\n'
        "echo \"error: bad value ('x86-64-v4') for target_clones attribute\" >&2\nexit 1\n"
    )
    old.chmod(0o755)
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("AMPKIT_NO_NATIVE", raising=False)
    monkeypatch.setenv("CC", str(old))
    monkeypatch.setattr(native, "_state", {})
    lib = native._load()  # raised before: every build refused
    assert lib.ampkit_openmp() in (0, 1)


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_the_kernels_load_under_a_float64_default_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.set_default_dtype(torch.float64)`` (a common setting in scientific code) left the
    load-time check's fp32 buffers in fp64: the check failed and every native kernel was turned
    off for the process, silently."""
    monkeypatch.setattr(
        native, "_state", {}
    )  # as in a fresh process (the cached library is reused)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        assert native.enabled()
    finally:
        torch.set_default_dtype(before)
    x = _fp32_bits(1000, seed=3)
    hi, rem = torch.empty(1000, dtype=torch.bfloat16), torch.empty(1000, dtype=torch.int16)
    assert native.split(x, hi, rem)
