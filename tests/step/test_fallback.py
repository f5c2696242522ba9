import copy

import pytest
import torch

from ampkit import MixedPrecision, PrecisionError
from ampkit.step.fallback import NumericsError, resolve_chain
from ampkit.step.hardware import CpuFeatures, DeviceInfo

from ..support.helpers import SyncCounter
from ..support.unstable_model import Unstable, data, train_unstable

run = train_unstable


def test_engineered_model_falls_back_to_bf16_and_trains():
    amp, _, _, losses = run(60, fallback=True, fallback_patience=4, fallback_check_every=2)
    assert amp.precision.name == "bf16"
    assert torch.isfinite(losses[-10:]).all()
    assert losses[-5:].mean() < losses[torch.isfinite(losses)][:5].mean()
    events = [e for e in amp.stats()["events"] if e["kind"] == "fallback"]
    assert len(events) == 1
    e = events[0]
    assert (e["from"], e["to"], e["trigger"]) == ("fp16", "bf16", "consecutive_skips")
    assert e["consecutive_skips"] >= 4 and "consecutive skipped steps" in e["reason"]
    # every step before the fallback was skipped, none after: nothing non-finite was trained on
    stats = amp.stats()
    assert stats["skipped_steps"] == e["step"]


def test_default_patience_and_interval():
    amp, *_ = run(40, fallback=True)
    ev = [e for e in amp.stats()["events"] if e["kind"] == "fallback"][0]
    # 8 consecutive skips are seen at the check at step 10 and acted on at the next one (step 20)
    assert ev["step"] == 20 and amp.precision.name == "bf16"


def test_fallback_event_carries_diagnosis():
    torch.manual_seed(0)
    model = Unstable()
    amp = MixedPrecision(
        "fp16", device="cpu", fallback=True, fallback_patience=2, fallback_check_every=1
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.setup(model, opt)
    batches = data(10)
    x, y = batches[0]

    def closure():
        with amp.autocast():
            return model(x, y)

    report = amp.diagnose(closure)
    assert (
        report.found and report.module == "big" and report.phase == "forward" and report.fp32_finite
    )
    for x, y in batches:
        with amp.autocast():
            loss = model(x, y)
        amp.backward(loss)
        amp.step(opt)
    fb = [e for e in amp.stats()["events"] if e["kind"] == "fallback"][0]
    assert fb["diagnosis"]["module"] == "big"
    assert [e["kind"] for e in amp.stats()["events"]][:2] == ["diagnosis", "fallback"]


def test_a_diagnosis_pending_at_a_resume_is_the_fallback_events():
    """A diagnosis made before a checkpoint and a fallback after the resume: the fallback event
    carries it as in the uninterrupted run (it was lost with the process); a malformed saved
    diagnosis is refused before anything changes."""

    def engine():
        torch.manual_seed(0)
        model = Unstable()
        amp = MixedPrecision(
            "fp16", device="cpu", fallback=True, fallback_patience=2, fallback_check_every=1
        )
        return (amp, *amp.setup(model, torch.optim.SGD(model.parameters(), lr=0.1)))

    def train(amp, model, opt, batches):
        for x, y in batches:
            with amp.autocast():
                loss = model(x, y)
            amp.backward(loss)
            amp.step(opt)

    batches = data(10)
    x0, y0 = batches[0]
    runs = []
    for resume in (False, True):
        amp, model, opt = engine()

        def closure(amp=amp, model=model):
            with amp.autocast():
                return model(x0, y0)

        amp.diagnose(closure)
        if resume:  # a new process: a fresh engine, model and optimizer from the checkpoint
            state = copy.deepcopy(
                {"amp": amp.state_dict(), "model": model.state_dict(), "opt": opt.state_dict()}
            )
            amp, model, opt = engine()
            amp.load_state_dict(state["amp"])
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["opt"])
        train(amp, model, opt, batches)
        runs.append([e for e in amp.stats()["events"] if e["kind"] == "fallback"])
    assert runs[0] and runs[0][0]["diagnosis"]["module"] == "big"
    assert runs[1] == runs[0]

    amp, *_ = engine()
    state = amp.state_dict()
    for bad in ({"module": "big"}, {"found": True, "modul": "big"}, "big"):
        with pytest.raises(ValueError, match="diagnosis"):
            amp.load_state_dict({**state, "diagnosis": bad})
    assert amp.state_dict() == state  # nothing changed


def test_precision_after_fallback_survives_state_dict():
    amp, model, opt, _ = run(30, fallback=True, fallback_patience=4, fallback_check_every=2)
    state = copy.deepcopy(amp.state_dict())
    fresh = MixedPrecision("fp16", device="cpu", fallback=True)
    fresh.load_state_dict(state)
    assert fresh.precision.name == "bf16"
    assert fresh.stats()["skipped_steps"] == amp.stats()["skipped_steps"] > 0
    assert fresh.config.fallback_patience == 4


def test_exhausted_chain_raises_with_the_story():
    class AlwaysNaN(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 4)

        def forward(self, x, y):
            return (self.lin(x).sum() * float("nan")).abs()

    with pytest.raises(NumericsError, match="last precision of the fallback chain"):
        run(
            40, model=AlwaysNaN(), fallback="fp16,fp32", fallback_patience=2, fallback_check_every=2
        )


class NaNAt(torch.nn.Module):
    """A linear model whose loss is NaN on the given calls (0-based)."""

    def __init__(self, bad):
        super().__init__()
        self.lin = torch.nn.Linear(16, 4)
        self.bad, self.calls = set(bad), 0

    def forward(self, x, y):
        loss = torch.nn.functional.cross_entropy(self.lin(x), y)
        self.calls += 1
        return loss * float("nan") if self.calls - 1 in self.bad else loss


@pytest.mark.parametrize("check_every", [1, 2, 10])
def test_transient_nonfinite_steps_in_unscaled_precision_are_skipped(check_every):
    # isolated NaN steps, and a run shorter than the patience (8): skipped, no fallback
    bad = {3, 9, 15, 16, 17, 30, 31, 32, 33, 34, 35, 36}
    model = NaNAt(bad)
    before = copy.deepcopy(model.lin)
    amp, model, opt, losses = run(
        60, precision="bf16", model=model, fallback=True, fallback_check_every=check_every
    )
    assert amp.precision.name == "bf16"
    assert not [e for e in amp.stats()["events"] if e["kind"] == "fallback"]
    assert amp.stats()["skipped_steps"] == len(bad)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert not torch.equal(before.weight, model.lin.weight)  # it trained on the finite steps
    assert torch.isfinite(losses[-5:]).all()


@pytest.mark.parametrize("patience,check_every", [(8, 10), (4, 2), (1, 1)])
def test_persistent_nonfinite_steps_in_unscaled_precision_fall_back(patience, check_every):
    bad = set(range(5, 5 + patience))  # exactly fallback_patience consecutive NaN steps
    amp, model, *_ = run(
        5 + patience + 3 * check_every + 2,
        precision="bf16",
        model=NaNAt(bad),
        fallback=True,
        fallback_patience=patience,
        fallback_check_every=check_every,
    )
    fb = [e for e in amp.stats()["events"] if e["kind"] == "fallback"]
    assert (
        len(fb) == 1
        and (fb[0]["from"], fb[0]["to"]) == ("bf16", "fp32")
        and amp.precision.name == "fp32"
    )
    assert fb[0]["trigger"] == "nonfinite_unscaled" and fb[0]["consecutive_skips"] == patience
    assert f"patience {patience}" in fb[0]["reason"]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_min_scale_trigger():
    class Overflow(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 4)

        def forward(self, x, y):
            return (
                torch.nn.functional.cross_entropy(self.lin(x), y) * 1e30
            )  # gradients overflow in fp32 too

    amp, *_ = run(
        30,
        model=Overflow(),
        fallback="fp16,bf16",
        init_scale=8.0,
        min_scale=1.0,
        fallback_patience=100,
        fallback_check_every=2,
    )
    fb = [e for e in amp.stats()["events"] if e["kind"] == "fallback"]
    assert fb and fb[0]["trigger"] == "min_scale"


def test_scale_floor_trigger_without_min_scale():
    # patience out of reach: the floor (2**-126) is what ends the burst
    class Inf(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 4)

        def forward(self, x, y):
            return torch.nn.functional.cross_entropy(self.lin(x), y) * float("inf")

    amp, *_ = run(
        40,
        model=Inf(),
        fallback="fp16,bf16",
        init_scale=2.0**-120,
        fallback_patience=1000,
        fallback_check_every=2,
    )
    fb = [e for e in amp.stats()["events"] if e["kind"] == "fallback"]
    assert (
        fb
        and fb[0]["trigger"] == "scale_floor"
        and fb[0]["scale"] == torch.finfo(torch.float32).tiny
    )


def test_exhausted_guard_at_min_scale_without_fallback():
    class Overflow(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 4)

        def forward(self, x, y):
            return (
                torch.nn.functional.cross_entropy(self.lin(x), y) * 1e30
            )  # gradients overflow in fp32 too

    with pytest.raises(
        NumericsError, match=r"exhausted.*min_scale=1.*\d+ consecutive skipped steps.*'lin'"
    ):
        run(30, model=Overflow(), init_scale=8.0, min_scale=1.0, fallback_check_every=2)


def test_isolated_overflows_at_min_scale_do_not_raise():
    # at min_scale, an overflow that the next check does not see again is a transient: skipped only
    model = NaNAt({4, 11, 18, 25})
    amp, model, *_ = run(30, model=model, init_scale=4.0, min_scale=4.0, fallback_check_every=1)
    assert amp.stats()["skipped_steps"] == 4 and amp.scaler.get_scale() == 4.0
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_checking_triggers_adds_no_sync():
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    opt = torch.optim.AdamW(model.parameters(), fused=True)
    amp = MixedPrecision(
        "fp16", device="cpu", fallback=True, fallback_check_every=3, clip_grad_norm=1.0
    )
    model, opt = amp.setup(model, opt)
    with SyncCounter() as c:
        for x, y in data(20):
            with amp.autocast():
                loss = torch.nn.functional.cross_entropy(model(x), y)
            amp.backward(loss)
            amp.step(opt)
    assert c.count == 0


def cpu_info():
    return DeviceInfo(type="cpu", name="cpu", bf16=True, cpu=CpuFeatures("t", ("avx2",), "AVX2"))


def test_chain_resolution_and_errors():
    assert resolve_chain(True, "fp16", cpu_info()) == ("fp16", "bf16", "fp32")
    v100 = DeviceInfo(type="cuda", name="V100", capability=(7, 0), bf16=False, fp16=True)
    assert resolve_chain(True, "fp16", v100) == ("fp16", "fp32")  # no bf16 there
    assert resolve_chain("16-mixed, bf16,fp32", "fp16", cpu_info()) == ("fp16", "bf16", "fp32")
    with pytest.raises(PrecisionError, match="V100"):
        resolve_chain("fp16,bf16,fp32", "fp16", v100)
    with pytest.raises(PrecisionError, match="does not contain the training precision"):
        resolve_chain("bf16,fp32", "fp16", cpu_info())
    with pytest.raises(PrecisionError, match="fp61"):
        MixedPrecision("fp16", device="cpu", fallback="fp16,fp61")
    with pytest.raises(ValueError, match="skip_nonfinite"):
        MixedPrecision("fp16", device="cpu", fallback=True, skip_nonfinite=False)
    with pytest.raises(ValueError, match="concrete precisions"):
        MixedPrecision("fp16", device="cpu", fallback="fp16,auto")
