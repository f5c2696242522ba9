"""The optimizer steps in backward (step/in_backward.py): bitwise the ordinary step, gradients freed as
they are used, non-finite gradients kept out of the weights, refusals, schedulers, resume."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F

import ampkit.step.in_backward as in_backward
from ampkit import MixedPrecision
from ampkit.step.config import ConfigError
from ampkit.step.hardware import device_info
from ampkit.step.precision import resolve_precision

VOCAB, DIM, CTX = 64, 16, 4

# precision, rung: every form the optimizer can step in backward bitwise
EXACT = [
    ("fp32", {}),
    ("bf16", {}),
    ("bf16-pure", {}),
    ("bf16-pure", {"masters": "split"}),
    ("bf16-pure", {"masters": "kahan"}),
    ("bf16-pure", {"masters": "split", "keep_fp32": ("norm",)}),
    pytest.param(
        "bf16-pure",
        {"masters": "none", "allow_stall": True},
        marks=pytest.mark.filterwarnings("ignore:bf16-pure with masters='none'"),
    ),
]
OPTIMIZERS = ["sgd", "sgd-momentum", "adamw", "adamw-fused"]


class TiedLM(torch.nn.Module):
    """An embedding (tied to the output head, so one weight gets two gradient contributions) + an MLP."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.emb = torch.nn.Embedding(VOCAB, DIM)
        self.up = torch.nn.Linear(DIM * CTX, 32)
        self.norm = torch.nn.LayerNorm(32)
        self.down = torch.nn.Linear(32, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.down(F.gelu(self.norm(self.up(self.emb(x).flatten(1)))))
        return F.linear(h, self.emb.weight)


def _opt(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    groups = [
        {"params": decay},
        {"params": rest, "weight_decay": 0.0, "lr": 3e-3},
    ]  # two groups, two lrs
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=0.05)
    if kind == "sgd-momentum":
        return torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=0.01)
    if kind == "adam":
        return torch.optim.Adam(groups, lr=1e-2)
    if kind == "adafactor":  # per-tensor factored second moments: exact per parameter too
        return torch.optim.Adafactor(groups, lr=1e-2)
    if kind == "rmsprop":
        return torch.optim.RMSprop(groups, lr=1e-3, momentum=0.9)
    if kind == "adagrad":
        return torch.optim.Adagrad(groups, lr=1e-2)
    return torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.1, fused=kind == "adamw-fused")


def _batches(n: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randint(0, VOCAB, (8, CTX), generator=g), torch.randint(0, VOCAB, (8,), generator=g))
        for _ in range(n)
    ]


def _build(inb: bool, precision: str, rung: dict, opt_kind: str = "adamw", seed: int = 0):
    model = TiedLM(seed)
    opt = _opt(opt_kind, model)
    amp = MixedPrecision(precision, device="cpu", optimizer_in_backward=inb, **rung)
    model, opt = amp.setup(model, opt)
    return amp, model, opt


def _train(amp, model, opt, batches, sched=None) -> list:
    results = []
    for x, y in batches:
        with amp.autocast():
            loss = F.cross_entropy(model(x).float(), y)
        amp.backward(loss)
        results.append(amp.step(opt))
        if sched is not None:
            sched.step()
    return results


def _state(amp, opt) -> dict:
    """Everything the step writes, in fp32 values and bits: weights (the masters' values), optimizer state."""
    out = {f"w.{k}": v for k, v in amp.full_precision_state_dict().items()}
    for i, st in opt.state_dict()["state"].items():
        for k, v in st.items():
            out[f"s.{i}.{k}"] = v
    return out


def _assert_bitwise(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), f"{k} differs"


@pytest.mark.parametrize("opt_kind", OPTIMIZERS)
@pytest.mark.parametrize(
    ("precision", "rung"),
    EXACT,
    ids=lambda v: "-".join(map(str, v.values())) if isinstance(v, dict) else v,
)
def test_bitwise_equal_to_the_ordinary_step(precision, rung, opt_kind) -> None:
    batches = _batches(3)
    ref = _build(False, precision, rung, opt_kind)
    _train(*ref, batches)
    amp, model, opt = _build(True, precision, rung, opt_kind)
    results = _train(amp, model, opt, batches)
    _assert_bitwise(_state(ref[0], ref[2]), _state(amp, opt))
    assert all(not r.found_inf for r in results)
    assert all(
        p.grad is None for p in [*model.parameters(), *amp.master_params()]
    )  # nothing left held


@pytest.mark.parametrize("opt_kind", ["adafactor", "rmsprop", "adagrad"])
def test_bitwise_for_other_optimizers(opt_kind) -> None:
    test_bitwise_equal_to_the_ordinary_step("bf16-pure", {"masters": "split"}, opt_kind)


def test_bitwise_when_the_check_is_made_on_the_device(monkeypatch) -> None:
    """Off the CPU the check is a device flag: a fused optimizer gets it as ``found_inf`` (0: the
    same update), another reads it (one sync); forced here by taking away the host decision."""
    monkeypatch.setattr(in_backward, "cpu_all_finite", lambda *a, **k: None)
    batches = _batches(3)
    for kind, rung in [
        ("adamw-fused", {}),
        ("sgd-momentum", {}),
        ("adam", {}),
        ("adamw-fused", {"masters": "split"}),
    ]:
        ref = _build(False, "bf16-pure", rung, kind)
        _train(*ref, batches)
        amp, model, opt = _build(True, "bf16-pure", rung, kind)
        _train(amp, model, opt, batches)
        _assert_bitwise(_state(ref[0], ref[2]), _state(amp, opt))


@pytest.mark.parametrize(
    "rung",
    [
        {"masters": "stochastic"},
        {"state_dtype": "bf16"},
        {"masters": "stochastic", "state_dtype": "bf16"},
    ],
)
def test_stochastic_rounding_rungs(rung) -> None:
    """The random bits are drawn in backward order, not model order: with one weight the order is the
    same (bitwise); with several, one step lands each value on the same fp32 value's other bf16
    neighbour at most (within one bf16 spacing of the ordinary step)."""

    def one_weight(inb: bool):
        torch.manual_seed(0)
        model = torch.nn.Linear(16, 8, bias=False)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        amp = MixedPrecision("bf16-pure", device="cpu", optimizer_in_backward=inb, **rung)
        model, opt = amp.setup(model, opt)
        g = torch.Generator().manual_seed(3)
        for _ in range(3):
            x, y = torch.randn(4, 16, generator=g), torch.randn(4, 8, generator=g)
            with amp.autocast():
                loss = F.mse_loss(model(x).float(), y)
            amp.backward(loss)
            amp.step(opt)
        return _state(amp, opt)

    _assert_bitwise(one_weight(False), one_weight(True))
    batches = _batches(1)
    ref = _build(False, "bf16-pure", rung)
    _train(*ref, batches)
    amp, _, opt = _build(True, "bf16-pure", rung)
    _train(amp, _, opt, batches)
    a, b = _state(ref[0], ref[2]), _state(amp, opt)
    for k in a:
        if a[k].is_floating_point() and a[k].dim():
            spacing = (
                torch.finfo(torch.bfloat16).eps * a[k].abs().float()
            )  # >= one bf16 spacing at |a|
            assert torch.all((a[k].float() - b[k].float()).abs() <= spacing), k


def _grad_peak(inb: bool, precision: str, rung: dict) -> tuple[int, int, int]:
    """(largest bytes of gradients alive at any gradient hook, one parameter's largest gradient, all)."""
    model = TiedLM()
    live: list[int] = []

    def count(
        _: torch.Tensor,
    ) -> None:  # registered first: runs before ampkit's hook frees the gradient
        tensors = [*model.parameters(), *amp.master_params()]
        live.append(sum(t.grad.nbytes for t in tensors if t.grad is not None))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(count)
    opt = _opt("adamw", model)
    amp = MixedPrecision(precision, device="cpu", optimizer_in_backward=inb, **rung)
    amp.setup(model, opt)
    _train(amp, model, opt, _batches(1))
    grads = [p.numel() * (2 if precision == "bf16-pure" else 4) for p in model.parameters()]
    return max(live), max(grads), sum(grads)


@pytest.mark.parametrize(("precision", "rung"), [("fp32", {}), ("bf16-pure", {"masters": "split"})])
def test_no_full_set_of_gradients_is_held(precision, rung) -> None:
    peak, one, total = _grad_peak(True, precision, rung)
    assert peak <= one < total
    ordinary, _, _ = _grad_peak(False, precision, rung)
    assert ordinary == total  # the ordinary step holds them all before it steps


class Sqrt(torch.nn.Module):
    """``sqrt(|w| * x)``: a finite forward whose backward is infinite where ``w * x`` is 0."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sqrt(self.w.abs() * x)


@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize("kind", ["adamw", "adamw-fused", "sgd-momentum"])
def test_a_nonfinite_gradient_never_reaches_the_weights(kind, where, monkeypatch) -> None:
    if where == "device":
        monkeypatch.setattr(in_backward, "cpu_all_finite", lambda *a, **k: None)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Sqrt(), torch.nn.Linear(8, 4))
    with torch.no_grad():
        model[1].w[3] = 0.0  # d/dw sqrt(|w| x) at w = 0: infinite
    opt = _opt(kind, model)
    amp = MixedPrecision("bf16", device="cpu", optimizer_in_backward=True)
    amp.setup(model, opt)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    x = torch.rand(2, 8) + 0.5
    with amp.autocast():
        h = model[0](x).float().abs()
        loss = model[2](model[1](h)).float().pow(2).mean()
    assert torch.isfinite(loss)
    amp.backward(loss)
    result = amp.step(opt)
    assert bool(result.found_inf)
    assert amp.stats()["skipped_steps"] == 1
    after = dict(model.named_parameters())
    for n, p in after.items():
        assert torch.isfinite(p).all(), n
    # the non-finite gradient's parameter and those whose gradients came after it: untouched
    for n in ("1.w", "0.weight", "0.bias"):
        assert torch.equal(after[n], before[n]), n
    for st in opt.state.values():
        assert all(torch.isfinite(v).all() for v in st.values() if isinstance(v, torch.Tensor))
    # the head's gradient was final (and finite) first: its update was taken -- a partial step
    assert not torch.equal(after["2.weight"], before["2.weight"])


def test_a_nonfinite_loss_takes_no_update() -> None:
    amp, model, opt = _build(True, "bf16-pure", {"masters": "split"}, "adamw")
    before = {k: v.clone() for k, v in amp.full_precision_state_dict().items()}
    x, y = _batches(1)[0]
    with amp.autocast():
        loss = F.cross_entropy(model(x).float(), y) * float("inf")
    amp.backward(loss)
    assert bool(amp.step(opt).found_inf)
    _assert_bitwise(before, amp.full_precision_state_dict())
    assert not opt.state  # no optimizer state was made either


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"accumulation_steps": 2}, ["accumulation_steps=2", "must be 1"]),
        ({"clip_grad_norm": 1.0}, ["clip_grad_norm=1.0", "must be None", "global norm"]),
        ({"precision": "fp16"}, ["precision='fp16'", "without loss scaling", "bf16"]),
        ({"precision": "fp16-pure"}, ["precision='fp16-pure'", "without loss scaling"]),
    ],
)
def test_refused_where_it_cannot_be_exact(settings, words) -> None:
    settings = {"precision": "bf16", **settings}
    with pytest.raises(ConfigError) as e:
        MixedPrecision(device="cpu", optimizer_in_backward=True, **settings)
    for w in words:
        assert w in str(e.value)
    MixedPrecision(device="cpu", optimizer_in_backward=False, **settings)  # fine without it


def test_refusals_at_setup_and_in_use() -> None:
    cpu = device_info(torch.device("cpu"))
    model = TiedLM()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    why = in_backward.refusal(
        resolve_precision("fp16", cpu), [sgd], "none"
    )  # e.g. 'auto' on a pre-Ampere GPU
    assert "'fp16'" in why and "dynamic loss scaling" in why and "bf16" in why
    why = in_backward.refusal(resolve_precision("bf16", cpu), [sgd], "ddp")
    assert "DDP" in why and "optimizer_in_backward=False" in why
    amp = MixedPrecision("bf16", device="cpu", optimizer_in_backward=True)
    with pytest.raises(ConfigError, match="LBFGS.*closure"):
        amp.setup(model, torch.optim.LBFGS(model.parameters()))
    amp, model, opt = _build(True, "bf16", {})
    x, y = _batches(1)[0]
    with amp.autocast():
        loss = F.cross_entropy(model(x).float(), y)
    with pytest.raises(ValueError, match="micro_step_done=False"):
        amp.backward(loss, micro_step_done=False)
    amp.backward(loss)
    with pytest.raises(ConfigError, match="clip_grad_norm=1.0"):
        amp.step(opt, clip_grad_norm=1.0)


def test_the_scheduler_sets_the_learning_rate_of_each_parameter(recwarn) -> None:
    batches = _batches(4)
    runs = []
    for inb in (False, True):
        amp, model, opt = _build(inb, "bf16-pure", {"masters": "split"}, "adamw")
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
        _train(amp, model, opt, batches, sched)
        runs.append(_state(amp, opt))
    _assert_bitwise(*runs)
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]


@pytest.mark.parametrize(("precision", "rung"), [("fp32", {}), ("bf16-pure", {"masters": "split"})])
def test_checkpoint_resume_is_bitwise(precision, rung) -> None:
    batches = _batches(4)
    amp, model, opt = _build(True, precision, rung, "adamw")
    _train(amp, model, opt, batches[:2])
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict()}, buf)
    _train(amp, model, opt, batches[2:])
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    amp2, model2, opt2 = _build(True, precision, rung, "adamw", seed=5)  # other initial weights
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    amp2.load_state_dict(ck["amp"])
    _train(amp2, model2, opt2, batches[2:])
    _assert_bitwise(_state(amp, opt), _state(amp2, opt2))


def test_other_backward_passes_step_nothing() -> None:
    """Only the engine's backward steps: ``amp.diagnose`` (its own forward and backward) and a
    user's ``loss.backward()`` leave the weights alone and the gradients where autograd puts them."""
    amp, model, opt = _build(True, "bf16", {})
    x, y = _batches(1)[0]

    def closure() -> torch.Tensor:
        with amp.autocast():
            return F.cross_entropy(model(x).float(), y)

    amp.backward(closure())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    amp.diagnose(closure)  # between backward and step
    amp.step(opt)
    amp.diagnose(closure)
    closure().backward()
    _assert_bitwise(before, model.state_dict())
    assert all(p.grad is not None for p in model.parameters())


def test_a_switch_moves_the_hooks_to_the_new_form() -> None:
    batches = _batches(4)
    runs = []
    for inb in (False, True):
        amp, model, opt = _build(inb, "bf16-pure", {"masters": "split"}, "sgd-momentum")
        _train(amp, model, opt, batches[:2])
        amp.switch("fp32")
        _train(amp, model, opt, batches[2:])
        runs.append(_state(amp, opt))
    _assert_bitwise(*runs)
