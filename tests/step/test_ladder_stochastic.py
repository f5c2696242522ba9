"""Stochastic rounding of bf16-pure's ladder (the ``stochastic`` rung's weights, bf16 optimizer
states): the counter-based random bits, the native one-pass kernel bitwise the eager torch passes,
NaN/inf/bf16 values kept, unbiasedness, and training with the kernel bitwise training without it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

from ampkit import MixedPrecision
from ampkit.step.policies import native, native_adam
from ampkit.step.policies.pure import eager, rounding
from ampkit.step.policies.pure.ladder import LadderWeights
from ampkit.step.policies.pure.rounding import draw_key, stochastic_many, stochastic_round

needs_native = pytest.mark.skipif(
    not native.enabled(), reason="native kernels off (no C compiler, or AMPKIT_NO_NATIVE=1)"
)

# zeros, subnormals (smallest, largest, low half 0x8000 / 0xFFFF), bf16 values (low half 0), ties
# (low half 0x8000) of both signs, bf16's max and fp32's max (may round to inf), infinities, NaNs:
# quiet / signalling / all mantissa bits set, both signs (0xFFFFFFFF + bits wraps to 0 in int32)
SPECIAL = [
    0x00000000,
    -0x80000000,
    0x00000001,
    0x00008000,
    0x0000FFFF,
    0x007FFFFF,
    -0x7F800001,
    0x3F800000,
    0x3F808000,
    -0x407F8000,
    0x7F7F0000,
    0x7F7FFFFF,
    -0x00800001,
    0x7F800000,
    -0x800000,
    0x7FC00000,
    0x7F800001,
    0x7FFFFFFF,
    -0x400000,
    -1,
    -0x7F7FFF,
]
SIZES = [0, 1, 3, 5, 17, 1000, 65539, 70001]  # odd, unaligned offsets; the last two cut by threads
_M = (1 << 64) - 1


@contextlib.contextmanager
def second_call_fails(name: str) -> Iterator[list[int]]:
    """``torch.<name>`` (a fused optimizer kernel) raises "boom" on its second call in the block;
    yields the list of calls."""
    real, calls = getattr(torch, name), []

    def failing(*a, **k):  # noqa: ANN002,ANN003
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real(*a, **k)

    setattr(torch, name, failing)
    try:
        yield calls
    finally:
        setattr(torch, name, real)


def _splitmix(key: int, c: int) -> int:
    z = (key + c * 0x9E3779B97F4A7C15) & _M
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M
    return z ^ (z >> 31)


def _inputs(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**31), 2**31, (n,), generator=g, dtype=torch.int32)
    special = torch.tensor(SPECIAL, dtype=torch.int32)
    k = min(n, special.numel())
    bits[:k] = special[:k]
    return bits.view(torch.float32)


def test_the_random_bits_are_splitmix64_of_the_element_counter() -> None:
    """The stream, pinned: element g of a call keyed k takes 16-bit part g % 4 of
    splitmix64(k + (g // 4 + 1) * GAMMA) -- a pure-Python reference, not torch's arithmetic."""
    for key in (0, 1, 0x0123456789ABCDEF, (1 << 63) - 1):
        for start, n in ((0, 9), (1, 1), (3, 6), (6, 11), (4097, 33)):
            want = [
                (_splitmix(key, (g >> 2) + 1) >> (16 * (g & 3))) & 0xFFFF
                for g in range(start, start + n)
            ]
            assert eager.random16(key, start, n, torch.device("cpu")).tolist() == want
            assert eager.random16(torch.tensor(key), start, n, torch.device("cpu")).tolist() == want


def test_the_blocked_eager_pass_is_the_element_wise_function() -> None:
    """``eager.stochastic_round`` (blocks, one hash per 4 elements) is bitwise
    ``eager.stochastic_values`` (each element hashing its own word: what CUDA compiles), across
    a block boundary and from unaligned starts."""
    x = _inputs(eager.BLOCK + 13, seed=2)
    for key, start in ((5, 0), (2**62 + 3, 3), (0, 7)):
        got = torch.empty(x.numel(), dtype=torch.bfloat16)
        eager.stochastic_round(x.clone(), got, key, start)
        want = eager.stochastic_values(x, key, start)
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("start", [0, 1, 6])
def test_eager_rounding_keeps_nans_infinities_and_bf16_values(start: int) -> None:
    x = _inputs(len(SPECIAL))
    bits = x.view(torch.int32)
    out = torch.empty(x.numel(), dtype=torch.bfloat16)
    for key in range(20):
        eager.stochastic_round(x.clone(), out, key, start)
        o = out.float()
        assert torch.equal(
            torch.isnan(o), torch.isnan(x)
        )  # a NaN stays NaN, nothing else becomes one
        exact = (bits & 0xFFFF) == 0  # bf16 values (zeros, infinities, 1.0, ...) never move
        exact &= ~torch.isnan(x)
        assert torch.equal(o[exact].view(torch.int32), bits[exact])
        # every other finite value rounds to one of its two bf16 neighbours
        fin = torch.isfinite(x) & ~exact
        down = (bits & -0x10000).view(torch.float32)
        up = (bits.to(torch.int64) + 0x10000 & ~0xFFFF).to(torch.int32).view(torch.float32)
        assert bool(((o[fin] == down[fin]) | (o[fin] == up[fin])).all())


@needs_native
@pytest.mark.parametrize("threads", [1, 2])
def test_the_native_kernel_is_bitwise_the_eager_pass(threads: int) -> None:
    """Several tensors in one call (the counter runs across them, unaligned offsets, odd lengths, a
    tensor cut between two threads), random bits plus the special values, several keys."""
    x = _inputs(sum(SIZES), seed=1)
    for key in (0, 7, 0x7FFFFFFFFFFFFFFF, 0xFEDCBA9876543210):
        want = torch.empty(x.numel(), dtype=torch.bfloat16)
        eager.stochastic_round(x.clone(), want, key)
        got = [torch.empty(n, dtype=torch.bfloat16) for n in SIZES]
        xs = list(x.clone().split(SIZES))
        assert native.stochastic(xs, got, key, threads=threads)
        assert torch.equal(torch.cat(got).view(torch.int16), want.view(torch.int16))
        assert torch.equal(torch.cat(xs).view(torch.int32), x.view(torch.int32))  # x untouched


@needs_native
def test_the_native_kernel_refuses_what_it_cannot_take_and_the_dispatch_handles_it() -> None:
    x, out = torch.randn(64), torch.empty(64, dtype=torch.bfloat16)
    assert not native.stochastic([x[::2]], [out[:32]], 1)  # strided input
    assert not native.stochastic([x[:32]], [out[::2]], 1)  # strided output
    assert not native.stochastic([x.double()], [out], 1)  # wrong dtype
    assert not native.stochastic([x], [out[:63]], 1)  # sizes differ
    assert not native.stochastic([x.to("meta")], [out.to("meta")], 1)
    # the dispatch: strided tensors through contiguous copies, the same bits as contiguous ones
    a = torch.randn(48, 40)
    o1, o2 = torch.empty(40, 48, dtype=torch.bfloat16), torch.empty(48, 40, dtype=torch.bfloat16)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    stochastic_many([a.clone()], [o1.t()], g1)  # a strided output
    stochastic_many([a.t().contiguous().t()], [o2], g2)  # a strided input
    assert torch.equal(o1.t().view(torch.int16), o2.view(torch.int16))
    with pytest.raises(ValueError, match="one bf16 output per fp32 input"):
        stochastic_many([a], [o2[:2]], g1)


@pytest.mark.parametrize("native_on", [True, False])
def test_stochastic_rounding_is_unbiased(native_on: bool) -> None:
    """Each value repeated N times in one call (each copy its own counter, so its own bits): the
    mean of the roundings is the fp32 value within 6 standard deviations. A rounding is the lower or
    upper bf16 neighbour, one ulp apart, up with probability p = the dropped fraction (exact: 16
    uniform bits against the 16 dropped bits), so the mean's error has standard deviation
    ulp * sqrt(p (1 - p) / N) <= ulp / (2 sqrt(N))."""
    g = torch.Generator().manual_seed(5)
    vals = torch.cat(
        [
            torch.randn(24, generator=g) * 10.0 ** torch.randint(-30, 30, (24,), generator=g),
            torch.tensor(
                [1.0 + 2**-9, 1.0 + 2**-8, -3.0 - 2**-10, 1e-40, 5e-39]
            ),  # ties, subnormals
        ]
    )
    n = 8192
    x = vals.repeat_interleave(n)
    out = torch.empty(x.numel(), dtype=torch.bfloat16)
    stochastic_round(x.clone(), out, torch.Generator().manual_seed(0), native=native_on)
    mean = out.double().view(-1, n).mean(1)
    bits = vals.view(torch.int32).to(torch.int64)
    lo = (bits & ~0xFFFF).to(torch.int32).view(torch.float32).double()
    hi = ((bits + 0x10000) & ~0xFFFF).to(torch.int32).view(torch.float32).double()
    ulp = (hi - lo).abs()
    p = (vals.double() - lo) / (hi - lo)
    sd = ulp * torch.sqrt(p * (1 - p) / n)
    assert bool(((mean - vals.double()).abs() <= 6 * sd + 1e-3 * ulp / n).all())
    assert bool((sd > 0).sum() > 20)  # (the values are not bf16 values: the bound is not vacuous)


def test_the_bits_replay_from_the_generator_state() -> None:
    """Resume: the same generator state gives the same key, so the same roundings; a later call
    gets other bits."""
    g = torch.Generator().manual_seed(11)
    state = g.get_state()
    x = torch.randn(1000)
    a, b = (torch.empty(1000, dtype=torch.bfloat16) for _ in range(2))
    stochastic_round(x.clone(), a, g)
    g.set_state(state)
    stochastic_round(x.clone(), b, g)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    stochastic_round(x.clone(), b, g)
    assert not torch.equal(a.view(torch.int16), b.view(torch.int16))
    assert draw_key(g).dtype == torch.int64


def _train(rung: str, steps: int = 4, scratch_mib: int = 16) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(300, 24),
        torch.nn.Linear(24, 40),
        torch.nn.GELU(),
        torch.nn.Linear(40, 3),
    )
    amp = MixedPrecision(f"bf16-pure:{rung}", ladder_scratch_mib=scratch_mib)
    model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True))
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randint(0, 300, (8, 5), generator=g), torch.randn(8, 5, 3, generator=g)
        with amp.autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        amp.backward(loss)
        amp.step(opt)
    out = [p.detach().clone() for p in model.parameters()]
    for st in opt.state.values():
        out += [v.clone() for v in st.values() if isinstance(v, torch.Tensor)]
    return out


@needs_native
@pytest.mark.parametrize("rung", ["stochastic", "stochastic+bf16", "fp32+bf16", "split+bf16"])
def test_training_is_bitwise_the_same_with_ampkit_no_native(
    rung: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    real = native.stochastic
    monkeypatch.setattr(
        native, "stochastic", lambda *a, **k: calls.append(real(*a, **k)) or calls[-1]
    )
    fast = _train(rung)
    assert calls and all(calls)  # the kernel did the work
    monkeypatch.setenv("AMPKIT_NO_NATIVE", "1")
    calls.clear()
    slow = _train(rung)
    assert not any(calls)
    assert len(fast) == len(slow)
    for a, b in zip(fast, slow):
        assert a.dtype == b.dtype and torch.equal(
            a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)
        )


def test_bf16_states_stay_bf16_and_an_optimizer_error_leaves_them_as_before(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The states are widened into the kept arena for the optimizer's call; when that call raises,
    the stand-ins' states are their bf16 tensors from before it (not views of the arena). (The
    generic step: the fused Adam one calls no torch kernel, test_ladder_fused_adam.py.)"""
    monkeypatch.setattr(native_adam, "covers", lambda *a, **k: False)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    lw = LadderWeights(model, [opt], torch.bfloat16, (), "stochastic", "bf16")

    def step(fail: bool = False) -> None:
        for h, m in zip(lw.halves, lw.masters):
            m.grad = torch.randn(h.shape)
        if fail:
            real = torch._fused_adamw_

            def boom(*a, **k):  # noqa: ANN002,ANN003
                raise RuntimeError("boom")

            torch._fused_adamw_ = boom
            try:
                with pytest.raises(RuntimeError, match="boom"):
                    opt.step()
            finally:
                torch._fused_adamw_ = real
        else:
            opt.step()

    step()
    step()
    before = {id(m): {k: v.clone() for k, v in opt.state[m].items()} for m in lw.masters}
    step(fail=True)
    for m in lw.masters:
        for k, v in opt.state[m].items():
            if k != "step":
                assert v.dtype == torch.bfloat16 and v.shape == m.shape
                assert torch.equal(v.view(torch.int16), before[id(m)][k].view(torch.int16))
    step()  # and it steps on
    assert all(opt.state[m]["exp_avg"].dtype == torch.bfloat16 for m in lw.masters)


@pytest.mark.slow
def test_the_compiled_rounding_of_the_cuda_path_is_bitwise_the_eager_pass() -> None:
    """The CUDA path's ``torch.compile``'d rounding, compiled here by inductor for the CPU (the same
    graph; on CUDA, Triton): bitwise the eager passes on specials, odd sizes and offsets."""
    fn = rounding.compiled()
    if fn is None:
        pytest.skip("torch.compile off (AMPKIT_NO_COMPILE=1)")
    x = _inputs(70001, seed=4)
    for n, start, key in ((70001, 0, 3), (4099, 5, 0x7FFFFFFFFFFFFFFF), (1, 2, 9)):
        want = torch.empty(n, dtype=torch.bfloat16)
        eager.stochastic_round(x[:n].clone(), want, key, start)
        got = torch.empty(n, dtype=torch.bfloat16)
        fn(x[:n], got, torch.tensor(key), start)
        assert rounding._compiled["fn"] is not None, "the compile failed (fell back to eager)"
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_released_bf16_states_are_fp32_tensors_of_their_own() -> None:
    """Leaving the rung (a switch, a fallback) gives each state its own fp32 tensor: none may view
    the arena the next rung's steps would overwrite."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    lw = LadderWeights(model, [opt], torch.bfloat16, (), "stochastic", "bf16")
    for _ in range(2):
        for h, m in zip(lw.halves, lw.masters):
            m.grad = torch.randn(h.shape)
        opt.step()
    arena = lw._arena.buf.untyped_storage().data_ptr()
    lw.release()
    seen = set()
    for st in opt.state.values():
        for k, v in st.items():
            if k != "step":
                ptr = v.untyped_storage().data_ptr()
                assert v.dtype == torch.float32 and ptr != arena and ptr not in seen
                seen.add(ptr)


def test_an_optimizer_error_between_pieces_leaves_whole_bf16_states(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A weight stepped in pieces (a 64 KiB scratch), the optimizer raising on its second piece:
    the weight's state is whole again -- parameter-shaped bf16 tensors, no piece, no arena view.
    (The generic step, as above.)"""
    monkeypatch.setattr(native_adam, "covers", lambda *a, **k: False)
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(300, 517))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    lw = LadderWeights(
        model, [opt], torch.bfloat16, (), "stochastic", "bf16", scratch_bytes=64 << 10
    )
    m = lw.masters[0]
    for _ in range(2):
        m.grad = torch.randn(m.shape)
        opt.step()
    before = {k: v.clone() for k, v in opt.state[m].items()}
    m.grad = torch.randn(m.shape)
    with second_call_fails("_fused_adamw_"), pytest.raises(RuntimeError, match="boom"):
        opt.step()
    arena = lw._arena.buf.untyped_storage().data_ptr()
    for k, v in opt.state[m].items():
        if k == "step":
            assert torch.equal(v, before[k])  # the step count as before the step
        else:
            assert v.dtype == torch.bfloat16 and v.shape == m.shape
            assert v.untyped_storage().data_ptr() != arena


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_rounding_is_the_cpu_rounding() -> None:
    """On CUDA (compiled, or eager with AMPKIT_NO_COMPILE=1) the same bits as on the CPU for the
    same generator draws (NaNs compared as NaNs: each device's bf16 NaN pattern is its own)."""
    x = _inputs(70001, seed=6)
    cpu = torch.empty(x.numel(), dtype=torch.bfloat16)
    key = 0x0123456789ABCDEF
    eager.stochastic_round(x.clone(), cpu, key)
    dev = torch.empty(x.numel(), dtype=torch.bfloat16, device="cuda")
    xs = [x.cuda()]
    for fused in (True, False):
        fn = rounding.compiled() if fused else None
        if fn is None:
            eager.stochastic_round(xs[0].clone(), dev, torch.tensor(key, device="cuda"))
        else:
            fn(xs[0], dev, torch.tensor(key, device="cuda"), 0)
        got = dev.cpu()
        nan = torch.isnan(cpu.float())
        assert torch.equal(torch.isnan(got.float()), nan)
        assert torch.equal(got[~nan].view(torch.int16), cpu[~nan].view(torch.int16))


def test_a_checkpoint_from_another_rounding_stream_is_resumed_with_a_warning() -> None:
    """The stream is recorded beside the generator; a checkpoint written before it (no record) or
    with another one loads with a warning that says the bits differ, never silently."""
    import warnings

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 2))
    amp = MixedPrecision("bf16-pure:stochastic")
    model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    with amp.autocast():
        loss = model(torch.randn(4, 16)).float().pow(2).mean()
    amp.backward(loss)
    amp.step(opt)
    state = amp.state_dict()
    masters = state["masters"]
    assert masters["stream"] == rounding.STREAM
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp.load_state_dict(state)  # the same stream: no warning
    del masters["stream"]
    with pytest.warns(UserWarning, match="another random stream"):
        amp.load_state_dict(state)
    masters["stream"] = "torch-randint"
    with pytest.warns(UserWarning, match="torch-randint"):
        amp.load_state_dict(state)


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_an_optimizer_error_between_a_fresh_weights_pieces_leaves_no_state(
    state_dtype: str,
) -> None:
    """A weight never stepped, cut in pieces, the optimizer raising on its second piece: its state is
    empty again, as before the step -- not a momentum buffer whose pieces not yet stepped are
    uninitialized memory, which the next step would use silently."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(300, 517))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, fused=True)
    lw = LadderWeights(
        model, [opt], torch.bfloat16, (), "stochastic", state_dtype, scratch_bytes=64 << 10
    )
    m = lw.masters[0]
    m.grad = torch.randn(m.shape)
    with second_call_fails("_fused_sgd_") as calls, pytest.raises(RuntimeError, match="boom"):
        opt.step()
    assert len(calls) == 2  # (cut in pieces: the error came between them)
    assert not opt.state.get(m)


def test_a_scalar_parameters_step_count_is_not_a_bf16_state() -> None:
    """A 0-d parameter (a learnable scale): its AdamW ``step`` is a 0-d float tensor of the
    parameter's shape, yet a count, not a state -- it stays fp32 and exact (bf16 holds integers only
    to 256, and stochastic rounding would move it), through a checkpoint too."""
    torch.manual_seed(0)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(8))
    model.scale = torch.nn.Parameter(torch.tensor(1.5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    lw = LadderWeights(model, [opt], torch.bfloat16, (), "stochastic", "bf16")
    for _ in range(3):
        for h, m in zip(lw.halves, lw.masters):
            m.grad = torch.randn(h.shape)
        opt.step()
    opt.load_state_dict(opt.state_dict())
    for m in lw.masters:
        st = opt.state[m]
        assert st["step"].dtype == torch.float32 and float(st["step"]) == 3.0
        # (a scalar's states stay fp32, as under FSDP2: one element, no memory to save)
        assert st["exp_avg"].dtype == (torch.bfloat16 if m.dim() else torch.float32)


def test_the_bottom_rung_keeps_a_scalar_parameters_step_count_fp32() -> None:
    """``masters='none'`` casts the states an optimizer already holds (a switch down the ladder) to
    bf16, but not a 0-d parameter's step count: in bf16, 256 + 1 rounds back to 256 and AdamW's
    bias correction would freeze there."""
    from ampkit.step.policies.pure.cast import CastOnly

    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.randn(8))
    model.scale = torch.nn.Parameter(torch.tensor(1.5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    with pytest.warns(UserWarning, match="masters='none'"):
        CastOnly(model, [opt], torch.bfloat16)
    assert opt.state[model.scale]["step"].dtype == torch.float32
    assert opt.state[model.w]["exp_avg"].dtype == torch.bfloat16


def test_a_checkpoint_resumed_with_another_scratch_warns_that_the_bits_differ() -> None:
    """The rounding keys are drawn one per call, and how many elements a call takes follows
    ``ladder_scratch_mib``: a resume with another scratch rounds with other bits (same
    distribution) -- said in a warning, never silently; with the same scratch, no warning."""
    import warnings

    def ladder(scratch: int) -> LadderWeights:
        torch.manual_seed(0)
        model = torch.nn.Linear(128, 64)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        return LadderWeights(model, [opt], torch.bfloat16, (), "stochastic", "bf16", scratch)

    state = ladder(16 << 20).state_dict()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ladder(16 << 20).load_state_dict(state)
    with pytest.warns(UserWarning, match="ladder_scratch_mib"):
        ladder(64 << 10).load_state_dict(state)


def test_a_resume_takes_the_checkpoints_scratch_and_stays_bitwise() -> None:
    """A run resumed by an engine set up with another ``ladder_scratch_mib`` rebuilds the ladder
    with the checkpoint's (whose call sizes set the random stream): bitwise the straight run, no
    warning, and ``amp.config`` says the scratch in use."""
    import io
    import warnings

    def setup(scratch: int):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.Linear(512, 4))
        amp = MixedPrecision("bf16-pure:stochastic+bf16", ladder_scratch_mib=scratch)
        return (amp, *amp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2)))

    def steps(amp, model, opt, first: int, n: int) -> None:
        for s in range(first, first + n):
            g = torch.Generator().manual_seed(s)
            with amp.autocast():
                loss = model(torch.randn(8, 512, generator=g)).float().pow(2).mean()
            amp.backward(loss)
            amp.step(opt)

    amp, model, opt = setup(1)  # 1 MiB: the 512 x 512 weight takes several calls
    steps(amp, model, opt, 0, 3)
    buf = io.BytesIO()
    torch.save({"amp": amp.state_dict(), "model": model.state_dict(), "opt": opt.state_dict()}, buf)
    steps(amp, model, opt, 3, 3)
    amp2, model2, opt2 = setup(16)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp2.load_state_dict(ck["amp"])
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    assert amp2.config.ladder_scratch_mib == 1
    steps(amp2, model2, opt2, 3, 3)
    for p, q in zip(model.parameters(), model2.parameters()):
        assert torch.equal(p.view(torch.int16), q.view(torch.int16))
    straight, resumed = amp.full_precision_state_dict(), amp2.full_precision_state_dict()
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)
