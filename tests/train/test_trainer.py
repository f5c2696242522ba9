import copy
import json
import math

import pytest
import torch

from ampkit import MixedPrecision
from ampkit.cli import main
from ampkit.models.builtin import builtin
from ampkit.models.data import TextBatches
from ampkit.observe.memory import activations
from ampkit.step.activation_checkpointing import (
    apply_activation_checkpointing,
    remove_activation_checkpointing,
)
from ampkit.train.trainer import Trainer


@pytest.mark.slow
def test_activation_checkpointing_same_gradients_less_memory():
    torch.manual_seed(0)
    model, data = builtin("gpt", "tiny", batch_size=4)
    ckpt = copy.deepcopy(model)
    names = apply_activation_checkpointing(ckpt, ["blocks.*"])
    assert names == ["blocks.0", "blocks.1"]
    assert list(ckpt.state_dict()) == list(model.state_dict())
    x, y = data(0)
    for precision in ("fp32", "bf16"):
        full = activations(model, (x, y), precision).total
        less = activations(ckpt, (x, y), precision).total
        assert less < 0.5 * full
    for m in (model, ckpt):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(x, y)
        loss.backward()
    for a, b in zip(model.parameters(), ckpt.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0)  # recomputation is exact
    remove_activation_checkpointing(ckpt)
    assert type(ckpt.blocks[0]).__name__ == "_Block"


def test_activation_checkpointing_by_type_and_bad_target():
    model, _ = builtin("gpt", "tiny")
    from ampkit.models.builtin import _Block

    assert apply_activation_checkpointing(model, [_Block]) == ["blocks.0", "blocks.1"]
    with pytest.raises(ValueError, match="matches no module"):
        apply_activation_checkpointing(model, ["blockz"])


class Recorder:
    def __init__(self):
        self.calls = []

    def on_step_end(self, trainer, step, result):
        self.calls.append(("step", step))

    def on_eval(self, trainer, loss):
        self.calls.append(("eval", round(loss, 6)))

    def on_checkpoint(self, trainer, path):
        self.calls.append(("ckpt", path.rsplit("-", 1)[-1]))

    def on_train_end(self, trainer, summary):
        self.calls.append(("end", summary.optimizer_steps))


@pytest.mark.slow
def test_trainer_eval_callbacks_scheduler(tmp_path):
    torch.manual_seed(0)
    model, data = builtin("gpt", "tiny", batch_size=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    amp = MixedPrecision(
        "fp16", device="cpu", init_scale=2.0**30
    )  # the first steps overflow and are skipped
    model, opt = amp.setup(model, opt)
    rec = Recorder()
    val = TextBatches(batch_size=2, block_size=64, split="val")
    t = Trainer(
        model,
        opt,
        amp,
        data,
        progress=False,
        eval_batches=val,
        eval_every=3,
        eval_steps=2,
        eval_precision="fp32",
        callbacks=[rec],
        scheduler=sched,
        checkpoint_dir=str(tmp_path),
        checkpoint_every=6,
        log_dir=str(tmp_path / "log"),
    )
    summary = t.fit(6)
    skipped = summary.skipped_steps
    assert skipped >= 1
    # the scheduler stepped only after real optimizer steps
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.5 ** (6 - skipped))
    kinds = [c[0] for c in rec.calls]
    assert (
        kinds.count("step") == 6
        and kinds.count("eval") == 2
        and ("ckpt", "00000006.pt") in rec.calls
    )
    assert rec.calls[-1] == ("end", 6)
    log = [json.loads(line) for line in (tmp_path / "log" / "log.jsonl").read_text().splitlines()]
    evals = [r for r in log if r.get("kind") == "eval"]
    assert [e["step"] for e in evals] == [3, 6] and evals[0]["precision"] == "fp32"
    assert any(r.get("kind") == "checkpoint" and r["seconds"] > 0 for r in log)
    # evaluation in fp32 equals a hand-computed fp32 loss on the same batches
    with torch.no_grad():
        ref = torch.stack([model(*val(i)) for i in range(2)]).mean().item()
    assert t.evaluate() == pytest.approx(ref, rel=1e-6)


def test_trainer_bad_arguments(tmp_path):
    model, data = builtin("mlp", "tiny")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = MixedPrecision("fp32", device="cpu")
    model, opt = amp.setup(model, opt)
    with pytest.raises(ValueError, match="eval_precision"):
        Trainer(model, opt, amp, data, eval_precision="fp8")
    with pytest.raises(ValueError, match="checkpoint_dir"):
        Trainer(model, opt, amp, data, checkpoint_every=2)
    with pytest.raises(ValueError, match="eval_batches"):
        Trainer(model, opt, amp, data, eval_every=2)


@pytest.mark.parametrize(
    "setting,value,words",
    [
        ("eval_every", True, ["eval_every=True", "an integer"]),
        ("eval_every", 2.5, ["eval_every=2.5", "an integer"]),
        ("eval_steps", True, ["eval_steps=True", "an integer"]),
        ("checkpoint_every", True, ["checkpoint_every=True", "an integer"]),
        ("checkpoint_every", "5", ["checkpoint_every='5'", "an integer"]),
        ("keep_last", True, ["keep_last=True", "an integer"]),
        ("log_every", True, ["log_every=True", "an integer"]),
        ("log_every", "5", ["log_every='5'", "an integer"]),
        ("eval_every", 0, ["eval_every=0", ">= 1"]),
    ],
)
def test_trainer_counts_are_integers_not_booleans(tmp_path, setting, value, words):
    """``Trainer(eval_every=True)`` evaluated every step, ``eval_every=2.5`` was taken, and a string
    was a bare ``TypeError: '<' not supported``: the Trainer's counts are integers >= 1, as the
    engine's config refuses a bool for an int; the error names the setting, the value and why."""
    model, batches = builtin("mlp", "tiny", batch_size=4)
    opt = torch.optim.AdamW(model.parameters())
    amp = MixedPrecision("fp32")
    model, opt = amp.setup(model, opt)
    checkpoints = "checkpoint" in setting or setting == "keep_last"
    extra = {"checkpoint_dir": str(tmp_path)} if checkpoints else {}
    if setting.startswith("eval"):
        extra = {"eval_batches": batches, "eval_every": 2}
    with pytest.raises((TypeError, ValueError)) as e:
        Trainer(model, opt, amp, batches, **{**extra, setting: value})
    for w in words:
        assert w in str(e.value), str(e.value)


@pytest.mark.parametrize(
    "argv,fragment",
    [
        (
            ["--amp_opt_level", "O2", "--precision", "fp32"],
            "conflicting flags",
        ),  # (fp16 + O0: O0 wins, seed 004)
        (["--amp_opt_level", "O1", "--precision", "fp32"], "conflicting flags"),
        (["--model", "mlp", "--grad_ckpt"], "--grad_ckpt_modules"),
    ],
)
def test_train_flag_conflicts(argv, fragment, capsys):
    assert main(["train", "--steps", "1", "--device", "cpu", *argv]) == 2
    assert fragment in capsys.readouterr().err


@pytest.mark.slow
def test_train_cli_opt_level_scaler_flags_epochs_grad_ckpt_eval(tmp_path, capsys):
    rc = main(
        [
            "train",
            "--model",
            "mlp",
            "--size",
            "tiny",
            "--epochs",
            "1",
            "--batch_size",
            "2000",
            "--amp_opt_level",
            "O0",
            "--grad_scaler_growth_interval",
            "7",
            "--grad_scaler_backoff",
            "0.25",
            "--device",
            "cpu",
            "--json",
            "--log_dir",
            str(tmp_path / "a"),
            "--eval_every",
            "2",
        ]
    )
    assert rc == 0
    s = json.loads(capsys.readouterr().out)
    assert (
        s["precision"] == "fp32" and s["optimizer_steps"] == 5
    )  # 10,000 samples / 2,000 per batch
    rc = main(
        [
            "train",
            "--model",
            "gpt",
            "--size",
            "tiny",
            "--steps",
            "3",
            "--batch_size",
            "2",
            "--grad_ckpt",
            "--precision",
            "fp16",
            "--grad_scaler_growth_interval",
            "1",
            "--grad_scaler_init",
            "8",
            "--device",
            "cpu",
            "--json",
            "--log_dir",
            str(tmp_path / "b"),
        ]
    )
    assert rc == 0
    s = json.loads(capsys.readouterr().out)
    assert (
        s["final_scale"] == 64.0
    )  # 8 doubled on each of 3 finite steps: growth_interval=1 applied


def test_fit_epochs():
    model, data = builtin("mlp", "tiny", batch_size=2500)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    amp = MixedPrecision("fp32", device="cpu", accumulation_steps=2)
    model, opt = amp.setup(model, opt)
    t = Trainer(model, opt, amp, data, progress=False)
    assert (
        t.fit(epochs=1).optimizer_steps == 2
    )  # 10,000 samples / 2,500 per batch / 2 micro-batches
    with pytest.raises(ValueError, match="exactly one"):
        t.fit(3, epochs=1)


@pytest.mark.slow
def test_trainer_turns_fallback_on_by_default():
    from tests.support.unstable_model import Unstable, data

    torch.manual_seed(0)
    model = Unstable()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    amp = MixedPrecision("fp16", device="cpu", fallback_patience=2, fallback_check_every=2)
    assert amp.config.fallback is False
    model, opt = amp.setup(model, opt)
    batches = data(30)
    t = Trainer(model, opt, amp, lambda i: batches[i], progress=False, log_every=2)
    assert amp.config.fallback is True
    summary = t.fit(20)
    assert summary.precision == "bf16" and math.isfinite(summary.final_loss)
    assert t.diagnosis is not None and t.diagnosis.module == "big"
    amp2 = MixedPrecision("fp16", device="cpu")
    model2 = Unstable()
    model2, opt2 = amp2.setup(model2, torch.optim.AdamW(model2.parameters(), lr=3e-3))
    Trainer(model2, opt2, amp2, lambda i: batches[i], progress=False, fallback=False)
    assert amp2.config.fallback is False


@pytest.mark.parametrize(
    "flags, level, precision",
    [(["--amp_opt_level", "O0"], "O0", "fp32"), (["--precision", "bf16-pure"], "O2", "bf16-pure")],
)
def test_run_header_names_the_opt_level(tmp_path, capsys, flags, level, precision):
    from ampkit.train.summary import opt_level

    rc = main(
        [
            "train",
            "--model",
            "mlp",
            "--size",
            "tiny",
            "--steps",
            "1",
            "--batch_size",
            "64",
            *flags,
            "--device",
            "cpu",
            "--no_progress",
            "--log_dir",
            str(tmp_path),
        ]
    )
    out = " ".join(capsys.readouterr().out.split())  # rich wraps the header
    assert rc == 0 and f"in {precision} (opt level {level})" in out
    assert [opt_level(p) for p in ("fp32", "bf16", "fp16", "fp16-pure", "tf32", "fp8")] == [
        "O0",
        "O1",
        "O1",
        "O2",
        "-",
        "-",
    ]


@pytest.mark.parametrize(
    "flags, rung, what",
    [
        (["--precision", "bf16-pure:split"], "split", "bf16 weight + int16 remainder"),
        (
            ["--precision", "bf16-pure", "--masters", "stochastic", "--state_dtype", "bf16"],
            "stochastic+bf16",
            "optimizer states in bf16",
        ),
    ],
)
def test_run_header_names_the_ladder_rung_that_runs(tmp_path, capsys, flags, rung, what):
    """A rung of bf16-pure's ladder is what runs, so the header names it: it said "fp32 master
    weights" for every rung (issue 34 section 5: headers say what runs)."""
    argv = ["train", "--model", "mlp", "--size", "tiny", "--steps", "1", "--batch_size", "8"]
    rc = main([*argv, *flags, "--device", "cpu", "--no_progress", "--log_dir", str(tmp_path)])
    out = " ".join(capsys.readouterr().out.split())  # rich wraps the header
    header = out.split(" run summary")[0]
    assert rc == 0 and f"in bf16-pure:{rung} (opt level O2)" in header, header
    assert what in header and "fp32 master weights" not in header, header


def test_the_log_holds_every_step_a_checkpoint_holds(tmp_path):
    """The monitor reads its records every ``log_every`` steps; a process killed after a checkpoint
    lost the records since the last read, and the resumed run's log had a gap (steps 11-19 of a
    SIGKILL after checkpoint 19, log_every=10). Each checkpoint is written after the records up to
    its step are: the log on disk when a checkpoint exists covers it."""
    torch.manual_seed(0)
    model, data = builtin("mlp", "tiny", batch_size=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    amp = MixedPrecision("bf16", device="cpu")
    model, opt = amp.setup(model, opt)
    logged = {}

    class Look:
        def on_checkpoint(self, trainer, path):
            lines = (tmp_path / "log" / "log.jsonl").read_text().splitlines()
            logged[trainer.amp.optimizer_steps] = [
                r["step"] for r in map(json.loads, lines) if r.get("type") == "step"
            ]

    Trainer(
        model,
        opt,
        amp,
        data,
        progress=False,
        callbacks=[Look()],
        checkpoint_dir=str(tmp_path / "ck"),
        checkpoint_every=3,
        log_every=10,
        log_dir=str(tmp_path / "log"),
    ).fit(7)
    assert logged == {3: [1, 2, 3], 6: [1, 2, 3, 4, 5, 6]}


def _linear_and_batches():
    model = torch.nn.Linear(4, 1)
    batch = (torch.randn(8, 4), torch.randn(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.1), lambda i: batch


def _mse(model, batch):
    return torch.nn.functional.mse_loss(model(batch[0]), batch[1])


def test_trainer_refuses_an_engine_not_set_up_with_its_model_and_optimizer(capsys):
    """Refused when built (before any table or step), saying what to call (issue 34 §5)."""
    model, opt, batches = _linear_and_batches()
    amp = MixedPrecision("fp32", device="cpu")
    with pytest.raises(ValueError, match=r"amp\.setup\(model, optimizer\)") as e:
        Trainer(model, opt, amp, batches, loss_fn=_mse)
    assert "was never set up" in str(e.value)
    other, other_opt, _ = _linear_and_batches()
    amp.setup(other, other_opt)
    with pytest.raises(ValueError, match="set up with another model"):
        Trainer(model, opt, amp, batches, loss_fn=_mse)
    amp.setup(model)  # the model, but not this optimizer
    with pytest.raises(ValueError, match="optimizer passed to the Trainer was not given"):
        Trainer(model, opt, amp, batches, loss_fn=_mse)
    assert amp.config.fallback is False  # refused before the Trainer changed the engine
    assert capsys.readouterr().out == ""
    model, opt = amp.setup(model, opt)
    with pytest.raises(ValueError, match="torch.compile wrapper .*compile=True"):
        Trainer(torch.compile(model), opt, amp, batches, loss_fn=_mse)  # (lazy: nothing compiled)
    assert Trainer(model, opt, amp, batches, loss_fn=_mse).fit(1).optimizer_steps == 1


def test_summary_json_is_written_atomically_and_a_failed_write_names_it(tmp_path, monkeypatch):
    """summary.json goes through a temporary file: a write that fails (a full disk) leaves the
    previous summary whole, no temporary file behind, and the error names summary.json."""
    import errno
    import os

    from ampkit.train import runlog

    runlog.write_summary(str(tmp_path), {"steps": 1})
    assert json.loads((tmp_path / "summary.json").read_text()) == {"steps": 1}

    real_fsync = os.fsync

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match="run's summary") as info:
        runlog.write_summary(str(tmp_path), {"steps": 2, "pad": "x" * 10000})
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert info.value.filename == str(tmp_path / "summary.json")
    assert json.loads((tmp_path / "summary.json").read_text()) == {"steps": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
