"""Loading a state whose engine settings differ from the engine's says so (issue 34: never a
silently different run): the checkpoint's settings are the run's, and each replaced one is named."""

from __future__ import annotations

import warnings

import pytest
import torch

from ampkit import MixedPrecision
from ampkit.step.settings_diff import CheckpointSettingsWarning


def _trained(precision: str, **kw):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = MixedPrecision(precision, device="cpu", **kw)
    model, opt = amp.setup(model, opt)
    with amp.autocast():
        loss = model(torch.randn(8, 4)).float().square().mean()
    amp.backward(loss)
    amp.step(opt)
    return amp


def test_loading_other_settings_names_each_one_replaced():
    saved = _trained("fp16", clip_grad_norm=1.0, growth_interval=100).state_dict()
    amp = _trained("fp16", clip_grad_norm=0.5, growth_interval=100)
    with pytest.warns(CheckpointSettingsWarning) as rec:
        amp.load_state_dict(saved)
    (w,) = rec
    msg = str(w.message)
    assert "clip_grad_norm 0.5 -> 1.0" in msg and "growth_interval" not in msg
    assert amp.config.clip_grad_norm == 1.0  # the checkpoint's: the run goes on as it was


def test_a_precision_the_run_fell_back_to_is_named():
    ran = _trained("fp16")
    ran.switch("bf16", reason="test")
    amp = _trained("fp16")
    with pytest.warns(CheckpointSettingsWarning, match="precision fp16 -> bf16"):
        amp.load_state_dict(ran.state_dict())
    assert amp.precision.name == "bf16"


def test_the_same_settings_load_without_a_word():
    saved = _trained("bf16", clip_grad_norm=1.0).state_dict()
    amp = _trained("bf16", clip_grad_norm=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp.load_state_dict(saved)


def test_an_engine_asked_for_auto_takes_the_runs_pick_without_a_word():
    saved = _trained("fp32").state_dict()
    amp = _trained("auto")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp.load_state_dict(saved)
    assert amp.precision.name == "fp32"
