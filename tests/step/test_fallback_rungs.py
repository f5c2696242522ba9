"""The fallback chain between rungs of bf16-pure's memory ladder (step/fallback.py, module doc)."""

from __future__ import annotations

import io

import pytest
import torch

from ampkit import MixedPrecision
from ampkit.step.precision import PrecisionError

CHAIN = "bf16-pure:stochastic+bf16,bf16-pure:split,fp32"
NAN_AT = (2, 6)  # batches holding a NaN input: each moves one rung down the chain


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.LayerNorm(32), torch.nn.GELU(), torch.nn.Linear(32, 4)
    )


def _setup(fallback, masters: str = "stochastic", state_dtype: str = "bf16"):
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    amp = MixedPrecision(
        "bf16-pure",
        masters=masters,
        state_dtype=state_dtype,
        fallback=fallback,
        fallback_patience=1,
        fallback_check_every=1,
    )
    model, opt = amp.setup(model, opt)
    return model, opt, amp


def _batches(n: int, seed: int = 1, nan_at: tuple[int, ...] = NAN_AT):
    g = torch.Generator().manual_seed(seed)
    for i in range(n):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        if i in nan_at:
            x[0, 3] = float("nan")
        yield x, y


def _step(amp: MixedPrecision, model, opt, x, y) -> None:
    with amp.autocast():
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    amp.backward(loss)
    amp.step(opt)


def _rung(amp: MixedPrecision) -> str:
    if amp.precision.name != "bf16-pure":
        return amp.precision.name
    return f"bf16-pure:{amp.config.masters}" + ("+bf16" if amp.config.state_dtype == "bf16" else "")


def test_chain_moves_rung_by_rung_and_records_each_move() -> None:
    model, opt, amp = _setup(CHAIN)
    seen = []
    for x, y in _batches(10):
        _step(amp, model, opt, x, y)
        seen.append(_rung(amp))
    moves = [e for e in amp.events if e.kind == "fallback"]
    assert [(e.data["from_rung"], e.data["to_rung"]) for e in moves] == [
        ("bf16-pure:stochastic+bf16", "bf16-pure:split"),
        ("bf16-pure:split", "fp32"),
    ]
    assert [(e.data["from"], e.data["to"]) for e in moves] == [
        ("bf16-pure", "bf16-pure"),
        ("bf16-pure", "fp32"),
    ]
    assert all(e.data["trigger"] == "nonfinite_unscaled" for e in moves)
    # Batch i is optimizer step i + 1; the check after the non-finite step acts (module doc: at most
    # 2 * check_every steps later).
    assert [e.step for e in moves] == [NAN_AT[0] + 2, NAN_AT[1] + 2]
    assert (
        seen[NAN_AT[0]] == "bf16-pure:stochastic+bf16" and seen[NAN_AT[0] + 1] == "bf16-pure:split"
    )
    assert seen[NAN_AT[1]] == "bf16-pure:split" and seen[NAN_AT[1] + 1] == "fp32" == seen[-1]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert next(model.parameters()).dtype == torch.float32


def test_a_rung_move_is_bitwise_what_switch_gives() -> None:
    """The same batches with the fallback off and switch() called after the step the fallback acted
    on: the same parameters, masters and optimizer states, then and after more steps."""
    model, opt, amp = _setup(CHAIN)
    ref_model, ref_opt, ref = _setup(False)
    for i, (x, y) in enumerate(_batches(6, nan_at=(2,))):
        _step(amp, model, opt, x, y)
        _step(ref, ref_model, ref_opt, x, y)
        if i == 3:  # the NaN step is optimizer step 3; the check at step 4 acts (module doc)
            assert _rung(amp) == "bf16-pure:split" and _rung(ref) == "bf16-pure:stochastic+bf16"
            ref.switch("bf16-pure", masters="split", state_dtype="fp32")
            mine, theirs = amp.full_precision_state_dict(), ref.full_precision_state_dict()
            assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert p.dtype == q.dtype == torch.bfloat16 and torch.equal(p, q)
    for s, t in zip(opt.state.values(), ref_opt.state.values()):
        assert all(torch.equal(s[k], t[k]) for k in t)
    mine, theirs = amp.full_precision_state_dict(), ref.full_precision_state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)


def test_resume_after_a_fallback_keeps_the_rung() -> None:
    model, opt, amp = _setup(CHAIN)
    batches = list(_batches(9, nan_at=(2,)))
    for x, y in batches[:5]:
        _step(amp, model, opt, x, y)
    assert _rung(amp) == "bf16-pure:split"
    buf = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict()}, buf)
    for x, y in batches[5:]:
        _step(amp, model, opt, x, y)

    model2, opt2, amp2 = _setup(CHAIN)  # configured on the first rung, as the run started
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    amp2.load_state_dict(ck["amp"])  # the rung first: the model takes its form, then its values
    model2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    assert _rung(amp2) == "bf16-pure:split"
    for x, y in batches[5:]:
        _step(amp2, model2, opt2, x, y)
    straight, resumed = amp.full_precision_state_dict(), amp2.full_precision_state_dict()
    assert all(torch.equal(resumed[k], straight[k]) for k in straight)
    # The chain goes on from the rung it resumed on: the next trouble moves to fp32.
    for x, y in _batches(4, seed=3, nan_at=(0,)):
        _step(amp2, model2, opt2, x, y)
    assert amp2.precision.name == "fp32"
    assert [e.data.get("to_rung") for e in amp2.events if e.kind == "fallback"] == [
        "bf16-pure:split",
        "fp32",
    ]


def test_a_plain_bf16_pure_entry_matches_any_rung() -> None:
    model, opt, amp = _setup("bf16-pure,fp32", masters="kahan", state_dtype="fp32")
    for x, y in _batches(5, nan_at=(1,)):
        _step(amp, model, opt, x, y)
    (move,) = [e for e in amp.events if e.kind == "fallback"]
    assert (move.data["from_rung"], move.data["to"]) == ("bf16-pure:kahan", "fp32")


@pytest.mark.parametrize(
    "chain,says",
    [
        ("bf16-pure:half,fp32", ["'bf16-pure:half'", "fp32, split, kahan, stochastic, none"]),
        ("bf16-pure:split+fp16,fp32", ["'bf16-pure:split+fp16'", "[+bf16]"]),
        (
            "bf16-pure:stochastic+bf16,fp16-pure:split,fp32",
            ["'fp16-pure:split'", "only bf16-pure has a memory ladder"],
        ),
        (
            "bf16-pure:split,fp32",
            [
                "does not contain the training precision 'bf16-pure:stochastic+bf16'",
                "'bf16-pure:stochastic+bf16,fp32'",
            ],
        ),
        ("bf16-pure:stochastic+bf16,bf16-pure:stochastic+bf16,fp32", ["names an entry twice"]),
    ],
)
def test_bad_chain_entries_say_what_and_why(chain: str, says: list[str]) -> None:
    with pytest.raises(PrecisionError) as err:
        MixedPrecision("bf16-pure", masters="stochastic", state_dtype="bf16", fallback=chain)
    assert all(s in str(err.value) for s in says), str(err.value)
