import pytest
import torch

from ampkit import MixedPrecision
from ampkit.models.builtin import build
from ampkit.models.data import TextBatches
from ampkit.observe.memory import activations, breakdown, peak


def linear_stack(a=32, b=64, c=8):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.ReLU(), torch.nn.Linear(b, c))


def n_params(m):
    return sum(p.numel() for p in m.parameters())


def test_breakdown_exact_bytes_for_linear_stack():
    m = linear_stack()
    P = n_params(m)  # 32*64 + 64 + 64*8 + 8
    assert P == 32 * 64 + 64 + 64 * 8 + 8
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    bd = breakdown(m, opt)
    assert bd.by_category["parameters"] == 4 * P
    assert bd.by_category["gradients"] == 0 and bd.by_category["optimizer_state"] == 0
    m(torch.randn(4, 32)).sum().backward()
    opt.step()
    bd = breakdown(m, opt)
    assert bd.by_category["gradients"] == 4 * P
    # AdamW: exp_avg + exp_avg_sq (fp32, like the params) + one fp32 0-d `step` per parameter tensor
    assert bd.by_category["optimizer_state"] == 2 * 4 * P + 4 * 4
    assert bd.by_dtype == {"float32": bd.total}
    assert bd.total == 4 * P + 4 * P + 8 * P + 16  # params + grads + (exp_avg, exp_avg_sq) + steps


def test_breakdown_counts_tied_weights_once_and_by_dtype():
    emb = torch.nn.Embedding(100, 16)
    head = torch.nn.Linear(16, 100, bias=False)
    head.weight = emb.weight  # tied
    m = torch.nn.ModuleDict(
        {"emb": emb, "head": head, "extra": torch.nn.Linear(16, 16).to(torch.bfloat16)}
    )
    bd = breakdown(m)
    assert bd.cells[("parameters", "float32")] == 100 * 16 * 4
    assert bd.cells[("parameters", "bfloat16")] == (16 * 16 + 16) * 2


def test_breakdown_includes_scaler_state():
    m = linear_stack()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    amp = MixedPrecision("fp16", device="cpu")
    m, opt = amp.setup(m, opt)
    with amp.autocast():
        loss = m(torch.randn(4, 32)).float().sum()
    amp.backward(loss)
    amp.step(opt)
    bd = breakdown(m, opt, amp)
    # scale fp32, growth tracker int32, hysteresis budget int32, overflow count fp32, cached one fp32
    assert bd.by_category["scaler"] == 5 * 4
    assert "scaler" in bd.to_dict()["by_category"]


def test_activations_exact_fp32_and_bf16():
    n, a, b, c = 16, 32, 64, 8
    m = linear_stack(a, b, c)
    x = torch.randn(n, a)
    fp32 = activations(m, x, "fp32")
    # Linear1 saves its input; ReLU saves its output, which Linear2 saves again (same storage,
    # counted once). The weights are parameters: excluded.
    assert fp32.total == 4 * (n * a + n * b)
    assert fp32.by_module == {"0": 4 * n * a, "1": 4 * n * b}
    assert fp32.excluded_parameter_bytes == 4 * b * c  # Linear2's weight, saved as-is
    bf16 = activations(m, x, "bf16")
    # Under autocast: the bf16 input cast, the bf16 ReLU output, and Linear2's bf16 weight cast
    # (needed for the input gradient). Linear1's weight cast is not saved: x needs no grad.
    assert bf16.total == 2 * (n * a + n * b + c * b)
    assert bf16.by_dtype == {"bfloat16": bf16.total}


def test_activations_does_not_modify_model_or_leave_hooks():
    m = linear_stack()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    activations(m, torch.randn(4, 32), "bf16-pure")
    assert all(
        torch.equal(v, before[k]) and v.dtype == torch.float32 for k, v in m.state_dict().items()
    )
    assert all(not mod._forward_hooks and not mod._forward_pre_hooks for mod in m.modules())


def test_activations_with_loss_fn_attributes_loss():
    m = linear_stack()
    y = torch.randint(0, 8, (16,))
    r = activations(
        m,
        torch.randn(16, 32),
        "fp32",
        loss_fn=lambda out: torch.nn.functional.cross_entropy(out, y),
    )
    assert r.by_module.get("(loss)", 0) > 0


def test_bf16_saves_large_share_of_gpt_activations():
    torch.manual_seed(0)
    model = build("gpt", "tiny")
    x, y = TextBatches(batch_size=4, block_size=model.config.block_size)(0)
    fp32 = activations(model, (x, y), "fp32")
    bf16 = activations(model, (x, y), "bf16")
    fp16 = activations(model, (x, y), "fp16")
    assert bf16.total < 0.75 * fp32.total
    assert fp16.total == bf16.total  # same shapes, same element size
    assert any(k.startswith("blocks.") for k in fp32.by_module)


def test_peak_cpu_positive():
    assert peak("cpu") > 10 * 2**20


@pytest.mark.cuda
def test_peak_cuda_tracks_allocation():
    torch.cuda.reset_peak_memory_stats()
    before = peak("cuda")
    x = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    assert peak("cuda") >= before + 64 * 2**20
    del x
