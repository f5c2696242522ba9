"""The ladder's fused Adam/AdamW step (step/policies/pure/fused.py, native_adam.py, ``ampkit_adam``
in _bits.c): bitwise the generic step (widen -> torch's fused step -> round back) on every rung it
covers, and the generic step, unchanged, wherever it does not."""

from __future__ import annotations

import copy

import pytest
import torch

from ampkit import MixedPrecision
from ampkit.step.policies import native, native_adam
from ampkit.step.policies.pure import eager
from ampkit.step.policies.pure.ladder import LadderWeights

#: the module's rule (the fixture below replaces it)
FASTER = getattr(native_adam, "faster", None)

needs_native = pytest.mark.skipif(
    not native.enabled(), reason="native kernels off (no C compiler, or AMPKIT_NO_NATIVE=1)"
)

RUNGS = [
    ("split", "bf16"),
    ("stochastic", "bf16"),
    ("fp32", "bf16"),
    ("split", "fp32"),
    ("stochastic", "fp32"),
]


class Model(torch.nn.Module):
    """A weight cut in pieces by a 1 MiB scratch (101,303 elements: a tail of 7 past the last
    vector of 8), two small ones of odd sizes, a 1-element one."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Parameter(torch.randn(1003, 101))
        self.w = torch.nn.Parameter(torch.randn(37, 101) * 0.1)
        self.b = torch.nn.Parameter(torch.randn(37) * 1e-3)
        self.one = torch.nn.Parameter(torch.randn(1))


def _grad(shape: torch.Size, gen: torch.Generator, special: bool) -> torch.Tensor:
    """Gradients over ten decades with subnormals and signed zeros among them; ``special``: NaNs
    and infinities of both signs too."""
    n = int(torch.Size(shape).numel())
    g = torch.randn(n, generator=gen) * 10.0 ** torch.randint(-8, 2, (n,), generator=gen).float()
    values = [1e-40, -3e-39, 1e-45, -0.0, 0.0]
    if special:
        values += [float("nan"), float("inf"), -float("inf")]
    pick = torch.rand(n, generator=gen) < 0.05
    g[pick] = torch.tensor(values)[torch.randint(0, len(values), (int(pick.sum()),), generator=gen)]
    return g.view(shape)


def _make(
    rung: str, states: str, opt_kind: type, **hyper
) -> tuple[LadderWeights, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Model()
    opt = opt_kind(model.parameters(), **{"lr": 1e-2, "betas": (0.9, 0.99), "fused": True, **hyper})
    lw = LadderWeights(model, [opt], torch.bfloat16, (), rung, states, scratch_bytes=1 << 20)
    return lw, opt


def _train(lw: LadderWeights, opt: torch.optim.Optimizer, steps: int = 5) -> list[torch.Tensor]:
    """``steps`` steps (the third with NaN/inf gradients, so later ones step NaN states); every
    tensor of the rung's storage and the optimizer's state after each step."""
    gen = torch.Generator().manual_seed(1)
    seen: list[torch.Tensor] = []
    for k in range(steps):
        for h, m in zip(lw.halves, lw.masters):
            m.grad = _grad(h.shape, gen, special=k == 2)
        opt.step()
        seen += [h.detach().clone() for h in lw.halves] + [e.clone() for e in lw.storage()]
        seen += [f.clone() for f in lw.full]
        for m in lw.masters:
            seen += [v.clone() for v in opt.state[m].values()]
    return seen


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _assert_bitwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.dtype == y.dtype and x.shape == y.shape, i
        assert torch.equal(_bits(x), _bits(y)), f"tensor {i} differs"


@pytest.fixture(autouse=True)
def everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel wherever it is bitwise, faster than the generic step or not on this CPU (the
    bitwise checks below run on every CPU; the speed rule has its own test)."""
    monkeypatch.setattr(native_adam, "faster", lambda *a: True)


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the fused kernel's calls."""
    real, seen = native_adam.step, []

    def counted(*a, **k):  # noqa: ANN002,ANN003
        ok = real(*a, **k)
        seen.append(int(ok))
        return ok

    monkeypatch.setattr(native_adam, "step", counted)
    return seen


def _kernel_here(masters: str, states: str) -> None:
    """Skip a test that needs the fused kernel in use where no candidate is bitwise this torch's
    fused step with this CPU's kernels (e.g. ``ATEN_CPU_CAPABILITY=default``: torch's scalar loop
    rounds otherwise): there the ladder keeps its generic step, which
    ``test_the_fused_step_is_bitwise_the_generic_step`` checks on every CPU."""
    if native_adam.variant(native_adam.kind(masters), int(states == "bf16")) is None:
        pytest.skip(
            f"no kernel variant is bitwise torch's fused Adam here ({masters}+{states}, "
            f"CPU capability {torch.backends.cpu.get_cpu_capability()}): the generic step runs"
        )


def _generic(monkeypatch: pytest.MonkeyPatch) -> None:
    """The ladder's generic step from now on (the fused one never covers)."""
    monkeypatch.setattr(native_adam, "covers", lambda *a, **k: False)


@needs_native
@pytest.mark.parametrize("opt_kind", [torch.optim.Adam, torch.optim.AdamW], ids=["adam", "adamw"])
@pytest.mark.parametrize(
    "hyper",
    [{}, {"weight_decay": 0.1}, {"weight_decay": 0.1, "maximize": True}, {"betas": (0.0, 0.9)}],
    ids=["plain", "decay", "decay-maximize", "beta1-0"],
)
@pytest.mark.parametrize("rung", RUNGS, ids=["+".join(r) for r in RUNGS])
def test_the_fused_step_is_bitwise_the_generic_step(
    rung: tuple[str, str], opt_kind: type, hyper: dict, calls: list[int], monkeypatch
) -> None:
    fused = _train(*_make(*rung, opt_kind, **hyper))
    covered = not hyper.get("maximize")  # (maximize: the generic step, native_adam.covers)
    # (where this torch's fused kernel rounds otherwise than every candidate, the probe keeps the
    # generic step: still bitwise, below; on this project's CPUs the kernel is in use)
    used = covered and native_adam.variant(native_adam.kind(rung[0]), int(rung[1] == "bf16"))
    assert (sum(calls) > 0) == bool(used) and (all(calls) or not used)
    _generic(monkeypatch)
    n = len(calls)
    generic = _train(*_make(*rung, opt_kind, **hyper))
    assert len(calls) == n  # (the generic run never called the kernel)
    _assert_bitwise(fused, generic)


@needs_native
@pytest.mark.parametrize("rung", RUNGS[:2], ids=["+".join(r) for r in RUNGS[:2]])
def test_the_fused_step_on_two_threads_is_bitwise_the_generic_step_on_one(
    rung: tuple[str, str], calls: list[int], monkeypatch
) -> None:
    _kernel_here(*rung)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        fused = _train(*_make(*rung, torch.optim.AdamW, weight_decay=0.1), steps=3)
    finally:
        torch.set_num_threads(threads)
    assert calls
    _generic(monkeypatch)
    with torch.no_grad():
        torch.set_num_threads(1)
        try:
            generic = _train(*_make(*rung, torch.optim.AdamW, weight_decay=0.1), steps=3)
        finally:
            torch.set_num_threads(threads)
    _assert_bitwise(fused, generic)


class _MyAdamW(torch.optim.AdamW):
    pass


@needs_native
@pytest.mark.parametrize(
    "make",
    [
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True, amsgrad=True),
        lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(1e-2), fused=True),
        lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
        lambda ps: _MyAdamW(ps, lr=1e-2, fused=True),
        lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, fused=True),
    ],
    ids=["amsgrad", "tensor-lr", "not-fused", "subclass", "sgd"],
)
def test_options_it_does_not_cover_take_the_generic_step(make, calls: list[int]) -> None:
    torch.manual_seed(0)
    model = Model()
    opt = make(model.parameters())
    lw = LadderWeights(
        model, [opt], torch.bfloat16, (), "stochastic", "bf16", scratch_bytes=1 << 20
    )
    _train(lw, opt, steps=3)
    assert calls == []
    assert all(
        opt.state[m]["exp_avg" if "exp_avg" in opt.state[m] else "momentum_buffer"].dtype
        == torch.bfloat16
        for m in lw.masters
    )


@needs_native
def test_a_grad_scale_a_missing_gradient_and_no_native_take_the_generic_step(
    calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    _kernel_here("split", "bf16")
    lw, opt = _make("split", "bf16", torch.optim.AdamW)
    _train(lw, opt, steps=2)
    n = len(calls)
    assert n > 0
    lw.masters[1].grad = None  # one weight without a gradient: the generic step for all
    opt.step()
    assert len(calls) == n
    opt.grad_scale = torch.ones(())  # AMP scaling: torch's kernel unscales the gradients
    for h, m in zip(lw.halves, lw.masters):
        m.grad = torch.ones(h.shape)
    opt.step()
    assert len(calls) == n
    del opt.grad_scale
    monkeypatch.setenv("AMPKIT_NO_NATIVE", "1")
    opt.step()
    assert len(calls) == n


@needs_native
def test_a_kernel_unlike_torchs_is_never_used(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe rejects a candidate that is not torch's arithmetic (here: another vector width,
    which moves the scalar tail, whose rounding differs): then no variant, the generic step."""
    lib = native.library()
    found = native_adam._probe(lib, 1, 1)
    if found is None:  # (another torch build: no candidate at all, the generic step; tested above)
        pytest.skip("this torch's fused Adam matches no candidate of the kernel")
    others = tuple(c for c in native_adam.CANDIDATES if c[0] != found[0])
    monkeypatch.setattr(native_adam, "CANDIDATES", others)
    assert native_adam._probe(lib, 1, 1) is None
    # and the decay's two roundings are told apart (one fused multiply-add or two roundings)
    monkeypatch.setattr(native_adam, "CANDIDATES", ((found[0], 1 - found[1]),))
    assert native_adam._probe(lib, 1, 1) is None


def _engine_run(steps: int = 4) -> tuple:
    """Through the engine, with a ``keep_fp32`` LayerNorm (stepped by the user's optimizer) and an
    LR scheduler made after ``setup`` (it re-wraps the ladder's ``step``)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Embedding(300, 33), torch.nn.LayerNorm(33), torch.nn.Linear(33, 7)
    )
    amp = MixedPrecision("bf16-pure", masters="stochastic", state_dtype="bf16", keep_fp32=["1"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    model, opt = amp.setup(model, opt)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, 300, (4, 9), generator=g)
        with amp.autocast():
            loss = model(x).float().pow(2).mean()
        amp.backward(loss)
        amp.step(opt)
        sched.step()
        opt.zero_grad(set_to_none=True)
    assert model[1].weight.dtype == torch.float32
    return (
        [p.detach().clone() for p in model.parameters()],
        copy.deepcopy(opt.state_dict()),
        copy.deepcopy(amp.state_dict()["masters"]),
    )


@needs_native
def test_training_checkpoints_are_the_same_with_the_fused_step(
    calls: list[int], monkeypatch: pytest.MonkeyPatch, recwarn: pytest.WarningsRecorder
) -> None:
    """Through the engine: the weights (the kept fp32 ones too), the optimizer's state_dict (steps,
    bf16 states, the scheduled lr) and the rung's state (generator) are what the generic step
    leaves; the scheduler sees the optimizer stepped."""
    _kernel_here("stochastic", "bf16")
    fused = _engine_run()
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]
    assert calls
    _generic(monkeypatch)
    generic = _engine_run()
    _assert_bitwise(fused[0], generic[0])
    for a, b in zip(fused[1]["state"].values(), generic[1]["state"].values()):
        assert a.keys() == b.keys()
        _assert_bitwise(list(a.values()), list(b.values()))
    assert fused[1]["param_groups"] == generic[1]["param_groups"]
    assert torch.equal(fused[2]["generator"], generic[2]["generator"])


@needs_native
def test_the_fused_step_runs_only_where_it_is_faster_than_the_generic_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Measured (docs/benchmarks.md, "Fused Adam without AVX-512"): without a fused multiply-add
    instruction never (each fmaf a libm call), with AVX2 + FMA only with bf16 states, with AVX-512
    all but fp32 masters + fp32 states; the level is the library's own (its clones' choice)."""
    monkeypatch.setattr(native_adam, "faster", FASTER)  # (the real rule)
    lib = native.library()
    assert native_adam.isa(lib) in (0, 1, 2)
    kinds = [(w, s) for w in (0, 1, 2) for s in (0, 1)]
    assert [native_adam.faster(w, s, 0) for w, s in kinds] == [False] * 6
    assert [native_adam.faster(w, s, 1) for w, s in kinds] == [False, True] * 3
    assert [native_adam.faster(w, s, 2) for w, s in kinds] == [False] + [True] * 5
    for level in (0, 1, 2):
        monkeypatch.setattr(native_adam, "isa", lambda lib, level=level: level)
        for rung in ("fp32", "split", "stochastic"):
            for bf16 in (False, True):
                wk, sk = native_adam.kind(rung), int(bf16)
                want = native_adam.faster(wk, sk, level) and native_adam.variant(wk, sk) is not None
                assert native_adam.covers(rung, bf16, False) == want, (level, rung, bf16)


@needs_native
def test_fp32_masters_with_fp32_states_take_the_generic_step(
    calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """(the generic step there is torch's own fused kernel on the masters: the kernel is slower)"""
    monkeypatch.setattr(native_adam, "faster", FASTER)
    lw, opt = _make("fp32", "fp32", torch.optim.AdamW)
    _train(lw, opt, steps=2)
    assert calls == []


def _hooked(rung: tuple[str, str], seen: list[torch.Tensor]) -> list[torch.Tensor]:
    """Training with a step pre-hook that sets each step's lr (a warmup) and a post-hook that
    records the model's weights (an EMA would read them there)."""
    lw, opt = _make(*rung, torch.optim.AdamW, weight_decay=0.1)
    count = [0]

    def warmup(o: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        count[0] += 1
        for g in o.param_groups:
            g["lr"] = 1e-2 * min(1.0, count[0] / 3)

    opt.register_step_pre_hook(warmup)
    opt.register_step_post_hook(lambda o, a, k: seen.append([h.clone() for h in lw.halves]))
    return _train(lw, opt, steps=4)


@needs_native
@pytest.mark.parametrize("rung", RUNGS[:2], ids=["+".join(r) for r in RUNGS[:2]])
def test_step_hooks_see_what_the_generic_step_gives_them(
    rung: tuple[str, str], calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pre-hook's lr is the one stepped with (the fused step read the groups before the hooks
    ran), and a post-hook reads the stepped weights (it ran before the kernel)."""
    _kernel_here(*rung)
    seen: list[list[torch.Tensor]] = []
    fused = _hooked(rung, seen)
    assert calls
    n = len(fused) // 4  # (each step's record begins with the model's weights)
    after = [fused[k * n : k * n + len(seen[0])] for k in range(4)]
    # one post-hook call per step, the first (generic) step's too (pieces.StepHooks), each
    # reading the weights that step wrote
    assert len(seen) == 4
    for got, want in zip(seen, after):
        _assert_bitwise(got, want)
    _generic(monkeypatch)
    _assert_bitwise(fused, _hooked(rung, []))


@needs_native
@pytest.mark.parametrize("sk", [0, 1], ids=["fp32-states", "bf16-states"])
def test_a_split_nan_stored_as_a_zero_weight_meets_a_made_nan_as_torch_has_it(sk: int) -> None:
    """A quiet NaN with every high mantissa bit set splits into a weight of -0 (0x8000) and a
    negative remainder: its block must take the NaN-ordered loop (the weight alone looked finite)
    where it meets the default NaN of inf / inf (an overflowed exp_avg over an overflowed
    exp_avg_sq). (On this compiler the fast loop happened to order them as torch does; the probe
    now holds these NaNs too.)"""
    var = native_adam.variant(1, sk)
    if var is None:
        pytest.skip("the probe keeps the generic step for split weights here")
    n = 1024
    x = torch.full((n,), 0.5)
    x[100] = torch.tensor([0x7FFFFFFF], dtype=torch.int32).view(torch.float32)
    hi, rem = torch.empty(n, dtype=torch.bfloat16), torch.empty(n, dtype=torch.int16)
    eager.split_fp32(x.clone(), hi, rem)
    assert hi.view(torch.int16)[100] == -32768  # (0x8000: -0)
    g, m, v = torch.full((n,), 1e-3), torch.zeros(n), torch.full((n,), 1e-6)
    g[100], m[100] = 3.4e38, -3.4e38
    if sk:
        m, v = m.to(torch.bfloat16), v.to(torch.bfloat16)
    d = {"w": [hi], "wx": [rem], "g": [g], "m": [m], "v": [v]}
    cfg = (True, False, 1e-3, 0.9, 0.999, 1e-8, 0.0, 3.0)
    want = native_adam._generic(1, sk, d, cfg, 1, 2)
    got = native_adam._fused(native.library(), 1, sk, d, cfg, 1, 2, var, 1)
    _assert_bitwise(got, want)


def _groups_and_resume() -> list[torch.Tensor]:
    """Two groups of different hyper-parameters (Adam's coupled decay in one), two steps, the
    optimizer's and the rung's state saved and loaded into a new setup, a group added after it,
    two more steps."""

    def make() -> tuple[Model, LadderWeights, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = Model()
        groups = [
            {"params": [model.emb, model.one], "weight_decay": 0.3, "betas": (0.8, 0.95)},
            {"params": [model.w, model.b], "lr": 3e-3, "eps": 1e-6},
        ]
        opt = torch.optim.Adam(groups, lr=1e-2, fused=True)
        lw = LadderWeights(model, [opt], torch.bfloat16, (), "split", "bf16", 1 << 20)
        return model, lw, opt

    _, lw, opt = make()
    seen = _train(lw, opt, steps=2)
    saved = copy.deepcopy((opt.state_dict(), lw.state_dict(), [h.detach() for h in lw.halves]))
    _, lw, opt = make()
    opt.load_state_dict(saved[0])
    lw.load_state_dict(saved[1])
    with torch.no_grad():
        for h, s in zip(lw.halves, saved[2]):
            h.copy_(s)
    extra = torch.nn.Parameter(torch.ones(5))
    opt.add_param_group({"params": [extra], "lr": 0.1})
    extra.grad = torch.ones(5)
    seen += _train(lw, opt, steps=2) + [extra.detach().clone()]
    assert all(opt.state[m]["exp_avg"].dtype == torch.bfloat16 for m in lw.masters)
    return seen


@needs_native
def test_groups_a_resume_and_a_group_added_later_are_bitwise_the_generic_step(
    calls: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    _kernel_here("split", "bf16")
    fused = _groups_and_resume()
    assert len(calls) >= 3  # (the step after the resume too: states loaded, not made)
    _generic(monkeypatch)
    _assert_bitwise(fused, _groups_and_resume())
