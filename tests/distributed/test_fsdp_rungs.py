"""The memory ladder's rungs under FSDP2: real torch.distributed, 2 processes, gloo on CPU.

Under FSDP2 the fp32 shards are the masters; ``state_dtype='bf16'`` keeps each rank's optimizer
states in bf16, its shard's elements only, widened to fp32 for the step and rounded back
stochastically. The other rungs stay refused there, with a message naming what is supported.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from ampkit import MixedPrecision

from ..support.dist_helpers import run_ranks
from .test_distributed import Net, batch, full_state, max_diff

pytestmark = pytest.mark.distributed

STEPS = 6
LR = 1e-2


def _model() -> nn.Module:
    from ampkit.distributed import shard

    torch.manual_seed(0)
    return shard(Net(), "bf16-pure")


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


def train_rung(rank: int, world: int, state_dtype: str) -> dict:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    amp = MixedPrecision("bf16-pure", device="cpu", state_dtype=state_dtype)
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
    }


def resume_rung(rank: int, world: int, ckdir: str) -> dict:
    """Uninterrupted 6 steps vs 3 steps + sharded checkpoint + resume in a fresh Trainer + 3 steps."""
    from ampkit.train.trainer import Trainer

    def build(checkpoint_dir: str | None) -> Trainer:
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
        amp = MixedPrecision("bf16-pure", device="cpu", state_dtype="bf16")
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
    }


def refused(rank: int, world: int) -> dict:
    """Every rung but fp32 masters is refused under FSDP2: the messages."""
    out = {}
    for masters in ("split", "kahan", "stochastic"):
        model = _model()
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        amp = MixedPrecision("bf16-pure", device="cpu", masters=masters)
        try:
            amp.setup(model, opt)
            out[masters] = None
        except ValueError as e:
            out[masters] = str(e)
    return out


JOBS: dict[str, tuple] = {
    "fp32-states": (train_rung, ("fp32",)),
    "bf16-states": (train_rung, ("bf16",)),
    "bf16-states-again": (train_rung, ("bf16",)),
    "resume": (resume_rung, ()),
    "refused": (refused, ()),
}


def all_jobs(rank: int, world: int, ckroot: str) -> dict:
    out = {}
    for name, (fn, args) in JOBS.items():
        if fn is resume_rung:
            args = (f"{ckroot}/{name}",)
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
def test_bf16_states_under_fsdp2_resume_from_a_sharded_checkpoint_bitwise(ranks):
    for r in ranks:
        r = r["resume"]
        assert r["path"].endswith("ckpt-00000003")
        assert max_diff(r["resumed"], r["whole"]) == 0.0
        for per in r["resumed_states"].values():
            assert per and all(d == torch.bfloat16 == ld for d, ld, *_ in per.values())


@pytest.mark.slow
def test_other_rungs_under_fsdp2_are_refused_naming_what_is_supported(ranks):
    for masters, msg in ranks[0]["refused"].items():
        assert msg is not None, masters
        assert f"masters={masters!r}" in msg and "FSDP2" in msg
        assert "state_dtype='bf16'" in msg and "masters='fp32'" in msg
