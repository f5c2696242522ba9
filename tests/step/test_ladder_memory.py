"""The memory ladder in the estimates: ``estimate(..., precision="bf16-pure:<rung>")`` and parse_rung."""

from __future__ import annotations

import warnings

import pytest
import torch

from ampkit.plan.estimate import estimate
from ampkit.step.policies.pure.ladder import bytes_per_param, parse_rung


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 256)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).float().pow(2).mean()


@pytest.mark.parametrize(
    "spec,masters,state_dtype",
    [
        ("bf16-pure", "fp32", "fp32"),
        ("bf16-pure:split", "split", "fp32"),
        ("bf16-pure:stochastic+bf16", "stochastic", "bf16"),
        ("bf16-pure:none", "none", "fp32"),
    ],
)
def test_estimate_counts_each_rung(spec: str, masters: str, state_dtype: str) -> None:
    n = 2 * (256 * 256 + 256)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        e = estimate(_Net, (torch.randn(4, 256),), precision=spec)
    p = e.parts
    per = (p["parameters"] + p["master_weights"] + p["optimizer_state"]) / n
    assert e.precision == spec
    assert abs(per - bytes_per_param(masters, state_dtype)) <= 0.05, (spec, per)


def test_parse_rung() -> None:
    assert parse_rung("bf16-pure") == ("bf16-pure", {})
    assert parse_rung(torch.bfloat16) == (torch.bfloat16, {})
    assert parse_rung("bf16-pure:kahan") == (
        "bf16-pure",
        {"masters": "kahan", "state_dtype": "fp32", "allow_stall": False},
    )
    assert parse_rung("bf16-pure:stochastic+bf16")[1]["state_dtype"] == "bf16"
    with pytest.raises(ValueError, match="bf16-pure:<masters>.*split"):
        parse_rung("bf16-pure:halves")
    assert bytes_per_param("split", optimizer="sgd") == 8 and bytes_per_param("none") == 6


@pytest.mark.parametrize("rung", ["split", "kahan"])
def test_the_estimate_runs_the_bit_passes_unblocked_and_counts_the_same_bytes(
    rung: str, monkeypatch
) -> None:
    """Under fake tensors the split/join passes run as one block (they are in place: blocking
    changes no byte, only how many operations the estimate dispatches); the peak and every part
    equal those of the blocked passes the CPU runs."""
    from ampkit.step.policies.pure import eager as ladder  # the bit passes

    class Wide(torch.nn.Module):  # weights of 640*640 elements: several blocks of ladder.BLOCK
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Linear(640, 640), torch.nn.Linear(640, 640)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.nn.functional.gelu(self.a(x))).float().pow(2).mean()

    assert 2 * ladder.BLOCK < 640 * 640
    x = (torch.randn(8, 640),)
    one = estimate(Wide, x, precision=f"bf16-pure:{rung}")
    monkeypatch.setattr(ladder, "_blocks", lambda t: range(0, t.numel(), ladder.BLOCK))
    blocked = estimate(Wide, x, precision=f"bf16-pure:{rung}")
    assert (one.peak_bytes, one.parts) == (blocked.peak_bytes, blocked.parts)
