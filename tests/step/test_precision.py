import pytest
import torch

from ampkit import PrecisionError, resolve_precision
from ampkit.step.hardware import CpuFeatures, DeviceInfo, cpu_features, device_info
from ampkit.step.precision import CANONICAL, parse_precision


def cuda(cap, name="GPU"):
    return DeviceInfo(
        type="cuda",
        name=name,
        index=0,
        capability=cap,
        bf16=cap >= (8, 0),
        fp16=True,
        fp8=cap >= (8, 9),
    )


def cpu(*flags):
    return DeviceInfo(
        type="cpu",
        name="cpu",
        bf16=True,
        cpu=CpuFeatures(model="Test CPU", flags=tuple(flags), capability="AVX2"),
    )


MPS = DeviceInfo(type="mps", name="Apple MPS", bf16=False, fp16=True)


@pytest.mark.parametrize(
    "spec,name",
    [
        ("fp32", "fp32"),
        ("no", "fp32"),
        ("O0", "fp32"),
        ("32", "fp32"),
        ("32-true", "fp32"),
        (32, "fp32"),
        ("16", "fp16"),
        ("16-mixed", "fp16"),
        ("half", "fp16"),
        ("float16", "fp16"),
        ("torch.float16", "fp16"),
        ("bf16-mixed", "bf16"),
        ("bfloat16", "bf16"),
        (" BF16 ", "bf16"),
        ("Bf16-Mixed", "bf16"),
        ("bf16-true", "bf16-pure"),
        ("16-true", "fp16-pure"),
        ("tf32", "tf32"),
        ("fp8", "fp8"),
        ("O1", "auto"),
        ("mixed", "auto"),
        ("auto", "auto"),
        ("o2", "o2"),
        (torch.float16, "fp16"),
        (torch.bfloat16, "bf16"),
        (torch.float32, "fp32"),
    ],
)
def test_parse_aliases(spec, name):
    assert parse_precision(spec) == name


@pytest.mark.parametrize("bad", ["fp61", "", "int8", torch.int8, 3.5, None])
def test_unknown_precision_lists_choices(bad):
    with pytest.raises(PrecisionError) as e:
        parse_precision(bad)
    msg = str(e.value)
    for name in CANONICAL:
        assert name in msg
    assert isinstance(e.value, ValueError)


def test_unknown_precision_suggests_close_name():
    with pytest.raises(PrecisionError, match="did you mean 'bf16'"):
        parse_precision("bf61")


@pytest.mark.parametrize(
    "info,expected",
    [
        (cuda((9, 0), "H100"), "bf16"),
        (cuda((8, 0), "A100"), "bf16"),
        (cuda((8, 6)), "bf16"),
        (cuda((7, 0), "V100"), "fp16"),
        (cuda((7, 5), "T4"), "fp16"),
        (cuda((6, 1), "P40"), "fp32"),
        (cpu("avx512f", "amx_bf16", "amx_tile"), "bf16"),
        (cpu("avx512f", "avx512_bf16"), "bf16"),
        (cpu("avx2"), "fp32"),
        (cpu("avx512f"), "fp32"),
        (MPS, "fp16"),
    ],
)
def test_auto_rule(info, expected):
    p = resolve_precision("auto", info)
    assert p.name == expected
    assert p.reason and len(p.reason) > 20
    assert p.requested == "auto"
    assert p.device_type == info.type


def test_auto_never_fp8_even_on_hopper():
    assert resolve_precision("auto", cuda((9, 0))).name != "fp8"


def test_o2_is_pure_form_of_auto():
    assert resolve_precision("O2", cuda((8, 0))).name == "bf16-pure"
    assert resolve_precision("O2", cuda((7, 0))).name == "fp16-pure"
    assert resolve_precision("O2", cpu("avx2")).name == "fp32"


@pytest.mark.parametrize(
    "name,param,compute,scaler",
    [
        ("fp32", torch.float32, torch.float32, False),
        ("tf32", torch.float32, torch.float32, False),
        ("bf16", torch.float32, torch.bfloat16, False),
        ("fp16", torch.float32, torch.float16, True),
        ("bf16-pure", torch.bfloat16, torch.bfloat16, False),
        ("fp16-pure", torch.float16, torch.float16, True),
    ],
)
def test_precision_fields(name, param, compute, scaler):
    p = resolve_precision(name, cuda((9, 0)))
    assert (p.name, p.param_dtype, p.compute_dtype, p.needs_scaler) == (
        name,
        param,
        compute,
        scaler,
    )
    import dataclasses

    with pytest.raises(dataclasses.FrozenInstanceError):
        p.name = "x"  # frozen


@pytest.mark.parametrize(
    "spec,info,fragment",
    [
        ("fp8", cpu("avx2"), "fp8 needs an NVIDIA GPU"),
        ("fp8", cuda((8, 0), "A100"), "A100"),
        ("bf16", cuda((7, 0), "V100"), "V100"),
        ("bf16", MPS, "mps"),
        ("tf32", cuda((7, 5), "T4"), "T4"),
    ],
)
def test_unsupported_combination_names_device_and_reason(spec, info, fragment):
    with pytest.raises(PrecisionError) as e:
        resolve_precision(spec, info)
    assert fragment in str(e.value)
    assert "cannot run here" in str(e.value)


def test_fp8_on_hopper_resolves():
    p = resolve_precision("fp8", cuda((9, 0)))
    assert p.name == "fp8" and p.compute_dtype == torch.bfloat16


def test_cpu_emulation_is_stated_in_reason():
    assert "emulated" in resolve_precision("bf16", cpu("avx2")).reason
    assert "emulated" not in resolve_precision("bf16", cpu("amx_bf16")).reason


def test_real_probe_is_consistent():
    info = device_info("cpu")
    feats = cpu_features()
    assert info.type == "cpu" and info.cpu == feats
    assert resolve_precision("auto", "cpu").name == ("bf16" if feats.native_bf16 else "fp32")
    assert set(feats.flags) <= {
        "avx2",
        "avx512f",
        "avx512_bf16",
        "avx512_fp16",
        "amx_bf16",
        "amx_fp16",
        "amx_tile",
    }
    assert info.to_dict()["cpu"]["native_bf16"] == feats.native_bf16


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error when CUDA is absent")
def test_cuda_requested_without_cuda():
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_precision("bf16", "cuda")


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="checks the error when MPS is absent")
def test_mps_requested_without_mps(capsys):
    """``ampkit info --device mps`` on a machine without MPS described it as runnable ('auto ->
    fp16: Apple GPUs run fp16 natively'), and ``ampkit train --device mps`` ended in a traceback
    ('PyTorch is not linked with support for mps devices')."""
    from ampkit.cli import main

    with pytest.raises(ValueError, match="MPS is not available here"):
        resolve_precision("bf16", "mps")
    assert main(["info", "--device", "mps", "--no_measure"]) == 2
    assert "MPS is not available here" in capsys.readouterr().err
    assert (
        main(["train", "--model", "mlp", "--size", "tiny", "--steps", "1", "--device", "mps"]) == 2
    )
    assert "MPS is not available here" in capsys.readouterr().err


def test_one_list_of_names_each_with_a_family():
    from ampkit.step.precision import NAMES, precision_dtypes

    assert ("auto", *NAMES) == CANONICAL
    families = {n: resolve_precision(n, cuda((9, 0))).family for n in NAMES}
    assert families == {
        "fp32": "full",
        "tf32": "full",
        "bf16": "autocast",
        "fp16": "autocast",
        "bf16-pure": "pure",
        "fp16-pure": "pure",
        "fp8": "fp8",
        "fp8-rowwise": "fp8",
    }
    assert precision_dtypes("bf16-true") == (torch.bfloat16, torch.bfloat16)
    assert precision_dtypes("16-mixed") == (torch.float32, torch.float16)
    for device_dependent in ("auto", "O2", "O1"):
        with pytest.raises(PrecisionError, match="depends on the device"):
            precision_dtypes(device_dependent)


@pytest.mark.parametrize("alias,name", [("O0", "fp32"), ("O1", "auto"), ("O2", "o2"), ("o2", "o2")])
def test_apex_levels_in_the_alias_table(alias, name):
    assert parse_precision(alias) == name


@pytest.mark.parametrize(
    "name,policy",
    [
        ("fp32", "FullPolicy"),
        ("tf32", "FullPolicy"),
        ("bf16", "AutocastPolicy"),
        ("fp16", "AutocastPolicy"),
        ("bf16-pure", "PurePolicy"),
        ("fp16-pure", "PurePolicy"),
        ("fp8", "Fp8Policy"),
    ],
)
def test_policy_for_picks_the_family(name, policy):
    from ampkit import MixedPrecisionConfig
    from ampkit.step.policies import policy_for

    p = resolve_precision(name, "cpu", emulate_fp8=True)
    chosen = policy_for(p, MixedPrecisionConfig(), torch.device("cpu"))
    assert type(chosen).__name__ == policy
    d = chosen.describe()
    assert d["precision"] == name and d["family"] == p.family
    assert d["weights"] == str(p.param_dtype).replace("torch.", "")
    assert d["loss_scaling"] == p.needs_scaler
