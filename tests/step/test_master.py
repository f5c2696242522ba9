"""bf16-pure / fp16-pure: half-precision weights with fp32 master weights in the user's optimizer."""

import copy
import math

import pytest
import torch
import torch.nn.functional as F

from ampkit import MixedPrecision
from ampkit.models.builtin import builtin
from ampkit.observe.memory import breakdown
from ampkit.step.policies.pure.masters import MasterWeights
from ampkit.train.trainer import Trainer

from ..support.helpers import SyncCounter

HALF = {"bf16-pure": torch.bfloat16, "fp16-pure": torch.float16}


class Ones(torch.nn.Module):
    """1000 weights at 1.0 whose gradient is exactly 1 (loss = sum)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1000))

    def forward(self):
        return self.w.sum()


def test_masters_follow_fp32_bitwise_while_plain_bf16_freezes():
    def run(precision):
        model = Ones()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
        amp = MixedPrecision(precision, device="cpu")
        model, opt = amp.setup(model, opt)
        for _ in range(100):
            with amp.autocast():
                loss = model()
            amp.backward(loss)
            amp.step(opt)
        return model, amp

    fp32, _ = run("fp32")
    pure, amp = run("bf16-pure")
    (master,) = amp.master_params()
    assert master.dtype == torch.float32 and pure.w.dtype == torch.bfloat16
    assert torch.equal(master, fp32.w)  # the masters are the fp32 run, bit for bit
    assert torch.equal(pure.w, master.to(torch.bfloat16))  # the model is the master rounded to bf16
    assert fp32.w[0].item() < 0.91  # 100 steps of lr 1e-3 moved it
    control = Ones().to(torch.bfloat16)  # what model.to(torch.bfloat16) does: no masters
    opt = torch.optim.AdamW(control.parameters(), lr=1e-3, weight_decay=0.0)
    for _ in range(100):
        control().backward()
        opt.step()
        opt.zero_grad()
    assert torch.equal(
        control.w, torch.ones(1000, dtype=torch.bfloat16)
    )  # every update rounded away


def mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.GELU(), torch.nn.Linear(32, 5)
    )


def data(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(n)
    ]


OPTIMIZERS = {
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=3e-3),
    "adamw_foreach": lambda p: torch.optim.AdamW(p, lr=3e-3, foreach=True),
    "adamw_fused": lambda p: torch.optim.AdamW(p, lr=3e-3, fused=True),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=1e-3),
    "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05),
}


def assert_model_is_rounded_masters(model, amp, dtype):
    masters = amp.master_params()
    assert masters and all(m.dtype == torch.float32 for m in masters)
    for p, m in zip(model.parameters(), masters):
        assert p.dtype == dtype and torch.equal(p, m.to(dtype))


@pytest.mark.parametrize("opt_name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("precision", ["bf16-pure", "fp16-pure"])
def test_any_torch_optimizer_trains_with_masters(precision, opt_name):
    model = mlp()
    opt = OPTIMIZERS[opt_name](model.parameters())
    amp = MixedPrecision(precision, device="cpu", init_scale=2.0**8)
    model, opt = amp.setup(model, opt)
    stepped = {id(p) for g in opt.param_groups for p in g["params"]}
    assert stepped == {id(m) for m in amp.master_params()}  # the optimizer holds the masters
    batches, losses = data(40), []
    for x, y in batches:
        with amp.autocast():
            loss = F.cross_entropy(model(x), y)
        amp.backward(loss)
        amp.step(opt)
        assert_model_is_rounded_masters(model, amp, HALF[precision])
        losses.append(float(loss.detach()))
    assert sum(losses[-5:]) < sum(losses[:5])  # it learns


def test_keep_fp32_norms_have_no_master():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp = MixedPrecision("bf16-pure", device="cpu", keep_fp32=("1",))
    model, opt = amp.setup(model, opt)
    assert model[1].weight.dtype == torch.float32 and model[0].weight.dtype == torch.bfloat16
    assert len(amp.master_params()) == 4  # the two Linears' weights and biases
    x, y = data(1)[0]
    with amp.autocast():
        loss = F.cross_entropy(model(x), y)
    amp.backward(loss)
    before = model[1].weight.detach().clone()
    amp.step(opt)
    assert not torch.equal(before, model[1].weight)  # the fp32 norm is stepped directly


def test_fp16_pure_inf_at_step_k_skips_it_and_halves_the_scale():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, fused=True)
    amp = MixedPrecision("fp16-pure", device="cpu", init_scale=2.0**10)
    model, opt = amp.setup(model, opt)
    k = 5
    for step, (x, y) in enumerate(data(10)):
        masters = [m.detach().clone() for m in amp.master_params()]
        weights = [p.detach().clone() for p in model.parameters()]
        scale = amp.scaler.get_scale()
        with amp.autocast():
            loss = F.cross_entropy(model(x), y)
        amp.backward(loss * math.inf if step == k else loss)
        result = amp.step(opt)
        assert result.skipped == (step == k)
        if step == k:
            assert all(torch.equal(a, b) for a, b in zip(masters, amp.master_params()))
            assert all(torch.equal(a, b) for a, b in zip(weights, model.parameters()))
            assert amp.scaler.get_scale() == scale / 2
        assert_model_is_rounded_masters(model, amp, torch.float16)
    assert amp.stats()["skipped_steps"] == 1


def test_accumulation_sums_upcast_grads_exactly_and_clipping_sees_fp32_masters():
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = MixedPrecision("bf16-pure", device="cpu", accumulation_steps=4)
    model, opt = amp.setup(model, opt)
    twin = copy.deepcopy(model)  # the same bf16 weights, driven by hand
    ref = [torch.zeros(p.shape) for p in twin.parameters()]
    for x, y in data(4):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            (F.cross_entropy(twin(x), y) / 4).backward()
        for r, p in zip(ref, twin.parameters()):
            r += p.grad.float()  # fp32 sum of the upcast bf16 gradients
            p.grad = None
        with amp.autocast():
            loss = F.cross_entropy(model(x), y)
        amp.backward(loss)
    masters = amp.master_params()
    assert all(p.grad is None for p in model.parameters())  # the half gradients were absorbed
    assert all(
        m.grad.dtype == torch.float32 and torch.equal(m.grad, r) for m, r in zip(masters, ref)
    )
    expected = torch.nn.utils.get_total_norm(ref)
    result = amp.step(opt, clip_grad_norm=1e-3)
    assert result.grad_norm.dtype == torch.float32 and torch.equal(result.grad_norm, expected)


def test_state_dict_holds_masters_by_name_and_full_precision_export():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp = MixedPrecision("bf16-pure", device="cpu")
    model, opt = amp.setup(model, opt)
    x, y = data(1)[0]
    with amp.autocast():
        amp.backward(F.cross_entropy(model(x), y))
    amp.step(opt)
    state = amp.state_dict()
    assert list(state["masters"]) == [n for n, _ in model.named_parameters()]
    full = amp.full_precision_state_dict()
    assert all(v.dtype == torch.float32 for v in full.values())
    assert all(torch.equal(full[n], m) for n, m in state["masters"].items())
    assert torch.save(state, __import__("io").BytesIO()) is None  # plain tensors: weights_only-safe


def test_memory_breakdown_counts_masters_apart():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp = MixedPrecision("bf16-pure", device="cpu")
    model, opt = amp.setup(model, opt)
    n = sum(p.numel() for p in model.parameters())
    cats = breakdown(model, opt, amp).cells
    assert cats[("master_weights", "float32")] == 4 * n
    assert cats[("parameters", "bfloat16")] == 2 * n


def test_no_host_sync_per_step_with_a_fused_optimizer():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    amp = MixedPrecision("fp16-pure", device="cpu")
    model, opt = amp.setup(model, opt)
    batches = data(4)
    with amp.autocast():
        amp.backward(F.cross_entropy(model(batches[0][0]), batches[0][1]))
    amp.step(opt)  # lazy state created
    with SyncCounter() as counter:
        for x, y in batches[1:]:
            with amp.autocast():
                loss = F.cross_entropy(model(x), y)
            amp.backward(loss)
            amp.step(opt)
    assert counter.count == 0


def test_switch_between_pure_forms_and_back_to_fp32():
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp = MixedPrecision("fp16-pure", device="cpu")
    model, opt = amp.setup(model, opt)
    batches = data(6)

    def train(i):
        x, y = batches[i]
        with amp.autocast():
            amp.backward(F.cross_entropy(model(x), y))
        amp.step(opt)

    train(0)
    amp.switch("bf16-pure")
    assert_model_is_rounded_masters(model, amp, torch.bfloat16)
    train(1)
    masters = [m.detach().clone() for m in amp.master_params()]
    amp.switch("fp32")
    assert amp.master_params() == [] and all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(p, m) for p, m in zip(model.parameters(), masters))
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {
        id(p) for p in model.parameters()
    }
    train(2)  # the optimizer state followed its parameters
    assert all(len(opt.state[p]) > 0 for p in model.parameters())


def test_switch_between_pure_forms_keeps_masters_and_optimizer_state():
    """A switch is "old policy releases, new policy prepares": the fp32 masters' values and the
    optimizer state carry over bitwise; the model becomes the masters rounded to the new dtype."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp = MixedPrecision("fp16-pure", device="cpu")
    model, opt = amp.setup(model, opt)
    x, y = data(1)[0]
    with amp.autocast():
        amp.backward(F.cross_entropy(model(x), y))
    amp.step(opt)
    masters = [m.detach().clone() for m in amp.master_params()]
    states = [{k: v.clone() for k, v in opt.state[m].items()} for m in amp.master_params()]
    amp.switch("bf16-pure")
    assert type(amp.policy).__name__ == "PurePolicy" and amp.policy.precision.name == "bf16-pure"
    assert all(torch.equal(a, b) for a, b in zip(amp.master_params(), masters))
    for m, before in zip(amp.master_params(), states):
        assert all(torch.equal(opt.state[m][k], v) for k, v in before.items())
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {
        id(m) for m in amp.master_params()
    }
    assert_model_is_rounded_masters(model, amp, torch.bfloat16)


def test_errors_are_clear():
    model = mlp()
    stray = torch.nn.Parameter(torch.zeros(3))
    opt = torch.optim.AdamW([*model.parameters(), stray], lr=1e-3)
    with pytest.raises(ValueError, match="not in the model"):
        MixedPrecision("bf16-pure", device="cpu").setup(model, opt)
    assert all(p.dtype == torch.float32 for p in model.parameters())  # nothing was changed


def _trainer(precision, ckdir):
    torch.manual_seed(0)
    model, batches = builtin("mlp", "tiny", batch_size=8, seed=0)
    amp = MixedPrecision(precision, device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = amp.setup(model, opt)
    return Trainer(
        model, opt, amp, batches, progress=False, checkpoint_dir=str(ckdir), fallback=False
    )


def test_resume_is_bitwise_and_needs_the_masters(tmp_path):
    full = _trainer("bf16-pure", tmp_path / "a")
    full.fit(6)
    part = _trainer("bf16-pure", tmp_path / "b")
    part.fit(3)
    part.save_checkpoint()
    resumed = _trainer("bf16-pure", tmp_path / "b")
    assert resumed.resume() is not None
    resumed.fit(3)
    for a, b in zip(full.amp.master_params(), resumed.amp.master_params()):
        assert torch.equal(a, b)
    assert all(
        torch.equal(a, b) for a, b in zip(full.model.parameters(), resumed.model.parameters())
    )
    # Control: the same checkpoint without the masters resumes from the rounded bf16 weights.
    control = _trainer("bf16-pure", tmp_path / "b")
    state = control.checkpoints.load_latest()[1]
    state["amp"]["masters"] = None
    control.load_state_dict(state)
    control.fit(3)
    assert not all(
        torch.equal(a, b) for a, b in zip(full.amp.master_params(), control.amp.master_params())
    )


def test_cli_o2_and_bf16_pure_train_bench_tune_and_resume(tmp_path, capsys):
    import json

    from ampkit.cli import main

    common = ["--model", "mlp", "--size", "tiny", "--device", "cpu", "--batch-size", "8"]
    ck = str(tmp_path / "ck")
    assert (
        main(
            [
                "train",
                *common,
                "--precision",
                "bf16-pure",
                "--steps",
                "4",
                "--checkpoint_dir",
                ck,
                "--checkpoint_every",
                "2",
                "--json",
                "--no-progress",
                "--log_dir",
                str(tmp_path / "l1"),
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["precision"] == "bf16-pure"
    assert (
        main(
            [
                "train",
                *common,
                "--precision",
                "bf16-pure",
                "--steps",
                "6",
                "--checkpoint_dir",
                ck,
                "--resume",
                "--json",
                "--no-progress",
                "--log_dir",
                str(tmp_path / "l2"),
            ]
        )
        == 0
    )
    s = json.loads(capsys.readouterr().out)
    assert s["precision"] == "bf16-pure" and s["optimizer_steps"] == 6
    # O2 = the pure form of auto's dtype (fp32 where auto picks fp32, e.g. a CPU without bf16 support)
    assert (
        main(
            [
                "train",
                *common,
                "--amp_opt_level",
                "O2",
                "--steps",
                "2",
                "--json",
                "--no-progress",
                "--log_dir",
                str(tmp_path / "l3"),
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["precision"] in ("fp32", "bf16-pure", "fp16-pure")
    out = tmp_path / "b.json"
    assert (
        main(
            [
                "bench",
                *common,
                "--precisions",
                "fp32,bf16-pure,fp16-pure",
                "--steps",
                "2",
                "--warmup",
                "1",
                "--repeats",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    results = {r["precision"]: r for r in json.loads(out.read_text())["results"]}
    assert results["bf16-pure"]["status"] == "ok" and results["fp16-pure"]["status"] == "ok"
    assert (
        main(
            [
                "tune",
                *common,
                "--precisions",
                "bf16-pure",
                "--steps",
                "2",
                "--warmup",
                "1",
                "--repeats",
                "1",
                "--out",
                str(tmp_path / "t.toml"),
                "--tolerance",
                "1.0",
            ]
        )
        == 0
    )


def test_pure_precision_on_a_sharded_model_keeps_no_second_master_copy():
    import socket

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        model = mlp()
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        amp = MixedPrecision("bf16-pure", device="cpu")
        amp.setup(model, opt)
        # Under FSDP2 the fp32 shards are the masters: no extra copy, the optimizer steps them.
        assert amp.master_params() == []
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert opt.param_groups[0]["params"][0] is next(iter(model.parameters()))
        with pytest.raises(ValueError, match="fp32 shards are the masters"):
            MasterWeights(model, [opt], torch.bfloat16)
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_resume_in_a_fresh_process_is_bitwise(tmp_path):
    import shutil
    import subprocess
    import sys

    from ampkit.loop.checkpoint import load_checkpoint

    def run(*args):
        r = subprocess.run(
            [
                sys.executable,
                "-m",
                "ampkit",
                "train",
                "--model",
                "gpt",
                "--size",
                "tiny",
                "--device",
                "cpu",
                "--batch-size",
                "2",
                "--precision",
                "bf16-pure",
                "--no-progress",
                *args,
            ],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert r.returncode == 0, r.stderr

    # one uninterrupted run keeps its step-2 checkpoint too; a fresh process resumes a copy of it
    run(
        "--steps",
        "4",
        "--checkpoint_dir",
        str(tmp_path / "a"),
        "--checkpoint_every",
        "2",
        "--log_dir",
        str(tmp_path / "la"),
    )
    (tmp_path / "b").mkdir()
    shutil.copy(tmp_path / "a" / "ckpt-00000002.pt", tmp_path / "b")
    run(
        "--steps",
        "4",
        "--checkpoint_dir",
        str(tmp_path / "b"),
        "--checkpoint_every",
        "2",
        "--resume",
        "--log_dir",
        str(tmp_path / "lc"),
    )
    a = load_checkpoint(str(tmp_path / "a" / "ckpt-00000004.pt"))
    b = load_checkpoint(str(tmp_path / "b" / "ckpt-00000004.pt"))
    assert a["amp"]["masters"] and all(
        torch.equal(v, b["amp"]["masters"][k]) for k, v in a["amp"]["masters"].items()
    )
    assert all(torch.equal(v, b["model"][k]) for k, v in a["model"].items())
