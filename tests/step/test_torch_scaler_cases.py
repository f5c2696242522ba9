"""PyTorch's own GradScaler cases, each run with ``torch.amp.GradScaler("cpu")`` and with ampkit
in the same process, compared **bitwise** (scale, growth tracker, gradients, parameters).

The cases are those of pytorch/pytorch ``test/test_torch.py`` (``test_grad_scaling_*``,
``_run_scaling_case``, ``_grad_scaling_autocast_test``, the fused-optimizer and sparse cases) and
``test/test_cuda.py`` (grads invalidated between ``unscale_`` and ``step``, preset ``grad_scale``),
read and re-expressed through ampkit's public API: :class:`ampkit.LossScaler` where torch drives
GradScaler directly, ``MixedPrecision("fp16", device="cpu")`` for the whole loop. Where
tests/step/test_gradscaler_parity.py checks the scaled run against an unscaled control (torch's
tolerances), here the reference is GradScaler itself, so the checks are exact. The documented
extensions (the scale floor, hysteresis) are tested as documented, and say so.
"""

import pickle

import pytest
import torch

from ampkit import LossScaler, MixedPrecision
from ampkit.step.gradcheck import check_and_unscale
from ampkit.step.scale_rules import SCALE_FLOOR

INF, NAN = float("inf"), float("nan")


def gradscaler(**kw):
    return torch.amp.GradScaler("cpu", **kw)


def both(**kw):
    return gradscaler(**kw), LossScaler(**kw)


def model_and_data(seed=0, n=6, width=8):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, width)
    )
    data = [(torch.randn(4, width), torch.randn(4, width)) for _ in range(n)]
    return model, data


def twin(model):
    return pickle.loads(pickle.dumps(model))


_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def assert_same(a, b):
    """Bitwise equality of two tensor lists (a NaN equals a NaN of the same bits)."""
    a, b = list(a), list(b)
    assert len(a) == len(b)
    for x, y in zip(a, b):
        x, y = x.detach(), y.detach()
        assert x.dtype == y.dtype and x.shape == y.shape
        bits = _BITS.get(x.dtype)
        if bits is not None:
            x, y = x.contiguous().view(bits), y.contiguous().view(bits)
        assert torch.equal(x, y)


def scaler_state(s):
    return s.get_scale(), s.state_dict()["_growth_tracker"]


def run_loop(scaler, model, data, opt_ctor, *, bad=None, clip=None, unscale_first=False):
    """torch's ``_grad_scaling_autocast_test`` loop: fp16 autocast, scale, backward, optional
    injected inf/NaN, optional unscale_ + clip, step, update. Returns the per-step scaler states."""
    opt = opt_ctor(model.parameters())
    bad = bad or {}
    states = []
    for i, (x, y) in enumerate(data):
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        if i in bad:
            with torch.no_grad():
                model[2].weight.grad[0, 0] = bad[i]
        if unscale_first or clip is not None:
            scaler.unscale_(opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        states.append(scaler_state(scaler))
    return states, opt


OPTIMIZERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "sgd_foreach": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, foreach=True),
    "sgd_fused": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, fused=True),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adam_fused": lambda p: torch.optim.Adam(p, lr=0.01, fused=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=0.01, fused=True),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.01),
}


@pytest.mark.parametrize("unscale_first", [False, True], ids=["step", "unscale_then_step"])
@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
def test_autocast_loop_with_infs_and_nans_is_bitwise_gradscalers(opt_name, unscale_first):
    """torch's ``_grad_scaling_autocast_test`` / ``test_grad_scaling_autocast_fused_optimizers``:
    growth every step, an inf and a NaN skip, fused optimizers fed grad_scale/found_inf (with
    unscale_ first: found_inf only). Scale, growth tracker, optimizer state and parameters equal."""
    model, data = model_and_data()
    ref_model = twin(model)
    kw = dict(init_scale=128.0, growth_factor=2.0, growth_interval=1)
    ref, ours = both(**kw)
    bad = {2: INF, 4: NAN}
    ref_states, ref_opt = run_loop(
        ref, ref_model, data, OPTIMIZERS[opt_name], bad=bad, unscale_first=unscale_first
    )
    states, opt = run_loop(
        ours, model, data, OPTIMIZERS[opt_name], bad=bad, unscale_first=unscale_first
    )
    assert states == ref_states
    assert ref_states[2] == (ref_states[1][0] / 2, 0)  # the case holds: the inf step backed off
    assert_same(model.parameters(), ref_model.parameters())
    for p, q in zip(model.parameters(), ref_model.parameters()):
        for k, v in ref_opt.state[q].items():
            assert_same([opt.state[p][k]], [v])


@pytest.mark.parametrize(
    "kw",
    [
        dict(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5, growth_interval=3),
        dict(init_scale=3.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=2),
        dict(init_scale=1e38, growth_factor=2.0**4, growth_interval=1),  # growth would overflow
    ],
)
def test_growth_backoff_interval_sequences(kw):
    """``_amp_update_scale_``'s rules through update(): growth after ``growth_interval`` finite
    steps (not when the result would be inf: ``test_grad_scale_will_not_overflow``), backoff and a
    tracker reset on every overflow, found_infs of several optimizers combined."""
    ref, ours = both(**kw)
    pattern = [0, 0, 0, 1, 0, 0, 1, 2, 0, 0, 0, 0, 0, 1, 0]  # 2: both optimizers overflow
    for s in (ref, ours):
        s.scale(torch.ones(()))
    p = torch.nn.Parameter(torch.ones(2))
    q = torch.nn.Parameter(torch.ones(2))
    for step, overflow in enumerate(pattern):
        for s in (ref, ours):
            opts = [torch.optim.SGD([p], lr=0.0), torch.optim.SGD([q], lr=0.0)]
            p.grad = torch.full((2,), INF if overflow and (step % 2 or overflow == 2) else 1.0)
            q.grad = torch.full((2,), NAN if overflow and (not step % 2 or overflow == 2) else 1.0)
            for o in opts:
                s.unscale_(o)
            s.update()
        assert scaler_state(ours) == scaler_state(ref), step
        assert ours.get_scale() != INF


def test_clipping_after_unscale_is_bitwise_gradscalers():
    """``test_grad_scaling_clipping_separate_unscale``: unscale_, clip_grad_norm_, step."""
    model, data = model_and_data(1)
    ref_model = twin(model)
    sgd = OPTIMIZERS["sgd"]
    ref, ours = both(init_scale=128.0, growth_interval=1)
    s_ref, _ = run_loop(ref, ref_model, data, sgd, bad={3: INF}, clip=0.2)
    s_ours, _ = run_loop(ours, model, data, sgd, bad={3: INF}, clip=0.2)
    assert s_ours == s_ref
    assert_same(model.parameters(), ref_model.parameters())


def test_clipping_the_scaled_gradients_is_bitwise_gradscalers():
    """``test_grad_scaling_clipping``: clip the scaled gradients to ``max_norm * get_scale()``."""
    model, data = model_and_data(2)
    results = []
    for s, m in zip(both(init_scale=128.0, growth_interval=1), (twin(model), model)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            s.scale(torch.nn.functional.mse_loss(m(x), y)).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.2 * s.get_scale())
            if i == 2:
                m[0].bias.grad[0] = INF
            s.step(opt)
            s.update()
        results.append((scaler_state(s), list(m.parameters())))
    assert results[0][0] == results[1][0]
    assert_same(results[0][1], results[1][1])


def test_accumulation_is_bitwise_gradscalers():
    """``test_grad_scaling_accumulation``: two scaled backward passes per step."""
    model, data = model_and_data(3, n=8)
    results = []
    for s, m in zip(both(init_scale=128.0, growth_interval=1), (twin(model), model)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for i, (x, y) in enumerate(data):
            s.scale(torch.nn.functional.mse_loss(m(x), y) / 2).backward()
            if i % 2:
                s.step(opt)
                s.update()
                opt.zero_grad()
        results.append((scaler_state(s), list(m.parameters())))
    assert results[0][0] == results[1][0] == (128.0 * 2**4, 0)
    assert_same(results[0][1], results[1][1])


def test_multiple_models_losses_optimizers_are_bitwise_gradscalers():
    """``test_grad_scaling_multiple``: two models and optimizers fed by two losses; one optimizer
    unscaled separately; an inf in the second model's gradients skips both steps' scale update."""
    (m0, data), (m1, _) = model_and_data(4), model_and_data(5)
    results = []
    for s, a, b in zip(both(init_scale=128.0, growth_interval=1), (twin(m0), m0), (twin(m1), m1)):
        o0 = torch.optim.SGD(a.parameters(), lr=0.1)
        o1 = torch.optim.Adam(b.parameters(), lr=0.01)
        for i, (x, y) in enumerate(data):
            o0.zero_grad()
            o1.zero_grad()
            out0, out1 = a(x), b(x)
            loss0 = torch.nn.functional.mse_loss(0.3 * out0 + 0.7 * out1, y)
            loss1 = torch.nn.functional.mse_loss(0.6 * out0 - 0.4 * out1, y)
            s.scale(loss0).backward(retain_graph=True)
            s.scale(loss1).backward()
            if i == 2:
                b[0].weight.grad[1, 1] = INF
            s.unscale_(o0)
            s.step(o0)
            s.step(o1)
            s.update()
        results.append((scaler_state(s), [*a.parameters(), *b.parameters()]))
    assert results[0][0] == results[1][0] == (128.0 * 2**5 / 2, 0)
    assert_same(results[0][1], results[1][1])


@pytest.mark.filterwarnings("ignore:Using backward\\(\\) with create_graph=True")
def test_penalty_double_backward_is_bitwise_gradscalers():
    """``test_grad_scaling_penalty``: autograd.grad of the scaled loss with create_graph, unscaled
    by hand, its norm added to the loss; also ``backward(create_graph=True)`` then step (gradients
    that require grad are unscaled as GradScaler does, under no_grad)."""
    model, data = model_and_data(6)
    results = []
    for s, m in zip(both(init_scale=128.0, growth_interval=1), (twin(model), model)):
        opt = torch.optim.SGD(m.parameters(), lr=0.05)
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(m(x), y)
            grads = torch.autograd.grad(s.scale(loss), list(m.parameters()), create_graph=True)
            inv = 1.0 / s.get_scale()
            penalty = sum((g * inv).pow(2).sum() for g in grads).sqrt()
            s.scale(loss + penalty).backward(create_graph=i % 2 == 1)
            if i == 3:
                m[2].bias.grad[0] = NAN
            s.step(opt)
            s.update()
        results.append((scaler_state(s), [p.detach() for p in m.parameters()]))
    assert results[0][0] == results[1][0]
    assert_same(results[0][1], results[1][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_sparse_gradients_unscale_like_gradscaler(dtype):
    """``test_grad_scaling_unscale_sparse``: a sparse fp32 gradient with an inf is found; fp16
    sparse values whose duplicate indices overflow only once coalesced are found (the gradient is
    coalesced in place, as GradScaler does); finite ones unscale to the same values."""
    i = torch.tensor([[0, 1, 1], [2, 0, 2]])
    cases = {
        "finite": torch.tensor([16.0, 32.0, 64.0]),
        "inf": torch.tensor([16.0, INF, 64.0]),
        "dup_overflow": torch.tensor([64000.0, 32.0, 64000.0]),
    }
    idx = {"dup_overflow": torch.tensor([[1, 1, 1], [2, 0, 2]])}
    for name, v in cases.items():
        grads = []
        for _ in range(2):
            p = torch.nn.Parameter(torch.zeros(2, 3, dtype=dtype))
            p.grad = torch.sparse_coo_tensor(
                idx.get(name, i), v.to(dtype), (2, 3), check_invariants=True
            )
            grads.append(p)
        ref, ours = both(init_scale=4.0)
        inv = torch.full((), 0.25)
        found_ref = ref._unscale_grads_(
            torch.optim.SGD([grads[0]], lr=0.0), inv, torch.zeros(()), allow_fp16=True
        )
        found = check_and_unscale(torch.optim.SGD([grads[1]], lr=0.0), inv, allow_fp16=True)
        assert [f.item() for f in found.values()] == [f.item() for f in found_ref.values()], name
        expect = name == "inf" or (name == "dup_overflow" and dtype == torch.float16)
        assert found[torch.device("cpu")].item() == float(expect), name
        a, b = grads[1].grad, grads[0].grad
        assert a.is_coalesced() == b.is_coalesced()
        assert_same([a.to_dense()], [b.to_dense()])


def test_sparse_embedding_training_is_bitwise_gradscalers():
    """A sparse-gradient embedding (SGD, as torch's sparse case) trained under both scalers."""
    torch.manual_seed(7)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    results = []
    for s, m in zip(both(init_scale=64.0, growth_interval=1), (twin(emb), emb)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for step in range(4):
            opt.zero_grad()
            out = m(torch.tensor([1, 3, 3, step]))
            s.scale(out.pow(2).sum() * (1e38 if step == 2 else 1.0)).backward()
            s.step(opt)
            s.update()
        results.append((scaler_state(s), [m.weight.detach()]))
    assert results[0][0] == results[1][0]
    assert_same(results[0][1], results[1][1])


@pytest.mark.parametrize("opt_name", ["sgd", "adam_fused"])
def test_grads_invalidated_between_unscale_and_step_still_step(opt_name):
    """test_cuda's ``test_params_invalidated_with_grads_invalidated_between_unscale_and_step``:
    step() trusts the found_inf that unscale_() recorded, so gradients broken afterwards reach
    the parameters (under GradScaler and ampkit alike)."""
    model, data = model_and_data(8, n=2)
    results = []
    for s, m in zip(both(init_scale=128.0), (twin(model), model)):
        opt = OPTIMIZERS[opt_name](m.parameters())
        for x, y in data:
            opt.zero_grad()
            s.scale(torch.nn.functional.mse_loss(m(x), y)).backward()
            s.unscale_(opt)
            for j, p in enumerate(m.parameters()):
                p.grad.fill_(INF if j % 2 else NAN)
            s.step(opt)
            s.update()
        assert all(not p.isfinite().all() for p in m.parameters())
        results.append((scaler_state(s), list(m.parameters())))
    assert results[0][0] == results[1][0]
    assert_same(results[0][1], results[1][1])


@pytest.mark.parametrize("unscale_first", [False, True])
def test_fused_step_takes_the_product_with_a_preset_grad_scale(unscale_first):
    """GradScaler.step for a fused optimizer multiplies a ``grad_scale`` the user already set on
    it by the loss scale (after unscale_, passes the preset one through), then removes both
    attributes. ampkit used to overwrite the preset scale."""
    model, data = model_and_data(9, n=3)
    results = []
    for s, m in zip(both(init_scale=8.0, growth_interval=1), (twin(model), model)):
        opt = OPTIMIZERS["adam_fused"](m.parameters())
        for x, y in data:
            opt.zero_grad()
            s.scale(torch.nn.functional.mse_loss(m(x), y)).backward()
            if unscale_first:
                s.unscale_(opt)
            opt.grad_scale = torch.full((), 2.0)
            s.step(opt)
            assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
            s.update()
        results.append((scaler_state(s), list(m.parameters())))
    assert results[0][0] == results[1][0]
    assert_same(results[0][1], results[1][1])


def test_update_new_scale_like_gradscaler():
    """update(new_scale=float or 1-element tensor) sets the scale and keeps the growth tracker;
    the tensor is copied (later changes to it do not reach the scale)."""
    ref, ours = both(init_scale=4.0, growth_interval=3)
    p = torch.nn.Parameter(torch.ones(2))
    for s in (ref, ours):
        s.scale(torch.ones(()))
        p.grad = torch.ones(2)
        s.step(torch.optim.SGD([p], lr=0.0))
        s.update()
        s.update(new_scale=16.0)
    assert scaler_state(ours) == scaler_state(ref) == (16.0, 1)
    for s in (ref, ours):
        t = torch.tensor(32.0)
        s.update(new_scale=t)
        t.fill_(1.0)
    assert scaler_state(ours) == scaler_state(ref) == (32.0, 1)


@pytest.mark.parametrize(
    "bad",
    [torch.tensor(8.0, requires_grad=True), torch.tensor([4.0, 2.0])],
    ids=["requires_grad", "two_elements"],
)
def test_update_rejects_the_new_scales_gradscaler_rejects(bad):
    """GradScaler refuses a new_scale tensor that requires grad or holds more than one element
    (an AssertionError). ampkit used to copy a requires-grad tensor into its scale, which then
    joined the autograd graph of every scaled loss; it now raises a ValueError saying why,
    before anything changes."""
    ref, ours = both(init_scale=4.0)
    for s in (ref, ours):
        s.scale(torch.ones(()))
    with pytest.raises(AssertionError):
        ref.update(new_scale=bad)
    with pytest.raises(ValueError, match="new_scale"):
        ours.update(new_scale=bad)
    assert ours.get_scale() == 4.0 and not ours.scale_tensor.requires_grad


def test_state_dicts_cross_load_and_resume_identically():
    """``test_grad_scaling_state_dict`` across implementations: a GradScaler's state dict loaded
    into a LossScaler (and ours into a GradScaler: a superset) resumes the same sequence."""
    ref, ours = both(init_scale=32.0, growth_factor=4.0, backoff_factor=0.25, growth_interval=2)
    p = torch.nn.Parameter(torch.ones(2))

    def iterate(s, overflow):
        s.scale(torch.ones(()))
        p.grad = torch.full((2,), INF if overflow else 1.0)
        s.step(torch.optim.SGD([p], lr=0.0))
        s.update()

    for overflow in (0, 0, 1, 0):
        iterate(ref, overflow)
        iterate(ours, overflow)
    from_ref, from_ours = LossScaler(), gradscaler()
    from_ref.load_state_dict(ref.state_dict())
    from_ours.load_state_dict(ours.state_dict())
    assert {k: v for k, v in ours.state_dict().items() if k in ref.state_dict()} == ref.state_dict()
    for overflow in (0, 0, 1, 1, 0, 0):
        for s in (ref, ours, from_ref, from_ours, pickle.loads(pickle.dumps(ref))):
            iterate(s, overflow)
        assert scaler_state(from_ref) == scaler_state(from_ours) == scaler_state(ref)
        assert scaler_state(ours) == scaler_state(ref)


def test_misuse_raises_like_gradscaler():
    """The order errors GradScaler raises: unscale_ twice, unscale_ after step, step twice,
    step with a closure, fp16 gradients to unscale_ (a ValueError)."""
    for s in both(init_scale=4.0):
        p = torch.nn.Parameter(torch.ones(2))
        opt = torch.optim.SGD([p], lr=0.1)
        s.scale(p.sum()).backward()
        s.unscale_(opt)
        with pytest.raises(RuntimeError, match="unscale_"):
            s.unscale_(opt)
        s.step(opt)
        with pytest.raises(RuntimeError, match="after step"):
            s.unscale_(opt)
        with pytest.raises(RuntimeError, match="step"):
            s.step(opt)
        s.update()
        with pytest.raises(RuntimeError, match="losure"):
            s.step(opt, closure=lambda: None)
        h = torch.nn.Parameter(torch.ones(2, dtype=torch.float16))
        h.grad = torch.ones(2, dtype=torch.float16)
        with pytest.raises(ValueError, match="(?i)fp16"):
            s.unscale_(torch.optim.SGD([h], lr=0.1))


def test_scale_floor_is_ampkits_documented_difference():
    """Deliberate difference (scaler.py module doc): GradScaler halves the scale into fp32
    subnormals and then 0.0; ampkit's stops at 2**-126. Above the floor the sequences are equal."""
    ref, ours = both(init_scale=2.0**-120)
    p = torch.nn.Parameter(torch.ones(2))
    for _ in range(40):
        for s in (ref, ours):
            s.scale(torch.ones(()))
            p.grad = torch.full((2,), INF)
            s.step(torch.optim.SGD([p], lr=0.0))
            s.update()
        if ref.get_scale() >= SCALE_FLOOR:
            assert ours.get_scale() == ref.get_scale()
        else:
            assert ours.get_scale() == SCALE_FLOOR
    assert ref.get_scale() == 0.0 and ours.get_scale() == SCALE_FLOOR


def test_hysteresis_is_ampkits_documented_extension():
    """Deliberate extension (scale_rules.py): with hysteresis=2 the first overflow only spends
    the budget; the default (1) is GradScaler's rule, checked above."""
    s = LossScaler(init_scale=64.0, hysteresis=2)
    p = torch.nn.Parameter(torch.ones(2))
    got = []
    for _ in range(2):
        s.scale(torch.ones(()))
        p.grad = torch.full((2,), INF)
        s.step(torch.optim.SGD([p], lr=0.0))
        s.update()
        got.append(s.get_scale())
    assert got == [64.0, 32.0]


@pytest.mark.parametrize(
    "extra",
    [{}, {"clip_grad_norm": 0.2}, {"accumulation_steps": 2}],
    ids=["plain", "clip", "accum"],
)
@pytest.mark.parametrize("opt_name", ["sgd", "adamw_fused"])
def test_mixed_precision_fp16_loop_is_bitwise_gradscalers(opt_name, extra):
    """``MixedPrecision("fp16", device="cpu")`` with setup/autocast/backward/step against the
    loop torch documents (autocast fp16, GradScaler; loss / accum; unscale_ + clip_grad_norm_),
    with a natural fp16 overflow (an input beyond fp16's range) that must skip and back off."""
    model, data = model_and_data(10, n=8)
    data[3] = (data[3][0] * 1e6, data[3][1])  # overflows fp16 in the first linear layer
    ref_model = twin(model)
    accum = extra.get("accumulation_steps", 1)
    clip = extra.get("clip_grad_norm")
    kw = dict(init_scale=128.0, growth_factor=2.0, backoff_factor=0.5, growth_interval=1)

    ref = gradscaler(**kw)
    ref_opt = OPTIMIZERS[opt_name](ref_model.parameters())
    ref_scales = []
    for i, (x, y) in enumerate(data):
        with torch.autocast("cpu", dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(ref_model(x).float(), y)
        ref.scale(loss / accum if accum > 1 else loss).backward()
        if (i + 1) % accum == 0:
            if clip is not None:
                ref.unscale_(ref_opt)
                torch.nn.utils.clip_grad_norm_(ref_model.parameters(), clip)
            ref.step(ref_opt)
            ref.update()
            ref_opt.zero_grad(set_to_none=True)
            ref_scales.append(ref.get_scale())

    amp = MixedPrecision("fp16", device="cpu", **kw, **extra)
    opt = OPTIMIZERS[opt_name](model.parameters())
    model, opt = amp.setup(model, opt)
    scales = []
    for x, y in data:
        with amp.autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        amp.backward(loss)
        if amp.step().boundary:
            scales.append(amp.get_scale())
    assert scales == ref_scales
    assert min(a / b for a, b in zip(ref_scales[1:], ref_scales)) == 0.5  # the overflow happened
    assert_same(model.parameters(), ref_model.parameters())
    for p, q in zip(model.parameters(), ref_model.parameters()):
        for k, v in ref_opt.state[q].items():
            assert_same([opt.state[p][k]], [v])


class _AmpAwareOptimizer(torch.optim.Optimizer):
    """A custom optimizer that does its own AMP bookkeeping (``_step_supports_amp_scaling``)."""

    def __init__(self, params):
        super().__init__(params, {})
        self._step_supports_amp_scaling = True
        self.seen = None


class _TakesTheScaler(_AmpAwareOptimizer):
    def step(self, closure=None, *, grad_scaler=None):
        self.seen = (grad_scaler, hasattr(self, "grad_scale"), hasattr(self, "found_inf"))


class _ReadsTheAttributes(_AmpAwareOptimizer):
    def step(self, closure=None):
        self.seen = (type(self.grad_scale), type(self.found_inf))


@pytest.mark.parametrize("make", [gradscaler, LossScaler], ids=["GradScaler", "LossScaler"])
def test_custom_optimizer_gets_the_scaler_or_the_attributes(make):
    """``test_grad_scaler_pass_itself``: an amp-aware optimizer whose ``step`` takes a
    ``grad_scaler`` keyword is handed the scaler itself (with GradScaler's FutureWarning) and no
    attributes; one without it gets ``grad_scale``/``found_inf`` tensors."""
    m = torch.nn.Linear(4, 1)
    o1, o2 = _TakesTheScaler(m.parameters()), _ReadsTheAttributes(m.parameters())
    scaler = make(init_scale=2.0)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = m(torch.randn(4, 4)).float().mean()
    scaler.scale(loss).backward()
    with pytest.warns(FutureWarning):
        scaler.step(o1)
    scaler.step(o2)
    scaler.update()
    assert o1.seen == (scaler, False, False)
    assert o2.seen == (torch.Tensor, torch.Tensor)
    assert scaler.get_scale() == 2.0


def test_dense_unscale_of_mixed_dtypes_like_gradscaler():
    """``test_grad_scaling_unscale``: gradients of several dtypes (fp32, bf16; fp16 where allowed,
    as for a fused step) unscaled by one reciprocal, a NaN in one of them found; the unscaled
    values and found_inf equal GradScaler's; LossScaler.unscale_ as GradScaler.unscale_."""
    torch.manual_seed(11)
    values = [
        torch.randn(5) * 1024,
        (torch.randn(3, 3) * 1024).bfloat16(),
        (torch.randn(4) * 1024).half(),
        torch.randn(2, 2) * 1024,
    ]
    for nan_at in (None, 1, 2):
        made = []
        for _ in range(2):
            params = [torch.nn.Parameter(torch.zeros_like(v)) for v in values]
            for j, (p, v) in enumerate(zip(params, values)):
                p.grad = v.clone()
                if j == nan_at:
                    p.grad.view(-1)[0] = NAN
            made.append(params)
        inv = torch.full((), 1.0 / 3.0)
        found_ref = gradscaler()._unscale_grads_(
            torch.optim.SGD(made[0], lr=0.0), inv, torch.zeros(()), allow_fp16=True
        )
        found = check_and_unscale(torch.optim.SGD(made[1], lr=0.0), inv, allow_fp16=True)
        assert [f.item() for f in found.values()] == [f.item() for f in found_ref.values()]
        assert found[torch.device("cpu")].item() == float(nan_at is not None)
        assert_same([p.grad for p in made[1]], [p.grad for p in made[0]])
    results = []
    for s in both(init_scale=3.0):
        params = [torch.nn.Parameter(torch.zeros_like(v)) for v in values if v.dtype != torch.half]
        for p, v in zip(params, [v for v in values if v.dtype != torch.half]):
            p.grad = v.clone()
        s.scale(torch.ones(()))
        s.unscale_(torch.optim.SGD(params, lr=0.0))
        results.append([p.grad for p in params])
    assert_same(results[1], results[0])


def test_param_groups_and_missing_grads_are_bitwise_gradscalers():
    """Two parameter groups (own lr, weight decay), a frozen layer and a parameter whose grad is
    None: only existing gradients are unscaled and checked, as GradScaler's unscale_ does."""
    model, data = model_and_data(12)
    model[0].bias.requires_grad_(False)
    results = []
    for s, m in zip(both(init_scale=256.0, growth_interval=2), (twin(model), model)):
        extra = torch.nn.Parameter(torch.ones(3))  # never used: its grad stays None
        opt = torch.optim.AdamW(
            [
                {"params": [m[0].weight, m[0].bias, extra], "lr": 0.01},
                {"params": m[2].parameters(), "lr": 0.02, "weight_decay": 0.1},
            ]
        )
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(m(x).float(), y)
            s.scale(loss).backward()
            if i == 1:
                m[0].weight.grad[0, 0] = INF
            s.step(opt)
            s.update()
        assert extra.grad is None
        results.append((scaler_state(s), list(m.parameters())))
    assert results[0][0] == results[1][0]
    assert_same(results[0][1], results[1][1])


@pytest.mark.parametrize("opt_name", ["adam_fused", "sgd_fused"])
def test_fp16_parameters_with_a_fused_optimizer_are_bitwise_gradscalers(opt_name):
    """A fused optimizer accepts fp16 gradients (GradScaler checks them with allow_fp16 and lets
    the kernel unscale): a half model trained under both scalers, an overflow skipped."""
    model, data = model_and_data(13, n=4)
    model.half()
    results = []
    for s, m in zip(both(init_scale=64.0, growth_interval=1), (twin(model), model)):
        opt = OPTIMIZERS[opt_name](m.parameters())
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            out = m(x.half() * (1e4 if i == 2 else 1.0))
            s.scale(torch.nn.functional.mse_loss(out.float(), y)).backward()
            s.step(opt)
            s.update()
        results.append((scaler_state(s), list(m.parameters())))
    assert results[0][0] == results[1][0]
    assert results[0][0][0] < 64.0 * 2**4  # the overflow happened
    assert_same(results[0][1], results[1][1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_scale_keeps_the_outputs_dtype_and_value(dtype):
    """scale() multiplies by the fp32 0-d scale: a half loss stays half, values bitwise."""
    t = (torch.randn(3) * 100).to(dtype)
    ref, ours = both(init_scale=2.0**10)
    a, b = ref.scale(t), ours.scale(t)
    assert a.dtype == b.dtype == dtype
    assert_same([b], [a])


def test_pickled_every_step_is_bitwise_gradscalers():
    """``_grad_scaling_autocast_test(try_pickle=True)``: the scaler pickled and restored after every
    update continues the same sequence (scale and growth tracker travel as host values)."""
    model, data = model_and_data(14)
    results = []
    for s, m in zip(both(init_scale=128.0, growth_interval=2), (twin(model), model)):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for i, (x, y) in enumerate(data):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.mse_loss(m(x).float(), y)
            s.scale(loss).backward()
            if i == 3:
                m[2].weight.grad[0, 0] = INF
            s.step(opt)
            s.update()
            s = pickle.loads(pickle.dumps(s))
        results.append((scaler_state(s), list(m.parameters())))
    assert results[0][0] == results[1][0]
    assert_same(results[0][1], results[1][1])


def _gradscaler_fp16_loss(model, x, y):
    with torch.autocast("cpu", dtype=torch.float16):
        return torch.nn.functional.mse_loss(model(x).float(), y)


def test_mixed_precision_penalty_is_bitwise_gradscalers():
    """``test_grad_scaling_penalty`` through MixedPrecision: ``autograd.grad(amp.scale(loss))``
    unscaled by ``1 / amp.get_scale()``, the penalty added, ``amp.backward``/``amp.step``."""
    model, data = model_and_data(15, n=4)
    data[2] = (data[2][0] * 1e6, data[2][1])
    ref_model = twin(model)
    kw = dict(init_scale=128.0, growth_interval=1)
    ref = gradscaler(**kw)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.05)
    amp = MixedPrecision("fp16", device="cpu", **kw)
    model, opt = amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
    for x, y in data:
        loss = _gradscaler_fp16_loss(ref_model, x, y)
        grads = torch.autograd.grad(
            ref.scale(loss), list(ref_model.parameters()), create_graph=True
        )
        inv = 1.0 / ref.get_scale()
        ref.scale(loss + sum((g * inv).pow(2).sum() for g in grads).sqrt()).backward()
        ref.step(ref_opt)
        ref.update()
        ref_opt.zero_grad(set_to_none=True)

        with amp.autocast():
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        grads = torch.autograd.grad(amp.scale(loss), list(model.parameters()), create_graph=True)
        inv = 1.0 / amp.get_scale()
        amp.backward(loss + sum((g * inv).pow(2).sum() for g in grads).sqrt())
        amp.step()
        assert amp.get_scale() == ref.get_scale()
    assert ref.get_scale() == 128.0 * 2**3 / 2
    assert_same(model.parameters(), ref_model.parameters())


def test_mixed_precision_two_losses_two_optimizers_are_bitwise_gradscalers():
    """``test_grad_scaling_multiple`` through MixedPrecision: two sub-models each with its own
    optimizer, two losses backpropagated into the same gradients (``micro_step_done=False``)."""
    (m0, data), (m1, _) = model_and_data(16), model_and_data(17)
    data[3] = (data[3][0] * 1e6, data[3][1])
    model = torch.nn.ModuleList([m0, m1])
    ref_model = twin(model)
    kw = dict(init_scale=128.0, growth_interval=1)

    def losses(mods, x, y):
        out0, out1 = mods[0](x).float(), mods[1](x).float()
        return (
            torch.nn.functional.mse_loss(0.3 * out0 + 0.7 * out1, y),
            torch.nn.functional.mse_loss(0.6 * out0 - 0.4 * out1, y),
        )

    ref = gradscaler(**kw)
    r0 = torch.optim.SGD(ref_model[0].parameters(), lr=0.1)
    r1 = torch.optim.Adam(ref_model[1].parameters(), lr=0.01)
    amp = MixedPrecision("fp16", device="cpu", **kw)
    model, o0, o1 = amp.setup(
        model,
        torch.optim.SGD(model[0].parameters(), lr=0.1),
        torch.optim.Adam(model[1].parameters(), lr=0.01),
    )
    for x, y in data:
        with torch.autocast("cpu", dtype=torch.float16):
            loss0, loss1 = losses(ref_model, x, y)
        ref.scale(loss0).backward(retain_graph=True)
        ref.scale(loss1).backward()
        ref.unscale_(r0)
        ref.step(r0)
        ref.step(r1)
        ref.update()
        r0.zero_grad(set_to_none=True)
        r1.zero_grad(set_to_none=True)

        with amp.autocast():
            loss0, loss1 = losses(model, x, y)
        amp.backward(loss0, retain_graph=True, micro_step_done=False)
        amp.backward(loss1)
        amp.step()
        assert amp.get_scale() == ref.get_scale()
    assert ref.get_scale() == 128.0 * 2**5 / 2
    assert_same(model.parameters(), ref_model.parameters())


def test_an_optimizer_without_gradients_is_a_difference_from_gradscaler():
    """A difference (ampkit is lenient, GradScaler asserts): step() for an optimizer none of whose
    parameters has a gradient this iteration (a frozen part) steps it as a no-op under LossScaler,
    where GradScaler raises "No inf checks were recorded"; the scale follows the other optimizers.
    update() before any scale/unscale_/step raises a RuntimeError (GradScaler: AssertionError)."""
    a, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    oa, ob = torch.optim.SGD([a], lr=1.0), torch.optim.SGD([b], lr=1.0)
    ref, ours = both(init_scale=4.0, growth_interval=1)
    for s in (ref, ours):
        s.scale(a.sum()).backward()
        s.step(oa)
    with pytest.raises(AssertionError, match="No inf checks"):
        ref.step(ob)
    ours.step(ob)
    ours.update()
    assert ours.get_scale() == 8.0 and torch.equal(b, torch.ones(2))
    with pytest.raises(RuntimeError, match="update"):
        LossScaler().update()
