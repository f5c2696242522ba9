"""plan_devices: a GPU planned from this CPU-only machine -- its allocator's blocks, cuBLAS
workspaces, fused attention and budget; bad names are one clear error listing the valid ones."""

import pytest
import torch

from ampkit.models.builtin import GPT, GPTConfig
from ampkit.plan import devices as plan_devices
from ampkit.plan.devices import CONTEXT_BYTES, DEVICES, FRAGMENTATION, parse_device
from ampkit.plan.session import Session

MiB = 1 << 20
H100 = DEVICES["h100-80gb"]


def test_block_bytes_follow_the_caching_allocator():
    """CUDACachingAllocator.cpp: every request rounded to 512 bytes; from kMinLargeAlloc (10 MiB) on,
    a segment of its own rounded to kRoundLarge (2 MiB) (torch's own test_graph_memory_stats cases)."""
    assert [H100.block_bytes(n) for n in (0, 1, 512, 513, MiB + 1)] == [
        512,
        512,
        512,
        1024,
        MiB + 512,
    ]
    assert H100.block_bytes(10 * MiB - 512) == 10 * MiB - 512  # cut from a shared 20 MiB segment
    assert H100.block_bytes(10 * MiB) == 10 * MiB and H100.block_bytes(10 * MiB + 512) == 12 * MiB


def test_workspaces_and_budget(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert H100.workspace_bytes() == 2 * 32 * MiB  # :4096:8 per handle from Hopper on, two handles
    assert (
        DEVICES["a100-40gb"].workspace_bytes() == 2 * (4096 * 2 + 16 * 8) * 1024
    )  # :4096:2:16:8 before
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert H100.workspace_bytes() == 2 * 16 * 8 * 1024
    assert H100.budget() == int((H100.memory_bytes - CONTEXT_BYTES) * (1 - FRAGMENTATION))
    assert H100.budget(40 << 30) == int(((40 << 30) - CONTEXT_BYTES) * (1 - FRAGMENTATION))
    with pytest.raises(ValueError, match="more than the NVIDIA H100"):
        H100.budget(100 << 30)
    with pytest.raises(ValueError, match="give --memory"):
        DEVICES["cuda"].budget()
    assert DEVICES["t4-16gb"].refuses("bf16-pure:split") and not DEVICES["t4-16gb"].refuses("fp16")
    assert DEVICES["a100-80gb"].refuses("fp8") and not H100.refuses("fp8")


def test_a_row_a_gpu_cannot_run_names_everything_it_lacks():
    """fp8 on a V100 (no bf16, no fp8) said only "has no bf16", as if a bf16 GPU would run it."""
    why = DEVICES["v100-32gb"].refuses("fp8-rowwise")
    assert "no bf16" in why and "no fp8 matmuls" in why
    assert DEVICES["v100-32gb"].refuses("bf16") == "the NVIDIA V100 32GB (sm_70) has no bf16"
    assert "bf16" not in DEVICES["a100-40gb"].refuses("fp8")


def test_bad_device_names_list_the_valid_ones():
    assert parse_device("cpu") is None and parse_device("H100_80GB") is H100
    with pytest.raises(ValueError) as e:
        parse_device("h100")
    assert "'h100'" in str(e.value) and "h100-80gb" in str(e.value) and "l4-24gb" in str(e.value)
    assert "did you mean 'h100-80gb'?" in str(e.value)  # a card without its memory: the named one
    with pytest.raises(ValueError, match="did you mean one of 'a100-80gb', 'a100-40gb'"):
        parse_device("A100")
    with pytest.raises(ValueError, match="did you mean 'l40s-48gb'"):
        parse_device("l40s-48g")


def _gpt(dropout: float) -> torch.nn.Module:
    return GPT(
        GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=2, n_embd=32, dropout=dropout)
    )


def _batch(b: int = 2, t: int = 64):
    x = torch.randint(0, 256, (b, t))
    return x, torch.roll(x, 1, 1)


def test_a_gpu_plan_counts_its_blocks_and_workspaces_from_this_cpu():
    """The same step planned for an H100 from this CPU-only machine: every storage in whole allocator
    blocks and cuBLAS's two workspaces on top of the CPU's figure; parts (exact bytes) unchanged."""
    with Session(lambda: _gpt(0.0), "adamw", "bf16") as s:
        cpu = s.measure(_batch())
    with plan_devices.use(H100), Session(lambda: _gpt(0.0), "adamw", "bf16") as s:
        gpu = s.measure(_batch())
    assert (
        gpu.parts["parameters"] == cpu.parts["parameters"]
        and gpu.parts["activations"] == cpu.parts["activations"]
    )
    assert gpu.peak_bytes >= cpu.peak_bytes + H100.workspace_bytes()
    assert all(g >= c + H100.workspace_bytes() for g, c in zip(gpu.timeline, cpu.timeline))
    assert plan_devices.current() is None  # the device was for the block only


def test_a_gpu_plan_takes_the_fused_attention_with_dropout():
    """With dropout the CPU runs attention's math kernel, which keeps the attention matrix; a GPU's fused
    kernel keeps the output and a row of log-sum-exp: the GPU plan is the CPU's less (at least) the
    matrix per layer -- and the same as the plan without dropout in attention (only attention drops here)."""
    b, t, heads, layers = 2, 64, 2, 2
    with Session(lambda: _gpt(0.1), "adamw", "fp32") as s:
        math_kernel = s.measure(_batch(b, t))
    with plan_devices.use(H100), Session(lambda: _gpt(0.1), "adamw", "fp32") as s:
        fused = s.measure(_batch(b, t))
    with plan_devices.use(H100), Session(lambda: _gpt(0.0), "adamw", "fp32") as s:
        no_dropout = s.measure(_batch(b, t))
    matrix = b * heads * t * t * 4
    assert math_kernel.parts["activations"] - fused.parts["activations"] >= layers * matrix
    assert fused.parts["activations"] == no_dropout.parts["activations"]
