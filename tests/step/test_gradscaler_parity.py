"""PyTorch's own GradScaler scaling tests, run with ``ampkit.LossScaler`` in place of ``torch.amp.GradScaler``.

The cases of pytorch/pytorch ``test/test_cuda.py`` (``TestCuda.test_grad_scaling_state_dict``,
``_run_scaling_case``, ``_grad_scaling_autocast_test``, ``test_grad_scale_will_not_overflow``,
``test_grad_scaling_clipping``, ``test_grad_scaling_clipping_separate_unscale``,
``test_grad_scaling_penalty``, ``test_grad_scaling_accumulation``, ``test_grad_scaling_multiple``,
``test_grad_scaling_scale``; device-generic in later torch, as in ``test/test_torch.py``'s
``TestTorchDeviceType``), re-written for ``device="cpu"`` with the same scenarios, values and checks
(torch's source is read, not copied). The models, data and
optimizers are built as torch's helper ``torch.testing._internal.common_cuda._create_scaling_case``
builds them (re-written here: importing it needs ``expecttest``). Each test runs twice: with
``torch.amp.GradScaler`` (the cases hold for
it as written) and with ``LossScaler`` given the same keyword arguments; the checks are torch's
(scale after N growths and M backoffs; gradients, optimizer state and parameters equal to the
unscaled control run with torch's tolerances; pickling between iterations).
"""

import pickle
from itertools import chain

import pytest
import torch

from ampkit import LossScaler

DEVICE = "cpu"


def _create_scaling_models_optimizers(
    device=DEVICE, optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None
):
    """As torch's helper of that name: a model to scale and an identical control model, each with its optimizer."""
    mod_control = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(
        device=device
    )
    mod_scaling = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8)).to(
        device=device
    )
    with torch.no_grad():
        for c, s in zip(mod_control.parameters(), mod_scaling.parameters()):
            s.copy_(c)
    kwargs = {"lr": 1.0, **(optimizer_kwargs or {})}
    return (
        mod_control,
        mod_scaling,
        optimizer_ctor(mod_control.parameters(), **kwargs),
        optimizer_ctor(mod_scaling.parameters(), **kwargs),
    )


def _create_scaling_case(
    device=DEVICE, dtype=torch.float, optimizer_ctor=torch.optim.SGD, optimizer_kwargs=None
):
    """As torch's helper of that name: the models, 4 random (input, target) batches, MSE, skip at iteration 2."""
    data = [
        tuple(torch.randn((8, 8), dtype=dtype, device=device) for _ in range(2)) for _ in range(4)
    ]
    models = _create_scaling_models_optimizers(device, optimizer_ctor, optimizer_kwargs)
    return (*models, data, torch.nn.MSELoss().to(device), 2)


SCALERS = {"GradScaler": lambda **kw: torch.amp.GradScaler(DEVICE, **kw), "LossScaler": LossScaler}


@pytest.fixture(params=list(SCALERS))
def make_scaler(request):
    return SCALERS[request.param]


def assert_close(a, b, atol, rtol=1e-05):
    torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


def run_scaling_case(
    make_scaler,
    run,
    unskipped,
    skipped,
    atol=1e-7,
    optimizer_ctor=torch.optim.SGD,
    optimizer_kwargs=None,
):
    """torch's ``_run_scaling_case``: the scaling run against an unscaled control, scaling on and off."""
    for enabled in True, False:  # scaling can be disabled without changing the loop
        mod_control, mod_scaling, opt_control, opt_scaling, data, loss_fn, skip_iter = (
            _create_scaling_case(
                device=DEVICE, optimizer_ctor=optimizer_ctor, optimizer_kwargs=optimizer_kwargs
            )
        )
        # a modest initial scale and an unrealistically large growth rate magnify growth errors
        scaler = make_scaler(
            init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1
        )
        run(data, mod_control, opt_control, scaler, loss_fn, skip_iter, False)
        ret = run(data, mod_scaling, opt_scaling, scaler, loss_fn, skip_iter, True)
        scaler = ret if ret else scaler
        if enabled:
            net_growth = scaler.get_growth_factor() ** unskipped if unskipped > 0 else 1.0
            net_backoff = scaler.get_backoff_factor() ** skipped if skipped > 0 else 1.0
            assert scaler.get_scale() == (128.0 * net_growth * net_backoff)
        else:
            assert scaler.get_scale() == 1.0
        for c, s in zip(mod_control.parameters(), mod_scaling.parameters()):
            assert_close(c.grad, s.grad, atol)
            c_state, s_state = opt_control.state[c], opt_scaling.state[s]
            for k in c_state:
                assert_close(c_state[k], s_state[k], atol)
            assert_close(c, s, atol)


def plain_step(model, optimizer, loss, scaler, i, skip_iter, clip=None):
    """The control run: no scaling; the step skipped where the scaling run injects an inf."""
    loss.backward()
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    if (not scaler.is_enabled()) or (i != skip_iter):
        optimizer.step()


def inject_inf(model, scaler, i, skip_iter):
    if i == skip_iter and scaler.is_enabled():
        with torch.no_grad():
            model[1].weight.grad.fill_(float("inf"))


@pytest.mark.parametrize("lazy_init_scale", [True, False])
def test_grad_scaling_state_dict(make_scaler, lazy_init_scale):
    s0 = make_scaler(init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    s1 = make_scaler(init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
    s1._init_growth_tracker = 7  # a value for load_state_dict to overwrite
    if lazy_init_scale:
        s1.scale(
            torch.full((1,), 4.0, dtype=torch.float32, device=DEVICE)
        )  # the scale tensor exists
        assert isinstance(s1._scale, torch.FloatTensor)
    s1.load_state_dict(s0.state_dict())
    assert s1.get_scale() == 3.0
    assert s1.get_growth_factor() == 4.0
    assert s1.get_backoff_factor() == 0.5
    assert s1.get_growth_interval() == 2
    assert s1._init_growth_tracker == 0


def test_grad_scaling_scale(make_scaler):
    scaler = make_scaler(init_scale=2.0)
    t0 = torch.full((1,), 4.0, dtype=torch.float32, device=DEVICE)
    t1 = torch.full((1,), 4.0, dtype=torch.float32, device=DEVICE)
    outputs = scaler.scale(t0)
    assert outputs.item() == 8.0
    outputs = (t1.clone(), (t0.clone(), t1.clone()), [t0.clone(), (t1.clone(), t0.clone())])
    outputs = scaler.scale(outputs)
    assert outputs[0] == 8.0 and outputs[1][0] == 8.0 and outputs[1][1] == 8.0
    assert outputs[2][0] == 8.0 and outputs[2][1][0] == 8.0 and outputs[2][1][1] == 8.0
    assert scaler._scale.device == t1.device
    assert [t.item() for t in scaler.scale(iter([t0, t1]))] == [8.0, 8.0]  # any iterable, lazily
    with pytest.raises(ValueError):
        scaler.scale([t0, 3])


def test_grad_scale_will_not_overflow(make_scaler):
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 1).to(DEVICE)
    optimizer = torch.optim.Adam(model.parameters())
    scaler = make_scaler(growth_interval=1, growth_factor=2**4, init_scale=1e38)
    optimizer.zero_grad()
    x = torch.randn(1, 5, device=DEVICE)
    y = 1e-30 * torch.randn(1, 1, device=DEVICE)
    loss = ((model(x) - y) ** 2).mean()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    assert scaler._scale != float("inf") and scaler._scale != float("nan")


@pytest.mark.parametrize("optimizer_kwargs", [None, {"foreach": True}], ids=["default", "foreach"])
def test_grad_scaling_autocast(make_scaler, optimizer_kwargs):
    """No scaling, no autocast against scaling + autocast; a second pass pickles the scaler every step."""
    for try_pickle in (False, True):

        def run(
            data,
            model,
            optimizer,
            scaler,
            loss_fn,
            skip_iter,
            try_scaling_api,
            try_pickle=try_pickle,
        ):
            for i, (input, target) in enumerate(data):
                optimizer.zero_grad()
                with torch.autocast(DEVICE, dtype=torch.half, enabled=try_scaling_api):
                    loss = loss_fn(model(input), target)
                if not try_scaling_api:
                    plain_step(model, optimizer, loss, scaler, i, skip_iter)
                    continue
                scaler.scale(loss).backward()
                inject_inf(model, scaler, i, skip_iter)
                scaler.step(optimizer)
                scaler.update()
                if try_pickle:
                    scaler = pickle.loads(pickle.dumps(scaler))
            return scaler

        # atol=1e-3: pure fp32 arithmetic against a mixture of low precision and fp32
        run_scaling_case(
            make_scaler, run, unskipped=3, skipped=1, atol=1e-3, optimizer_kwargs=optimizer_kwargs
        )


def test_grad_scaling_clipping(make_scaler):
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2  # a value that has an effect on these gradients
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(input), target)
            if not try_scaling_api:
                plain_step(model, optimizer, loss, scaler, i, skip_iter, clip=max_norm)
                continue
            scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm * scaler.get_scale())
            inject_inf(model, scaler, i, skip_iter)
            scaler.step(optimizer)
            scaler.update()

    run_scaling_case(make_scaler, run, unskipped=3, skipped=1, atol=1e-5)


def test_grad_scaling_clipping_separate_unscale(make_scaler):
    """``unscale_`` before clipping -- on a disabled scaler too (a no-op there, as GradScaler's)."""

    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        max_norm = 0.2
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(input), target)
            if not try_scaling_api:
                plain_step(model, optimizer, loss, scaler, i, skip_iter, clip=max_norm)
                continue
            scaler.scale(loss).backward()
            inject_inf(model, scaler, i, skip_iter)
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, error_if_nonfinite=False)
            scaler.step(optimizer)
            scaler.update()

    run_scaling_case(make_scaler, run, unskipped=3, skipped=1)


def test_grad_scaling_penalty(make_scaler):
    """Gradient penalty: ``autograd.grad`` of the scaled loss, unscaled by hand."""

    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        for i, (input, target) in enumerate(data):
            optimizer.zero_grad()
            loss = loss_fn(model(input), target)
            if try_scaling_api:
                grad_params = torch.autograd.grad(
                    scaler.scale(loss), model.parameters(), create_graph=True
                )
                inv_scale = 1.0 / scaler.get_scale()
                grad_params = [p * inv_scale for p in grad_params]
            else:
                grad_params = torch.autograd.grad(loss, model.parameters(), create_graph=True)
            grad_norm = 0
            for grad in grad_params:
                grad_norm += grad.pow(2).sum()
            loss = loss + grad_norm.sqrt()
            if not try_scaling_api:
                plain_step(model, optimizer, loss, scaler, i, skip_iter)
                continue
            scaler.scale(loss).backward()
            inject_inf(model, scaler, i, skip_iter)
            scaler.step(optimizer)
            scaler.update()

    run_scaling_case(make_scaler, run, unskipped=3, skipped=1)


def test_grad_scaling_accumulation(make_scaler):
    def run(data, model, optimizer, scaler, loss_fn, skip_iter, try_scaling_api):
        iters_to_accumulate = 2
        for i, (input, target) in enumerate(data):
            loss = loss_fn(model(input), target) / iters_to_accumulate
            (scaler.scale(loss) if try_scaling_api else loss).backward()
            if (i + 1) % iters_to_accumulate == 0:
                if try_scaling_api:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                optimizer.zero_grad()

    run_scaling_case(make_scaler, run, unskipped=2, skipped=0)


@pytest.mark.parametrize("enabled", [True, False])
def test_grad_scaling_multiple(make_scaler, enabled):
    """Two models and two optimizers, both fed by two losses (one unscaled separately)."""
    mod_control0, mod_scaling0, opt_control0, opt_scaling0, data, loss_fn, skip_iter = (
        _create_scaling_case(DEVICE)
    )
    mod_control1, mod_scaling1, opt_control1, opt_scaling1 = _create_scaling_models_optimizers(
        DEVICE
    )
    scaler = make_scaler(init_scale=128.0, growth_factor=2.0, enabled=enabled, growth_interval=1)

    def run(model0, model1, optimizer0, optimizer1, try_scaling_api):
        for i, (input, target) in enumerate(data):
            optimizer0.zero_grad()
            optimizer1.zero_grad()
            output0, output1 = model0(input), model1(input)
            loss0 = loss_fn(0.3 * output0 + 0.7 * output1, target)
            loss1 = loss_fn(0.6 * output0 - 0.4 * output1, target)
            if try_scaling_api:
                scaler.scale(loss0).backward(retain_graph=True)
                scaler.scale(loss1).backward()
                inject_inf(model1, scaler, i, skip_iter)
                scaler.unscale_(optimizer0)
                scaler.step(optimizer0)
                scaler.step(optimizer1)
                scaler.update()
            else:
                loss0.backward(retain_graph=True)
                loss1.backward()
                optimizer0.step()
                if (not scaler.is_enabled()) or (i != skip_iter):
                    optimizer1.step()

    run(mod_control0, mod_control1, opt_control0, opt_control1, False)
    run(mod_scaling0, mod_scaling1, opt_scaling0, opt_scaling1, True)
    # grown 3 times, backed off once
    expected = (
        128.0 * scaler.get_growth_factor() ** 3 * scaler.get_backoff_factor() ** 1
        if enabled
        else 1.0
    )
    assert scaler.get_scale() == expected
    for c, s in zip(
        chain(mod_control0.parameters(), mod_control1.parameters()),
        chain(mod_scaling0.parameters(), mod_scaling1.parameters()),
    ):
        assert_close(c, s, atol=1e-7)


# ---------------------------------------------------------------- beyond torch's cases: the drop-in's surface
def test_disabled_scaler_methods_are_gradscalers_no_ops(make_scaler):
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = make_scaler(enabled=False)
    loss = model(torch.ones(2, 3)).sum()
    assert scaler.scale(loss) is loss and not scaler.is_enabled()
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    assert scaler.unscale_(opt) is None
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    before = [p.detach().clone() for p in model.parameters()]
    scaler.step(opt)
    assert not any(torch.equal(b, p) for b, p in zip(before, model.parameters()))  # it stepped
    assert scaler.update() is None and scaler.update(new_scale=4.0) is None
    assert scaler.get_scale() == 1.0 and scaler.state_dict() == {}
    scaler.load_state_dict({"scale": 8.0})  # ignored
    assert scaler.get_scale() == 1.0
    assert pickle.loads(pickle.dumps(scaler)).is_enabled() is False


def test_setters_and_update_new_scale(make_scaler):
    scaler = make_scaler(init_scale=4.0)
    scaler.set_growth_factor(3.0)
    scaler.set_backoff_factor(0.25)
    scaler.set_growth_interval(5)
    assert (
        scaler.get_growth_factor(),
        scaler.get_backoff_factor(),
        scaler.get_growth_interval(),
    ) == (3.0, 0.25, 5)
    assert scaler.state_dict()["growth_factor"] == 3.0
    scaler.scale(torch.ones(()))
    scaler.update(new_scale=16.0)
    assert scaler.get_scale() == 16.0
    scaler.update(new_scale=torch.tensor(32.0))
    assert scaler.get_scale() == 32.0


def test_pickling_only_between_iterations(make_scaler):
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = make_scaler(init_scale=8.0, growth_interval=1)
    scaler.scale(model(torch.ones(2, 3)).sum()).backward()
    scaler.unscale_(opt)
    with pytest.raises((AssertionError, RuntimeError)):
        pickle.dumps(scaler)
    scaler.step(opt)
    scaler.update()
    copy = pickle.loads(pickle.dumps(scaler))
    assert copy.get_scale() == scaler.get_scale() == 16.0
    assert copy.state_dict() == scaler.state_dict()


def test_loss_scaler_settings_rejected_with_a_reason():
    scaler = LossScaler()
    for setter, bad in (
        (scaler.set_growth_factor, 1.0),
        (scaler.set_backoff_factor, 1.5),
        (scaler.set_growth_interval, 0),
    ):
        with pytest.raises(ValueError, match="invalid"):
            setter(bad)
