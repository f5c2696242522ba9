"""foreach_check_and_unscale: the fused check-and-unscale where torch's kernel has no variant (bf16 on
CUDA), compared with torch's own kernel on the CPU (which has one): the same found_inf, the same bits."""

import pytest
import torch

from ampkit.step.gradcheck import foreach_check_and_unscale

HAS_CUDA = torch.cuda.is_available()


def _grads(device, special=None):
    g = torch.Generator().manual_seed(0)
    out = [torch.randn(n, generator=g) * 1e3 for n in (1, 17, 4099)] + [
        torch.randn(3, 5, generator=g)
    ]
    if special is not None:
        out[2][1234] = special
    return [t.to(device, torch.bfloat16) for t in out]


@pytest.mark.parametrize("special", [None, float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("inv", [1.0, 2.0**-13, 0.3])
def test_the_same_found_inf_and_bits_as_torchs_kernel(special, inv):
    ours, ref = _grads("cpu", special), _grads("cpu", special)
    f_ours, f_ref = torch.zeros(()), torch.zeros(())
    inv_t = torch.tensor(inv)
    foreach_check_and_unscale(ours, f_ours, inv_t)
    torch._amp_foreach_non_finite_check_and_unscale_(ref, f_ref, inv_t)
    assert f_ours.item() == f_ref.item() == (0.0 if special is None else 1.0)
    for a, b in zip(ours, ref):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    again = torch.ones(())  # an earlier tensor group's find is kept
    foreach_check_and_unscale(_grads("cpu"), again, inv_t)
    assert again.item() == 1.0


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("special", [None, float("nan"), float("inf")])
def test_bf16_gradients_on_cuda_are_checked_and_unscaled(special):
    from ampkit.step.gradcheck import check_and_unscale

    model = torch.nn.Linear(4099, 1, bias=False).cuda().bfloat16()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model.weight.grad = _grads("cuda", special)[2].view(1, -1)
    want = model.weight.grad.float() * 0.5
    found = check_and_unscale(opt, torch.tensor(0.5, device="cuda"), allow_fp16=True)
    assert found[torch.device("cuda", 0)].item() == (0.0 if special is None else 1.0)
    if special is None:
        assert torch.equal(model.weight.grad.float(), want.bfloat16().float())
