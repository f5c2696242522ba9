"""Issue 24 item 7: DataParallel refused, the "ampkit" logger, profiler ranges, memory_efficient, and
the monitor's usage / memory / error figures."""

from __future__ import annotations

import io
import logging

import pytest
import torch
from torch.profiler import profile

from ampkit import MixedPrecision, Monitor
from ampkit.step.logs import enable_debug, logger
from ampkit.step.profiling import PHASES


class Blocks(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = torch.nn.ModuleList(
            torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()) for _ in range(3)
        )
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def _train(
    amp: MixedPrecision, steps: int = 4, seed: int = 0, clip: float | None = 1.0
) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = Blocks()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = amp.setup(model, opt)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 4, (8,), generator=g)
        with amp.autocast():
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
        amp.backward(loss)
        amp.step(opt, clip_grad_norm=clip)
    return model


def test_data_parallel_is_refused_pointing_at_ddp():
    amp = MixedPrecision("bf16", device="cpu")
    for wrapped in (
        torch.nn.DataParallel(Blocks()),
        torch.nn.Sequential(torch.nn.DataParallel(Blocks())),
    ):
        with pytest.raises(
            TypeError, match="DataParallel is not supported.*DistributedDataParallel"
        ):
            amp.setup(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1))


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_profile_shows_the_phases(precision):
    amp = MixedPrecision(precision, device="cpu")
    _train(amp, steps=1)
    with profile() as prof:
        _train(amp, steps=2)
    names = {e.name for e in prof.events()}
    missing = [
        p
        for p in PHASES
        if p not in names and not (p == "ampkit.unscale_check" and precision == "bf16")
    ]
    assert not missing, sorted(n for n in names if n.startswith("ampkit"))


def test_no_ranges_without_a_profiler_and_same_numerics():
    plain = _train(MixedPrecision("fp16", device="cpu"))
    with profile():
        profiled = _train(MixedPrecision("fp16", device="cpu"))
    for a, b in zip(plain.parameters(), profiled.parameters()):
        assert torch.equal(a, b)


def test_logger_has_the_precision_choice_skips_and_scale_changes():
    buf = io.StringIO()
    handler = enable_debug(buf, anomaly=False)
    try:
        amp = MixedPrecision("fp16", device="cpu", init_scale=2.0**100)  # overflows: skip, back off
        _train(amp, steps=3)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    text = buf.getvalue()
    assert "precision fp16 on cpu" in text
    assert (
        "step 1 skipped: non-finite gradients" in text
        and "step 1: loss scale 1.26765e+30 -> 6.33825e+29" in text
    )


def test_nothing_subscribes_when_the_logger_is_off():
    assert not logger.isEnabledFor(logging.INFO)
    amp = MixedPrecision("bf16", device="cpu")
    assert amp._stream.subscribers == []  # the engine pays nothing for logging


def test_memory_efficient_checkpoints_blocks_turns_cache_off_and_keeps_numerics():
    ref = _train(MixedPrecision("bf16", device="cpu"))
    amp = MixedPrecision("bf16", device="cpu", memory_efficient=True)
    model = _train(amp)
    assert amp.config.autocast_cache is False
    (event,) = [e for e in amp.events if e.kind == "memory_efficient"]
    assert (
        "activation checkpointing of 3 block(s) (blocks.0, blocks.1, blocks.2)"
        in event.data["levers"][0]
    )
    assert type(model.blocks[0]).__name__.startswith("Checkpointed")
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.equal(a, b)


def test_monitor_counts_steps_per_precision_fallbacks_errors_and_memory():
    amp = MixedPrecision(
        "fp16",
        device="cpu",
        init_scale=2.0**100,
        fallback="fp16,fp32",
        fallback_patience=2,
        fallback_check_every=1,
    )
    mon = Monitor(amp, log_every=2)
    _train(amp, steps=6)
    s = mon.close()
    assert (
        s["fallbacks"] == 1
        and s["steps_by_precision"]["fp16"] >= 2
        and s["steps_by_precision"]["fp32"] >= 1
    )
    assert sum(s["steps_by_precision"].values()) == 6
    assert s["errors"] == s["skipped_steps"] >= 2
    assert abs(sum(s["precision_usage"].values()) - 1.0) < 1e-9
    assert (
        s["memory_saved_bytes_predicted"] == 0
    )  # fp32 weights: autocast saves activations, not state
    pure = MixedPrecision("bf16-pure", device="cpu")
    mon = Monitor(pure)
    _train(pure, steps=1)
    n = sum(p.numel() for p in pure.model.parameters())
    # half params (+2), the fp32 gradients live on the fp32 masters (0), the masters (-4)
    assert mon.close()["memory_saved_bytes_predicted"] == 2 * n - 4 * n
