"""No false manifest alarms on any rung of bf16-pure's memory ladder: at setup, during steps and on
resume (issue 34: a ``--state_dtype bf16`` resume recorded a ``manifest_violation`` per parameter
although the state was bitwise equal). The resume also continues bitwise."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from .test_manifest import engine, train, violations

RUNGS = [(m, s) for m in ("fp32", "split", "kahan", "stochastic", "none") for s in ("fp32", "bf16")]


def rung(masters: str, state_dtype: str):
    kw = dict(
        masters=masters,
        state_dtype=state_dtype,
        allow_stall=masters == "none",
        manifest_check_every=1,
        accumulation_steps=2,
    )
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore"
        )  # masters='none': the stall warning (its point is made there)
        return engine("bf16-pure", **kw)


def states(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        v
        for s in opt.state_dict()["state"].values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    ]


@pytest.mark.parametrize("optimizer_first", [True, False], ids=["optimizer-first", "engine-first"])
@pytest.mark.parametrize("masters,state_dtype", RUNGS)
def test_every_rung_is_silent_at_setup_during_steps_and_on_resume(
    masters, state_dtype, optimizer_first
):
    model, opt, amp = rung(masters, state_dtype)
    assert violations(amp) == []  # setup
    train(model, opt, amp, 2)
    assert violations(amp) == []  # steps (checked every step)
    # copies, as a checkpoint holds (torch's load_state_dict may alias same-dtype tensors)
    saved_opt, saved_amp = copy.deepcopy(opt.state_dict()), copy.deepcopy(amp.state_dict())
    model2, opt2, amp2 = rung(masters, state_dtype)
    model2.load_state_dict(copy.deepcopy(model.state_dict()))
    if optimizer_first:  # the Trainer's order
        opt2.load_state_dict(saved_opt)
        amp2.load_state_dict(saved_amp)
        # the loaded state keeps its dtype and values (torch casts it to the fp32 stand-ins' dtype)
        assert all(
            a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(states(opt2), states(opt))
        )
    else:
        amp2.load_state_dict(saved_amp)
        opt2.load_state_dict(saved_opt)
    assert violations(amp2) == []  # resume
    train(model, opt, amp, 1)
    train(model2, opt2, amp2, 1)
    assert violations(amp2) == []  # the first step after the resume (a check)
    ref, got = amp.full_precision_state_dict(), amp2.full_precision_state_dict()
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    assert all(torch.equal(a, b) for a, b in zip(states(opt2), states(opt)))
