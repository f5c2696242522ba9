import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ampkit import MixedPrecision, audit, localize_nonfinite

from ..support.unstable_model import Unstable, data


def fp16_closure(model, x, y):
    def closure():
        with torch.autocast("cpu", dtype=torch.float16):
            return model(x, y)

    return closure


def test_localize_forward_overflow_names_the_layer():
    torch.manual_seed(0)
    model = Unstable()
    x, y = data(1)[0]
    r = localize_nonfinite(model, fp16_closure(model, x, y))
    assert r.found and r.module == "big" and r.module_type == "Linear" and r.phase == "forward"
    assert r.dtype == "float16" and r.fp32_finite is True and r.loss_finite is False
    assert r.input_max is not None and 0 < r.input_max < 10
    assert "keep_fp32=['big']" in r.message


def test_localize_backward_overflow_at_scale():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 4))
    x = torch.randn(8, 16)

    def closure():
        with torch.autocast("cpu", dtype=torch.float16):
            return model(x).float().pow(2).sum() * 100.0

    fine = localize_nonfinite(model, closure, scale=1.0)
    assert not fine.found
    r = localize_nonfinite(model, closure, scale=2.0**20)  # 2^20 * ~100: gradients exceed 65504
    # the fp32 gradient of the loss overflows when cast to the last layer's fp16 output dtype
    assert r.found and r.phase == "backward-output" and r.scale == 2.0**20
    assert r.module == "2" and r.dtype == "float16" and r.fp32_finite is True
    assert "lower the loss scale" in r.message


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)


def test_localize_fp32_also_nonfinite_says_not_precision():
    class Bad(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.log = Log()

        def forward(self, x):
            return self.log(self.lin(x) - 1e3).sum()  # log of negatives: NaN in any precision

    m = Bad()
    r = localize_nonfinite(m, lambda: m(torch.randn(2, 4)))
    assert r.found and r.module == "log" and r.phase == "forward"
    assert r.fp32_finite is False and "not precision" in r.message


def test_grads_restored_and_hooks_removed_even_on_error():
    torch.manual_seed(0)
    model = Unstable()
    x, y = data(1)[0]
    F.cross_entropy(model(x), y).backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    localize_nonfinite(model, fp16_closure(model, x, y))
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, before[n])

    def boom():
        model(x, y)
        raise RuntimeError("user error")

    with pytest.raises(RuntimeError, match="user error"):
        localize_nonfinite(model, boom)
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks and not m._backward_hooks
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, before[n])


def test_a_diagnosis_changes_neither_the_random_streams_nor_the_buffers():
    """The first-skip diagnosis (on by default in the Trainer) re-runs a batch in training mode: its
    dropout drew from the global generator and its BatchNorm moved the running statistics, so a
    run's weights depended on whether -- and, across a stop and a resume, when -- it diagnosed.
    It leaves both as they were."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 1))
    x = torch.randn(4, 8)
    rng = torch.get_rng_state()
    buffers = {k: v.clone() for k, v in model.named_buffers()}
    report = localize_nonfinite(model, lambda: model(x).mean() * 1e39, scale=1.0)
    assert report.found  # (it ran: the loss overflows fp32)
    assert torch.equal(torch.get_rng_state(), rng)
    for k, v in model.named_buffers():
        assert torch.equal(v, buffers[k]), k
    assert model.training


@pytest.mark.parametrize(
    "bad,msg",
    [
        (lambda m, x: m(x), "scalar floating-point loss"),
        (lambda m, x: torch.tensor(3), "scalar floating-point loss"),
        (lambda m, x: m(x).sum().detach(), "does not require grad"),
    ],
)
def test_closure_errors(bad, msg):
    m = nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match=msg):
        localize_nonfinite(m, lambda: bad(m, x))


def test_engine_diagnose_uses_current_scale():
    torch.manual_seed(0)
    model = Unstable()
    amp = MixedPrecision("fp16", device="cpu", init_scale=512.0)
    model = amp.setup(model)
    x, y = data(1)[0]

    def closure():
        with amp.autocast():
            return model(x, y)

    r = amp.diagnose(closure)
    assert r.scale == 512.0 and r.module == "big"
    assert amp.events[-1].kind == "diagnosis"


def test_audit_recommends_overflowing_layer_and_scale():
    torch.manual_seed(0)
    model = Unstable()
    x, y = data(1)[0]
    rep = audit(model, (x, y), "fp16")
    assert rep.reference_dtype == "float64"
    assert rep.recommended_keep_fp32 == ["big"]
    top = rep.modules[0]
    assert (
        top.name == "big" and top.nonfinite and top.keep_fp32 and "non-finite output" in top.reasons
    )
    # recommended init_scale keeps the largest reference gradient 8x below fp16 max
    assert rep.recommended_init_scale * rep.max_grad * 8 <= 65504
    assert (
        rep.recommended_init_scale * rep.max_grad * 16 > 65504 or rep.recommended_init_scale == 1.0
    )
    # downstream modules are non-finite only because their input is: not recommended
    norm = next(m for m in rep.modules if m.name == "norm")
    assert not norm.keep_fp32 and "input already is" in norm.note


def test_audit_errors_reflect_dtype_precision():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 8))
    x = torch.randn(32, 64)
    fp16 = {m.name: m for m in audit(model, x, "fp16").modules}
    bf16 = {m.name: m for m in audit(model, x, "bf16").modules}
    fp32 = {m.name: m for m in audit(model, x, "fp32").modules}
    # rounding error scales with the format's precision: fp16 ~2^-11, bf16 ~2^-8, fp32 tiny
    assert 1e-5 < fp16["0"].rel_error < 5e-3
    assert 1e-4 < bf16["0"].rel_error < 4e-2
    assert bf16["0"].rel_error > 2 * fp16["0"].rel_error
    assert fp32["0"].rel_error < 1e-6
    assert not any(m.keep_fp32 for m in fp16.values())


def test_audit_underflow_shares():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 1))
    with torch.no_grad():
        model[0].weight.mul_(1e-6)  # gradients of layer 1 become tiny
    x = torch.randn(4, 8)
    rep = audit(model, x, "fp16", loss_fn=lambda out: out.sum() * 1e-4)
    first = next(m for m in rep.modules if m.name == "1")
    assert first.grad_underflow_scale1 is not None
    assert first.grad_underflow_recommended <= first.grad_underflow_scale1


def test_audit_flags_sensitive_types():
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LayerNorm(144), nn.Softmax(dim=1)
    )
    rep = audit(model, torch.randn(2, 3, 8, 8), "bf16")
    notes = {m.type: m.note for m in rep.modules}
    assert "BatchNorm" in notes["BatchNorm2d"] and "reduction" in notes["Softmax"]
    assert "LayerNorm" in notes["LayerNorm"] and notes["Conv2d"] == ""


def test_audit_on_gpt_json_roundtrip():
    import json

    from ampkit.models.builtin import build
    from ampkit.models.data import TextBatches

    model = build("gpt", "tiny")
    x, y = TextBatches(batch_size=2, block_size=64)(0)
    rep = audit(model, (x, y), "bf16")
    d = json.loads(json.dumps(rep.to_dict()))
    assert d["precision"] == "bf16" and len(d["modules"]) > 10
    assert all(m["rel_error"] is None or math.isfinite(m["rel_error"]) for m in d["modules"])


def test_audit_finds_overflows_hidden_behind_the_first():
    class TwoBig(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 16)
            self.b = nn.Linear(16, 16)  # would overflow too, but its input is already inf in fp16
            self.norm = nn.LayerNorm(16)
            with torch.no_grad():
                self.a.weight.mul_(1e6)
                self.b.weight.mul_(10.0)

        def forward(self, x):
            return self.norm(self.b(self.a(x))).sum()

    torch.manual_seed(0)
    rep = audit(TwoBig(), torch.randn(4, 8), "fp16")
    assert rep.recommended_keep_fp32 == ["a", "b"]
    assert any("overflowed next" in n for n in rep.notes)


def test_diagnose_under_a_pure_precision_runs_the_fp32_reference_on_an_fp32_copy():
    """bf16-pure: the module's weights are bf16 and the reference re-run is fp32 (it used to crash with
    'mat1 and mat2 must have the same dtype' in the Trainer's first-skip diagnosis)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp = MixedPrecision("bf16-pure")
    model, opt = amp.setup(model, opt)
    x = torch.randn(4, 8)
    x[0, 0] = math.inf  # bad data: non-finite in any precision

    def closure():
        with amp.autocast():
            return model(x).float().pow(2).mean()

    report = amp.diagnose(closure)
    assert report.found and report.phase == "forward" and report.module == "0"
    assert report.dtype == "bfloat16"
    assert (
        report.fp32_finite is False
    )  # the fp32 re-run happened (None would mean it could not run)
    assert "not a precision problem" in report.message or "fp32" in report.message
    assert all(
        p.dtype == torch.bfloat16 for p in model.parameters()
    )  # the model itself is untouched
