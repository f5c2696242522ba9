"""An engine state saved inside an accumulation window resumes that window exactly (issue 34 §2).

``amp.state_dict()`` at micro-step 2 of 4 saved the count but not the gradients summed so far, so
the resumed window stepped on half of them (0.036 off, silently), and a window of normalised losses
(Lightning's and Hugging Face's) crashed on the first backward after the load. Lightning, Slurm
requeues and time-based checkpoints can save inside a window. Now the window's gradients, its
divisor and kind ride in the state; where they cannot be restored exactly (another layout, several
processes), the resumed run starts a new window and says so.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch

import ampkit

DATA = None


def _data():
    global DATA
    if DATA is None:
        g = torch.Generator().manual_seed(0)
        DATA = [
            (torch.randn(8, 16, generator=g), torch.randn(8, 1, generator=g)) for _ in range(16)
        ]
    return DATA


def _make(precision):
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
    amp = ampkit.MixedPrecision(precision, device="cpu", accumulation_steps=4)
    model, opt = amp.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
    return amp, model, opt


def _micro(amp, model, opt, i, normalized):
    x, y = _data()[i]
    with amp.autocast():
        loss = torch.nn.functional.mse_loss(model(x).float(), y)
    amp.backward(loss / 4 if normalized else loss, normalized=normalized)
    amp.step(opt)


def _roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


@pytest.mark.parametrize("normalized", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "bf16-pure"])
def test_a_state_saved_inside_a_window_resumes_it_bitwise(precision, normalized):
    amp, model, opt = _make(precision)
    for i in range(16):
        _micro(amp, model, opt, i, normalized)
    ref = {k: v.clone() for k, v in model.state_dict().items()}

    amp, model, opt = _make(precision)
    for i in range(6):  # window 2, micro-step 2 of 4
        _micro(amp, model, opt, i, normalized)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        st = _roundtrip(
            {"amp": amp.state_dict(), "model": model.state_dict(), "opt": opt.state_dict()}
        )
    amp2, model2, opt2 = _make(precision)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model2.load_state_dict(st["model"])
        opt2.load_state_dict(st["opt"])
        amp2.load_state_dict(st["amp"])
    assert amp2.stats()["pending_micro_steps"] == 2
    for i in range(6, 16):
        _micro(amp2, model2, opt2, i, normalized)
    assert amp2.stats()["optimizer_steps"] == 4
    for k, v in model2.state_dict().items():
        assert torch.equal(v, ref[k]), k


def test_a_window_that_cannot_be_restored_starts_anew_and_says_so():
    amp, model, opt = _make("bf16")
    for i in range(6):
        _micro(amp, model, opt, i, False)
    st = _roundtrip({"amp": amp.state_dict()})
    st["amp"]["window"]["grads"] = {"0.0.0": torch.zeros(3)}  # another model's layout
    amp2, model2, opt2 = _make("bf16")
    with pytest.warns(UserWarning, match=r"inside an accumulation window \(micro-step 2 of 4\)"):
        amp2.load_state_dict(st["amp"])
    assert amp2.stats()["pending_micro_steps"] == 0  # a new window: no half-window step
    assert all(p.grad is None for p in model2.parameters())
    for i in range(6, 10):
        _micro(amp2, model2, opt2, i, False)
    assert amp2.stats()["optimizer_steps"] == 2
