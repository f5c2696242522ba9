"""The precision manifest (ampkit.step.manifest) and its checks (ampkit.step.manifest_check):
entries read from the live tensors, each injected downgrade reported, clean runs silent."""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from torch import nn

import ampkit
from ampkit.cli import main
from ampkit.step.precision import PrecisionError

PRECISIONS = ["fp32", "tf32", "bf16", "fp16", "bf16-pure", "fp16-pure", "fp8"]


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.norm, self.fc2 = nn.Linear(16, 32), nn.LayerNorm(32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.fc1.weight.dtype)  # (a model cast to bf16 by hand takes bf16 inputs)
        return self.fc2(torch.relu(self.norm(self.fc1(x)))).float().pow(2).mean()


def engine(precision: str, model: nn.Module | None = None, opt_cls=torch.optim.AdamW, **kw):
    if precision.startswith("fp8"):
        pytest.importorskip("torchao.float8")  # the fp8 extra
    torch.manual_seed(0)
    model = model if model is not None else Net()
    opt = opt_cls(model.parameters(), lr=1e-3)
    try:
        amp = ampkit.MixedPrecision(precision, device="cpu", fp8_emulate=True, **kw)
    except PrecisionError as e:
        pytest.skip(str(e))
    model, opt = amp.setup(model, opt)
    return model, opt, amp


def train(model, opt, amp, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps * amp.config.accumulation_steps):
        with amp.autocast():
            loss = model(torch.randn(8, 16, generator=g))
        amp.backward(loss)
        amp.step(opt)


def violations(amp) -> list[dict]:
    return [e.data for e in amp.events if e.kind == "manifest_violation"]


def test_bf16_pure_with_norms_kept_in_fp32():
    model, opt, amp = engine("bf16-pure", keep_fp32=["norm"])
    train(model, opt, amp, 2)
    m = amp.manifest()
    fc = m.entry("fc1.weight")
    assert (
        fc.storage,
        fc.compute,
        fc.grad,
        fc.accumulation,
        fc.master,
        fc.optimizer_state,
        fc.reduce,
    ) == ("bfloat16", "bfloat16", "bfloat16", "float32", "float32", "float32", None)
    norm = m.entry("norm.weight")
    assert (norm.storage, norm.compute, norm.master, norm.optimizer_state, norm.kept_fp32) == (
        "float32",
        "float32",
        None,
        "float32",
        True,
    )
    assert [e.name for e in m.modules()["norm"]] == ["norm.weight", "norm.bias"]
    assert m.loss_scaling["enabled"] is False and m.parallel == "none"
    assert type(m).from_dict(m.to_dict()) == m
    assert violations(amp) == []


def test_bf16_autocast_and_fp16_scaling():
    model, opt, amp = engine("bf16")
    m = amp.manifest()
    assert (m.entry("fc1.weight").storage, m.entry("fc1.weight").compute) == ("float32", "bfloat16")
    assert (
        m.entry("norm.weight").compute == "float32"
    )  # autocast leaves the norm in the weights' dtype
    assert m.entry("fc1.weight").optimizer_state == ""  # not created before the first step
    assert m.entry("fc1.weight").master is None
    model, opt, amp = engine("fp16")
    ls = amp.manifest().loss_scaling
    assert ls["enabled"] and ls["dynamic"] and ls["scale"] == 65536.0
    assert amp.manifest(read_scale=False).loss_scaling["scale"] is None


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_clean_run_records_nothing(precision):
    kw = {"keep_fp32": ["norm"]} if precision.endswith("-pure") else {}
    model, opt, amp = engine(precision, accumulation_steps=2, manifest_check_every=1, **kw)
    train(model, opt, amp, 3)
    state = amp.state_dict()
    assert violations(amp) == []
    fresh_model, fresh_opt, fresh = engine(
        precision, accumulation_steps=2, manifest_check_every=1, **kw
    )
    fresh_opt.load_state_dict(opt.state_dict())
    fresh.load_state_dict(state)
    train(fresh_model, fresh_opt, fresh, 1)
    assert violations(fresh) == []


def test_a_norm_weight_cast_to_bf16_after_setup_is_reported():
    model, opt, amp = engine("bf16", opt_cls=torch.optim.SGD, manifest_check_every=2)
    train(model, opt, amp, 1)
    assert violations(amp) == []
    model.norm.bfloat16()  # e.g. a user's "norms in bf16 to save memory"
    train(model, opt, amp, 1)  # step 2: a check
    found = {(v["param"], v["component"], v["when"]) for v in violations(amp)}
    assert found == {
        (p, c, "step") for p in ("norm.weight", "norm.bias") for c in ("storage", "master")
    }
    train(model, opt, amp, 2)
    assert len(violations(amp)) == len(found)  # each reported once


def test_bf16_parameters_without_masters_and_half_accumulation_are_reported_at_setup():
    model, opt, amp = engine("bf16", Net().bfloat16(), accumulation_steps=4)
    found = {(v["param"], v["component"]) for v in violations(amp)}
    names = [n for n, _ in model.named_parameters()]
    assert found == {(n, c) for n in names for c in ("master", "accumulation")}
    assert all(v["when"] == "setup" for v in violations(amp))
    # the same model in the pure precision has its masters and sums in fp32: nothing to report
    model, opt, amp = engine("bf16-pure", Net().bfloat16(), accumulation_steps=4)
    assert violations(amp) == []


def test_an_optimizer_state_dtype_changed_by_a_resume_is_reported():
    model, opt, amp = engine("fp32")
    train(model, opt, amp, 2)
    saved_opt, saved_amp = opt.state_dict(), amp.state_dict()
    # resumed into a model cast to bf16: torch casts the loaded optimizer state to the parameters' dtype
    model2, opt2, amp2 = engine("fp32", Net().bfloat16())
    opt2.load_state_dict(saved_opt)
    amp2.load_state_dict(saved_amp)
    resumed = {(v["param"], v["component"]) for v in violations(amp2) if v["when"] == "resume"}
    assert ("fc1.weight", "optimizer_state") in resumed and ("fc1.weight", "storage") in resumed
    v = next(v for v in violations(amp2) if v["component"] == "optimizer_state")
    assert (v["expected"], v["found"]) == ("float32", "bfloat16")


def test_resume_in_the_other_order_is_compared_at_the_first_step():
    model, opt, amp = engine("fp32")
    train(model, opt, amp, 1)
    saved_opt, saved_amp = opt.state_dict(), amp.state_dict()
    model2, opt2, amp2 = engine("fp32", Net().bfloat16())
    amp2.load_state_dict(saved_amp)  # before the optimizer's state: nothing to compare it with yet
    opt2.load_state_dict(saved_opt)
    assert not [v for v in violations(amp2) if v["component"] == "optimizer_state"]
    train(
        model2, opt2, amp2, 1
    )  # the first step after a resume checks, whatever manifest_check_every says
    assert ("fc1.weight", "optimizer_state", "step") in {
        (v["param"], v["component"], v["when"]) for v in violations(amp2)
    }
    model3, opt3, amp3 = engine("fp32")  # the same resume into the same set-up: silent
    amp3.load_state_dict(saved_amp)
    opt3.load_state_dict(saved_opt)
    train(model3, opt3, amp3, 1)
    assert violations(amp3) == []


def test_explain_prints_the_table(capsys):
    assert main(["explain", "--precision", "bf16-pure", "--model", "mlp", "--size", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "storage" in out and "bfloat16" in out and "float32" in out
    assert "no silent downgrade" in out
    assert "precision bf16-pure, parallel none" in out  # fp32 masters: the plain rung, no suffix


def test_explain_names_the_rung_that_runs(capsys):
    """The header names the memory-ladder rung, as train's header and the run directory do."""
    argv = [
        "explain",
        "--precision",
        "bf16-pure:stochastic+bf16",
        "--model",
        "mlp",
        "--size",
        "tiny",
    ]
    assert main(argv) == 0
    assert "precision bf16-pure:stochastic+bf16, parallel none" in capsys.readouterr().out
    assert main([*argv, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["rung"] == "stochastic+bf16"


def test_config_knob_is_validated():
    with pytest.raises(ampkit.ConfigError, match="manifest_check_every"):
        ampkit.MixedPrecision("bf16", device="cpu", manifest_check_every=-1)


def distributed_checks(rank: int, world: int) -> dict:
    """Every precision under DDP and FSDP2 (2 steps, a check every step), the refusal of a pure
    precision on a model fully_shard-ed without its policy, and FSDP2 half shards."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from ampkit.distributed import shard

    out: dict = {"runs": {}}
    for kind in ("ddp", "fsdp"):
        for precision in PRECISIONS:
            # FSDP2's pure forms reduce (and so accumulate) in the half dtype: one micro-step there
            accum = 1 if kind == "fsdp" and precision.endswith("-pure") else 2
            torch.manual_seed(0)
            model: nn.Module = Net()
            model = (
                nn.parallel.DistributedDataParallel(model)
                if kind == "ddp"
                else shard(model, precision)
            )
            try:
                amp = ampkit.MixedPrecision(
                    precision,
                    device="cpu",
                    fp8_emulate=True,
                    accumulation_steps=accum,
                    manifest_check_every=1,
                )
                model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
                train(model, opt, amp, 2)
            except (
                PrecisionError,
                ImportError,
                NotImplementedError,
            ) as e:  # (a combination torch cannot run)
                out["runs"][kind, precision] = ("skipped", str(e)[:200])
                continue
            m = amp.manifest()
            out["runs"][kind, precision] = (violations(amp), m.parallel, m.entry("fc1.weight"))
    torch.manual_seed(0)
    other = fully_shard(Net(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
    try:
        ampkit.MixedPrecision("bf16-pure", device="cpu").setup(
            other, torch.optim.AdamW(other.parameters())
        )
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    bare = fully_shard(Net())  # no MixedPrecisionPolicy: the precision's is applied, with a warning
    amp = ampkit.MixedPrecision("bf16-pure", device="cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bare, opt = amp.setup(bare, torch.optim.AdamW(bare.parameters(), lr=1e-3))
    out["applied_warning"] = [str(w.message) for w in caught if "applied" in str(w.message)]
    train(bare, opt, amp, 1)
    out["applied"] = (violations(amp), amp.manifest().entry("fc1.weight"))
    ok = shard(Net(), "bf16-pure")  # the fix the message names
    amp = ampkit.MixedPrecision("bf16-pure", device="cpu")
    amp.setup(ok, torch.optim.AdamW(ok.parameters()))
    out["fixed"] = violations(amp)
    half = fully_shard(Net().bfloat16(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    amp = ampkit.MixedPrecision("bf16", device="cpu")
    amp.setup(half, torch.optim.AdamW(half.parameters()))
    out["half_shards"] = violations(amp)
    return out


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_and_fsdp2_every_precision_clean_and_the_unsafe_sharding_refused():
    import importlib.util

    from ..support.dist_helpers import run_ranks

    ddp = [p for p in PRECISIONS if p != "fp8" or importlib.util.find_spec("torchao")]  # fp8: extra
    fsdp = ("fp32", "bf16", "fp16", "bf16-pure")
    for out in run_ranks(distributed_checks, world=2):
        ran = {k: v for k, v in out["runs"].items() if v[0] != "skipped"}
        assert {("ddp", p) for p in ddp} | {("fsdp", p) for p in fsdp} <= set(ran), out["runs"]
        for (kind, precision), (found, parallel, _) in ran.items():
            assert found == [], (kind, precision, found)
            assert parallel == kind
        ddp_pure, fsdp_pure = (
            ran["ddp", "bf16-pure"][2],
            ran.get(("fsdp", "bf16-pure"), (0, 0, None))[2],
        )
        assert (ddp_pure.reduce, ddp_pure.master, ddp_pure.accumulation) == (
            "float32",
            "float32",
            "float32",
        )
        if fsdp_pure is not None:
            assert (fsdp_pure.storage, fsdp_pure.compute, fsdp_pure.reduce) == (
                "float32",
                "bfloat16",
                "bfloat16",
            )
        assert (
            out["refused"] is not None
            and "ampkit.distributed.shard(model, 'bf16-pure')" in out["refused"]
        )
        assert (
            "MixedPrecisionPolicy(param_dtype=torch.bfloat16" in out["refused"]
            and "float16" in out["refused"]
        )
        assert (
            len(out["applied_warning"]) == 1
            and "ampkit.distributed.shard" in out["applied_warning"][0]
        )
        found, fc1 = out["applied"]
        assert found == [] and (fc1.storage, fc1.compute, fc1.reduce) == (
            "float32",
            "bfloat16",
            "bfloat16",
        )
        assert out["fixed"] == []
        found = {(v["param"], v["component"]) for v in out["half_shards"]}
        assert ("fc1.weight", "compute") in found and ("fc1.weight", "master") in found
