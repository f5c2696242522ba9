"""One way to run steps (ampkit.loop.steps), the measured ``auto`` every caller reaches
(ampkit.choose.autoselect.confirm_auto), and the Trainer's grouped settings."""

import hashlib
import json

import pytest
import torch
import torch.nn.functional as F

import ampkit.step.hardware as hardware
from ampkit import MixedPrecision
from ampkit.choose.autoselect import auto_decision, cache_path, confirm_auto, measured_choice
from ampkit.cli import main
from ampkit.loop.steps import Steps, batch_loss
from ampkit.models.builtin import builtin
from ampkit.train.trainer import BatchConfig, CheckpointConfig, EvalConfig, LogConfig, Trainer

from ..support.reference_loop import torch_amp_loop

ACCUM, STEPS = 2, 12


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.GELU(), torch.nn.Linear(32, 5)
        )

    def forward(self, x, y):
        return F.cross_entropy(self.body(x), y)


def data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(n)
    ]


def hand_loop(precision, batches):
    """The hand-written torch.autocast + torch.amp.GradScaler loop (tests/support/reference_loop.py), with
    ampkit's semantics: clip on unscaled gradients, skip non-finite steps in every precision."""
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    model, _, losses = torch_amp_loop(
        model,
        opt,
        batches,
        precision,
        steps=STEPS,
        accum=ACCUM,
        clip=1.0,
        scaler_kwargs={"init_scale": 2.0**10, "growth_interval": 3},
        skip_nonfinite=True,
    )
    return model, losses


def ampkit_setup(precision, **kw):
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    amp = MixedPrecision(
        precision,
        device="cpu",
        init_scale=2.0**10,
        growth_interval=3,
        accumulation_steps=ACCUM,
        clip_grad_norm=1.0,
        **kw,
    )
    model, opt = amp.setup(model, opt)
    return model, opt, amp


def assert_bitwise(a, b):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), f"{name} differs by up to {(p - q).abs().max().item():.3g}"


# ---------------------------------------------------------------------------- the step helper
def test_batch_loss_calls_the_model_as_the_batch_says():
    def model(*args, **kwargs):
        return args, kwargs

    assert batch_loss(model, {"x": 1}) == ((), {"x": 1})
    assert batch_loss(model, (1, 2)) == ((1, 2), {})
    assert batch_loss(model, [1, 2]) == ((1, 2), {})
    t = torch.ones(2)
    assert batch_loss(model, t)[0][0] is t


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.slow
def test_steps_run_is_bitwise_the_hand_written_loop_with_its_losses(precision):
    batches = data(ACCUM * STEPS)
    ref, ref_losses = hand_loop(precision, batches)
    model, opt, amp = ampkit_setup(precision)
    means, end = Steps(model, opt, amp).run(lambda i: batches[i], STEPS, count=ACCUM)
    assert end == ACCUM * STEPS and amp.optimizer_steps == STEPS
    assert_bitwise(ref, model)
    assert torch.equal(
        torch.stack(means), torch.stack(ref_losses)
    )  # bench's per-step loss, unchanged


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.slow
def test_trainer_is_bitwise_the_hand_written_loop(precision):
    batches = data(ACCUM * STEPS)
    ref, _ = hand_loop(precision, batches)
    model, opt, amp = ampkit_setup(precision)
    summary = Trainer(model, opt, amp, lambda i: batches[i], progress=False, fallback=False).fit(
        STEPS
    )
    assert summary.optimizer_steps == STEPS
    assert_bitwise(ref, model)


def test_optimizer_step_cuts_batches_and_maps_indices():
    """``split`` micro-batches per batch and an index map (how the Trainer reads rank r of W)."""
    batches = data(8)
    seen = []
    model, opt, amp = ampkit_setup("fp32")
    amp.set_accumulation_steps(4)
    out = Steps(model, opt, amp).optimizer_step(
        lambda i: batches[i],
        1,
        count=2,
        split=2,
        index=lambda i: 2 * i,
        on_batch=lambda k, b: seen.append((k, b[0].shape[0])),
    )
    assert seen == [(0, 8), (1, 8)] and len(out.losses) == 4 and out.result.boundary
    ref = Net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True)
    for i in (2, 4):
        for x, y in zip(batches[i][0].chunk(2), batches[i][1].chunk(2)):
            (ref(x, y) / 4).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
    ref_opt.step()
    assert_bitwise(ref, model)


# ---------------------------------------------------------------------------- the measured auto
@pytest.fixture
def bf16_cpu(tmp_path, monkeypatch):
    """A CPU whose hardware rule picks bf16 for ``auto``, and an empty verdict cache."""
    real = hardware.cpu_features()
    fake = hardware.CpuFeatures(
        model=real.model,
        flags=tuple(sorted({*real.flags, "avx512_bf16", "amx_bf16"})),
        capability=real.capability,
    )
    monkeypatch.setattr(hardware, "cpu_features", lambda: fake)
    monkeypatch.setenv("AMPKIT_CACHE_DIR", str(tmp_path / "cache"))
    assert MixedPrecision("auto", device="cpu").precision.name == "bf16"
    return tmp_path


def set_verdicts(speedup):
    """Every cached verdict becomes ``speedup`` (bf16's speed relative to fp32)."""
    path = cache_path()
    with open(path) as f:
        cache = json.load(f)
    assert cache
    for entry in cache.values():
        entry["speedup"], entry["spread"] = (
            speedup,
            0.0,
        )  # (a clear verdict, whatever the noise was)
        body = {k: v for k, v in entry.items() if k != "sha256"}  # signed as ampkit writes it
        entry["sha256"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    with open(path, "w") as f:
        json.dump(cache, f)


def trainer_run(steps=2, **kw):
    model, batches = builtin("mlp", "tiny", batch_size=8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp = MixedPrecision("auto", device="cpu")
    model, opt = amp.setup(model, opt)
    trainer = Trainer(model, opt, amp, batches, progress=False, **kw)
    return trainer, amp


def cli_args(tmp_path, name):
    return [
        "train",
        "--model",
        "mlp",
        "--size",
        "tiny",
        "--device",
        "cpu",
        "--batch-size",
        "8",
        "--no-progress",
        "--steps",
        "2",
        "--json",
        "--log_dir",
        str(tmp_path / name),
    ]


@pytest.mark.slow
def test_auto_picks_the_same_precision_in_the_trainer_and_the_cli(bf16_cpu, capsys):
    tmp = bf16_cpu
    trainer, amp = trainer_run(log_dir=str(tmp / "t0"), tensorboard=False)
    first = trainer.fit(2)  # measures: nothing cached yet
    decision = auto_decision(amp)
    assert (
        decision is not None and not decision["cached"] and first.precision == decision["precision"]
    )
    assert any(f"precision auto: {decision['reason']}" == n for n in first.notes)
    log = [json.loads(line) for line in (tmp / "t0" / "log.jsonl").read_text().splitlines()]
    assert [r["precision"] for r in log if r.get("kind") == "auto_precision"] == [first.precision]
    capsys.readouterr()
    assert (
        main(cli_args(tmp, "c0")) == 0
    )  # the same model and batch: the Trainer's verdict, from the cache
    s = json.loads(capsys.readouterr().out)
    assert s["precision"] == first.precision and "cached measurement" in s["precision_reason"]
    for speedup, expected in ((0.5, "fp32"), (2.0, "bf16")):
        set_verdicts(speedup)
        trainer, amp = trainer_run()
        assert trainer.fit(2).precision == expected == amp.precision.name
        assert main(cli_args(tmp, f"c{speedup}")) == 0
        s = json.loads(capsys.readouterr().out)
        assert s["precision"] == expected and "cached measurement" in s["precision_reason"]
        if expected == "bf16":
            assert "2.00x as fast as fp32" in s["precision_reason"]


@pytest.mark.slow
def test_confirm_auto_switches_in_place_once_and_leaves_model_and_rng_alone(bf16_cpu):
    model, batches = builtin("mlp", "tiny", batch_size=8)
    before = [p.clone() for p in model.parameters()]
    amp = MixedPrecision("auto", device="cpu", fallback=True)
    said = []
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    choice = confirm_auto(
        amp, model, batches, label="mlp/tiny", announce=said.append
    )  # before setup
    assert torch.equal(
        torch.get_rng_state(), rng
    )  # measuring does not move the run's random stream
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert said and "timing it against fp32" in said[0] and not choice.cached
    assert amp.precision.name == choice.precision
    assert auto_decision(amp)["reason"] == choice.reason and "mlp/tiny" in choice.reason
    n_events = len(amp.events)
    assert (
        confirm_auto(amp, model, batches, announce=said.append) == choice
    )  # decided: nothing more
    assert len(amp.events) == n_events and len(said) == 1
    # the verdict for the same model and batch, whoever asks and whatever label it prints
    again = measured_choice(model, batches, "bf16", torch.device("cpu"))
    assert again.cached and again.precision == choice.precision and "MLP" in again.reason
    set_verdicts(0.5)
    amp = MixedPrecision("auto", device="cpu", fallback=True)
    model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert (
        confirm_auto(amp, model, batches).precision == "fp32" == amp.precision.name
    )  # after setup too
    fresh = MixedPrecision("fp32", device="cpu", fallback=True)
    assert amp.config.to_dict() == fresh.config.to_dict()  # what a new fp32 engine would be
    assert amp.events[-2].kind == "precision_switch" and amp.events[-1].kind == "auto_precision"


@pytest.mark.parametrize("first,later", [(0.5, 2.0), (2.0, 0.5)])
@pytest.mark.slow
def test_a_resumed_auto_run_keeps_its_checkpoints_precision(bf16_cpu, first, later):
    tmp = bf16_cpu
    trainer, amp = trainer_run(checkpoint_dir=str(tmp / "ck"), checkpoint_every=2)
    trainer.fit(2)
    set_verdicts(first)  # the verdict the first run saw
    trainer, amp = trainer_run(checkpoint_dir=str(tmp / "ck2"), checkpoint_every=2)
    precision = trainer.fit(2).precision
    set_verdicts(later)  # the machine changed its mind: a resumed run does not
    trainer, amp = trainer_run(checkpoint_dir=str(tmp / "ck2"), checkpoint_every=2)
    assert trainer.resume() is not None
    assert trainer.fit(2).precision == precision == amp.precision.name
    assert [e.kind for e in amp.events].count("auto_precision") == 1


def test_auto_is_left_alone_off_auto_and_where_the_rule_says_fp32(bf16_cpu):
    model, batches = builtin("mlp", "tiny", batch_size=8)
    amp = MixedPrecision("bf16", device="cpu")
    choice = confirm_auto(amp, model, batches)
    assert (
        choice.precision == "bf16"
        and choice.reason == amp.precision.reason
        and auto_decision(amp) is None
    )
    assert not (bf16_cpu / "cache").exists()  # nothing measured


# ---------------------------------------------------------------------------- Trainer's settings
def test_trainer_settings_in_groups_or_flat_take_one_path(tmp_path):
    model, batches = builtin("mlp", "tiny", batch_size=8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = MixedPrecision("fp32", device="cpu")
    model, opt = amp.setup(model, opt)
    val = lambda i: batches(1000 + i)  # noqa: E731
    flat = Trainer(
        model,
        opt,
        amp,
        batches,
        log_every=2,
        progress=False,
        tensorboard=False,
        log_dir=str(tmp_path / "l"),
        checkpoint_dir=str(tmp_path / "c"),
        checkpoint_every=3,
        keep_last=1,
        eval_batches=val,
        eval_every=2,
        eval_steps=1,
        eval_precision="fp32",
    )
    grouped = Trainer(
        model,
        opt,
        amp,
        batches,
        log=LogConfig(dir=str(tmp_path / "l"), every=2, progress=False, tensorboard=False),
        checkpoint=CheckpointConfig(str(tmp_path / "c"), every=3, keep_last=1),
        evaluation=EvalConfig(val, every=2, steps=1, precision="fp32"),
    )
    assert flat.settings == grouped.settings
    assert flat.settings.batching == BatchConfig()
    mixed = Trainer(model, opt, amp, batches, log=LogConfig(every=5, progress=False), log_every=2)
    assert mixed.settings.log == LogConfig(
        every=2, progress=False
    )  # a flat keyword replaces its field
    with pytest.raises(TypeError, match="unexpected keyword argument 'log_evry'"):
        Trainer(model, opt, amp, batches, log_evry=2)
    with pytest.raises(TypeError, match="LogConfig"):
        Trainer(model, opt, amp, batches, log={"every": 2})
    with pytest.raises(ValueError, match="log_every=0"):
        Trainer(model, opt, amp, batches, log=LogConfig(every=0))
    with pytest.raises(ValueError, match="checkpoint_dir"):
        CheckpointConfig(every=2)
    with pytest.raises(ValueError, match="eval_batches"):
        EvalConfig(every=2)
    summary = grouped.fit(4)
    assert summary.optimizer_steps == 4 and [s for s, _ in summary.eval_losses] == [2, 4]
    assert (tmp_path / "c").exists() and (tmp_path / "l" / "log.jsonl").exists()
