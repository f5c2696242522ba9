"""The memory ladder's rungs under FSDP2: real torch.distributed, 2 processes, gloo on CPU.

Under FSDP2 the fp32 shards are the masters; ``state_dtype='bf16'`` keeps each rank's optimizer
states in bf16, its shard's elements only, widened to fp32 for the step and rounded back
stochastically; ``masters='stochastic'`` keeps the shards themselves in bf16. ``split``/``kahan``
stay refused there, with a message naming what is supported.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ampkit import MixedPrecision, breakdown

from ..support.dist_helpers import run_ranks
from .test_distributed import Net, batch, full_state, max_diff

pytestmark = pytest.mark.distributed

STEPS = 6
LR = 1e-2


def _model(spec: str = "bf16-pure") -> nn.Module:
    from ampkit.distributed import shard

    torch.manual_seed(0)
    return shard(Net(), spec)


def _eval_loss(model: nn.Module, amp: MixedPrecision) -> float:
    """The loss on a fixed held-out batch, averaged over the ranks (each evaluates its own half)."""
    x, y = batch(10_000 + dist.get_rank())
    with torch.no_grad(), amp.autocast():
        loss = model(x, y).detach().float()
    dist.all_reduce(loss)
    return float(loss) / dist.get_world_size()


def _states(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, dict[str, tuple]]:
    """Per parameter, per parameter-shaped state: (global dtype, local dtype, local numel,
    the parameter's local numel, the parameter's global numel)."""
    out: dict[str, dict[str, tuple]] = {}
    for name, p in model.named_parameters():
        st = opt.state.get(p, {})
        out[name] = {
            k: (
                v.dtype,
                v.to_local().dtype,
                v.to_local().numel(),
                p.to_local().numel(),
                p.numel(),
            )
            for k, v in st.items()
            if isinstance(v, torch.Tensor) and v.dim() > 0
        }
    return out


def _shards(model: nn.Module) -> dict[str, tuple]:
    """Per parameter: (global dtype, local dtype, local numel, global numel)."""
    return {
        n: (p.dtype, p.to_local().dtype, p.to_local().numel(), p.numel())
        for n, p in model.named_parameters()
    }


def train_rung(rank: int, world: int, masters: str, state_dtype: str, sgd: bool = False) -> dict:
    model = _model(f"bf16-pure:{masters}" + ("+bf16" if state_dtype == "bf16" else ""))
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=True)
        if sgd
        else torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    )
    amp = MixedPrecision("bf16-pure", device="cpu", masters=masters, state_dtype=state_dtype)
    model, opt = amp.setup(model, opt)
    first = _eval_loss(model, amp)
    for s in range(STEPS):
        x, y = batch(s * world + rank)
        with amp.autocast():
            loss = model(x, y)
        amp.backward(loss)
        amp.step(opt)
    return {
        "first": first,
        "last": _eval_loss(model, amp),
        "params": full_state(model),
        "states": _states(model, opt),
        "shards": _shards(model),
        "violations": [e.to_dict() for e in amp.events if e.kind == "manifest_violation"],
        "breakdown": breakdown(model, opt, amp).by_category,
    }


def resume_rung(rank: int, world: int, masters: str, state_dtype: str, ckdir: str) -> dict:
    """Uninterrupted 6 steps vs 3 steps + sharded checkpoint + resume in a fresh Trainer + 3 steps."""
    from ampkit.train.trainer import Trainer

    def build(checkpoint_dir: str | None) -> Trainer:
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        amp = MixedPrecision("bf16-pure", device="cpu", masters=masters, state_dtype=state_dtype)
        model, opt = amp.setup(model, opt)
        return Trainer(
            model,
            opt,
            amp,
            batch,
            progress=False,
            log_every=2,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=3 if checkpoint_dir else None,
        )

    t = build(None)
    t.fit(6)
    whole = full_state(t.model)
    first = build(ckdir)
    first.fit(3)
    second = build(ckdir)
    path = second.resume()
    resumed_states = _states(second.model, second.optimizer)
    second.fit(3)
    return {
        "whole": whole,
        "resumed": full_state(second.model),
        "path": path,
        "resumed_states": resumed_states,
        "resumed_shards": _shards(second.model),
    }


def switched(rank: int, world: int, masters: str, state_dtype: str) -> dict:
    """Two steps on the rung, ``switch("fp32")``, one more step."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    amp = MixedPrecision("bf16-pure", device="cpu", masters=masters, state_dtype=state_dtype)
    model, opt = amp.setup(model, opt)

    def step(s: int) -> None:
        with amp.autocast():
            loss = model(*batch(s * world + rank))
        amp.backward(loss)
        amp.step(opt)

    for s in range(2):
        step(s)
    before = {n: p.to_local().float().clone() for n, p in model.named_parameters()}
    amp.switch("fp32")
    out = {
        "exact": all(torch.equal(p.to_local(), before[n]) for n, p in model.named_parameters()),
        "shards": _shards(model),
        "states": _states(model, opt),
    }
    step(2)
    out["after"] = _shards(model)
    return out


def refused(rank: int, world: int) -> dict:
    """``split``/``kahan`` are refused under FSDP2, and ``stochastic`` with keep_fp32: the messages."""
    out = {}
    for masters, keep in (("split", ()), ("kahan", ()), ("stochastic", ("head",))):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        amp = MixedPrecision("bf16-pure", device="cpu", masters=masters, keep_fp32=keep)
        try:
            amp.setup(model, opt)
            out[masters] = None
        except ValueError as e:
            out[masters] = str(e)
    return out


RESUMED = [("fp32", "bf16"), ("stochastic", "fp32"), ("stochastic", "bf16")]
JOBS: dict[str, tuple] = {
    "fp32-states": (train_rung, ("fp32", "fp32")),
    "bf16-states": (train_rung, ("fp32", "bf16")),
    "bf16-states-again": (train_rung, ("fp32", "bf16")),
    "stochastic": (train_rung, ("stochastic", "fp32")),
    "stochastic-bf16": (train_rung, ("stochastic", "bf16")),
    "stochastic-bf16-again": (train_rung, ("stochastic", "bf16")),
    "stochastic-bf16-sgd": (train_rung, ("stochastic", "bf16", True)),
    **{f"resume-{m}+{s}": (resume_rung, (m, s)) for m, s in RESUMED},
    "switched": (switched, ("stochastic", "bf16")),
    "switched-plain": (switched, ("fp32", "fp32")),
    "refused": (refused, ()),
}


def all_jobs(rank: int, world: int, ckroot: str) -> dict:
    out = {}
    for name, (fn, args) in JOBS.items():
        if fn is resume_rung:
            args = (*args, f"{ckroot}/{name}")
        try:
            out[name] = fn(rank, world, *args)
        except Exception as e:
            raise RuntimeError(f"distributed job {name!r} failed on rank {rank}") from e
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return run_ranks(all_jobs, str(tmp_path_factory.mktemp("rung-ck")))


@pytest.mark.slow
def test_bf16_states_under_fsdp2_hold_the_shards_elements_in_bf16(ranks):
    for r in ranks:
        states = r["bf16-states"]["states"]
        assert states and all(states.values())  # AdamW made exp_avg/exp_avg_sq for every weight
        for name, per in states.items():
            for key, (dtype, local_dtype, local, p_local, p_global) in per.items():
                assert dtype == local_dtype == torch.bfloat16, (name, key)
                # the shard's elements, not the full weight's: every dim 0 here splits evenly
                assert local == p_local == p_global // 2, (name, key)
        for per in r["fp32-states"]["states"].values():
            assert all(d == torch.float32 for d, *_ in per.values())
        # breakdown() on a rank counts that rank's optimizer state: its shard's, in bf16
        local = sum(sh[2] for sh in r["bf16-states"]["shards"].values())
        assert r["bf16-states"]["breakdown"]["optimizer_state"] >= 2 * 2 * local
        assert r["bf16-states"]["breakdown"]["optimizer_state"] < 2 * 2 * local + 4096  # + steps
        assert r["fp32-states"]["breakdown"]["optimizer_state"] >= 2 * 4 * local


@pytest.mark.slow
def test_bf16_states_under_fsdp2_train_like_fp32_states_and_reproduce_bitwise(ranks):
    a, b = ranks[0]["bf16-states"], ranks[0]["bf16-states-again"]
    assert max_diff(a["params"], b["params"]) == 0.0 and a["last"] == b["last"]
    assert max_diff(ranks[0]["bf16-states"]["params"], ranks[1]["bf16-states"]["params"]) == 0.0
    ref = ranks[0]["fp32-states"]
    assert max_diff(a["params"], ref["params"]) > 0.0  # the states really were rounded
    # The first step is the same (states are rounded after it); each later step's AdamW direction
    # m/sqrt(v) comes from states rounded to bf16 (relative error < 2**-7 each, stochastic
    # rounding: at most one bf16 spacing), i.e. within 1.5 * 2**-7 of fp32 states', so the weights'
    # displacement, and to first order the loss's progress, differ by at most that fraction;
    # plus the forward's bf16 weights (all-gathered in bf16) rounding to neighbours: 2**-8 of the
    # loss. Factor 2 of slack for second-order terms.
    progress = abs(ref["first"] - ref["last"])
    assert progress > 0.01 * ref["first"]  # it trained
    bound = 2 * (1.5 * 2**-7 * progress + 2**-8 * ref["last"])
    assert abs(a["last"] - ref["last"]) <= bound, (a["last"], ref["last"], bound)


@pytest.mark.slow
@pytest.mark.parametrize("masters,state_dtype", RESUMED)
def test_rungs_under_fsdp2_resume_from_a_sharded_checkpoint_bitwise(masters, state_dtype, ranks):
    want = torch.bfloat16 if state_dtype == "bf16" else torch.float32
    shard = torch.bfloat16 if masters == "stochastic" else torch.float32
    for r in ranks:
        r = r[f"resume-{masters}+{state_dtype}"]
        assert r["path"].endswith("ckpt-00000003")
        assert max_diff(r["resumed"], r["whole"]) == 0.0
        for per in r["resumed_states"].values():  # loaded exactly, kept in the rung's dtypes
            assert per and all(d == want == ld for d, ld, *_ in per.values())
        assert all(d == ld == shard for d, ld, *_ in r["resumed_shards"].values())


@pytest.mark.slow
def test_stochastic_masters_under_fsdp2_keep_bf16_shards_and_train_like_fp32_masters(ranks):
    ref = ranks[0]["fp32-states"]
    for job, state_dtype in (("stochastic", torch.float32), ("stochastic-bf16", torch.bfloat16)):
        for r in ranks:
            # the shards themselves are bf16, the rank's elements only
            for name, (d, ld, local, full) in r[job]["shards"].items():
                assert d == ld == torch.bfloat16 and local == full // 2, name
            for per in r[job]["states"].values():
                assert per and all(d == ld == state_dtype for d, ld, *_ in per.values())
        a = ranks[0][job]
        assert max_diff(a["params"], ref["params"]) > 0.0
        # Each step's update lands in bf16 rounded stochastically: unbiased, each weight off its
        # fp32-master value by less than one bf16 spacing (2**-7 relative) per step, so after
        # STEPS steps by at most STEPS * 2**-7 relative; the loss moves with the weights to first
        # order (relative sensitivity O(1) for this MLP + MSE): rel. STEPS * 2**-7 (~4.7%), which
        # still sits far below the distance the run travels only if it trained (checked).
        assert abs(ref["first"] - ref["last"]) > 0.01 * ref["first"]
        assert abs(a["last"] - ref["last"]) <= STEPS * 2**-7 * ref["last"], (job, a["last"])
        # bf16 shards are this rung's declared storage: no silent downgrade reported
        assert a["violations"] == [], a["violations"]
    for r in ranks:  # any optimizer: SGD's momentum (foreach) kept the same way
        sgd = r["stochastic-bf16-sgd"]
        assert sgd["last"] < sgd["first"]
        for name, per in sgd["states"].items():
            (d, ld, local, p_local, full) = per["momentum_buffer"]
            assert d == ld == torch.bfloat16 and local == p_local == full // 2, name
    b, c = ranks[0]["stochastic-bf16"], ranks[0]["stochastic-bf16-again"]
    assert max_diff(b["params"], c["params"]) == 0.0 and b["last"] == c["last"]
    assert max_diff(b["params"], ranks[1]["stochastic-bf16"]["params"]) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("job", ["switched", "switched-plain"])
def test_switching_to_fp32_under_fsdp2_gives_fp32_shards_exactly_and_trains_on(job, ranks):
    # (plain bf16-pure too: FSDP2 kept the first all-gather's bf16 buffers, and the next forward
    # after the switch failed on mixed dtypes)
    for r in ranks:
        r = r[job]
        assert r["exact"]  # the bf16 values, widened exactly
        for shards in (r["shards"], r["after"]):
            assert all(d == ld == torch.float32 for d, ld, *_ in shards.values())
        for per in r["states"].values():
            assert per and all(d == ld == torch.float32 for d, ld, *_ in per.values())


@pytest.mark.slow
def test_other_rungs_under_fsdp2_are_refused_naming_what_is_supported(ranks):
    for masters, msg in ranks[0]["refused"].items():
        assert msg is not None, masters
        assert f"masters={masters!r}" in msg and "FSDP2" in msg
        assert "state_dtype='bf16'" in msg and "masters='fp32' or 'stochastic'" in msg
    assert "keep_fp32" in ranks[0]["refused"]["stochastic"]


def test_fsdp_policy_takes_a_rung_spelling():
    # ``shard(model, "bf16-pure:stochastic+bf16")``: the rung changes nothing FSDP2 communicates
    from ampkit.distributed import fsdp_policy

    for spec in ("bf16-pure:stochastic+bf16", "bf16-pure:fp32+bf16", "bf16-pure:stochastic"):
        assert fsdp_policy(spec) == fsdp_policy("bf16-pure")
