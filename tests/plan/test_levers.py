"""plan_levers.in_backward: the optimizer in backward planned from a measured step -- the gradients
held at each operation replaced by (at most) the largest parameter's."""

import pytest
import torch

from ampkit.plan.levers import in_backward
from ampkit.plan.session import Measure, Session


def test_the_gradients_held_are_replaced_by_the_largest_parameters():
    parts = {
        "parameters": 10,
        "gradients": 15,
        "master_weights": 0,
        "optimizer_state": 20,
        "activations": 5,
        "temporaries": 0,
    }
    m = Measure(
        "fp32",
        60,
        parts,
        {},
        timeline=(40, 55, 60, 50),
        phases=(1, 3),
        grads=(0, 5, 15, 15),
        largest_grad=4,
    )
    got = in_backward(m)
    assert got.timeline == (40, 54, 49, 39) and got.grads == (0, 4, 4, 4)
    assert got.parts["gradients"] == 4 and got.peak_bytes == 54
    assert got.parts["temporaries"] == 54 - (10 + 4 + 20 + 5)
    assert got.phases == m.phases
    with pytest.raises(ValueError, match="no gradient timeline"):
        in_backward(
            Measure("fp32", 60, parts, {}, (40, 55, 60, 50))
        )  # e.g. from an older plan cache


def test_a_measured_step_records_its_gradients():
    """The tracker follows the gradients' bytes: none in the forward, all of them (the breakdown's
    gradients) from the end of the backward into the optimizer step; the largest is the largest
    parameter's share."""

    def model():
        return torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8)
        )

    batch = (torch.randn(16, 64),)
    with Session(lambda: _Loss(model()), "adamw", "fp32") as s:
        m = s.measure(batch)
    assert len(m.grads) == len(m.timeline)
    forward_end, backward_end = m.phases
    assert set(m.grads[:forward_end]) == {0}
    assert m.grads[backward_end - 1] == m.parts["gradients"] == 4 * (64 * 256 + 256 + 256 * 8 + 8)
    assert m.largest_grad == 4 * 64 * 256
    turned = in_backward(m)
    assert turned.peak_bytes <= m.peak_bytes and turned.parts["gradients"] == m.largest_grad


class _Loss(torch.nn.Module):
    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x).pow(2).mean()
