"""AmpkitTrainer = Hugging Face's own bf16 Trainer, bitwise; fp16 really trains with loss scaling on a CPU."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from ampkit import JSONLSink, MixedPrecision, read_jsonl  # noqa: E402
from ampkit.integrations.hf import AmpkitCallback, AmpkitTrainer  # noqa: E402


def tiny_gpt2(seed=0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=16,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(cfg)


def dataset(n=32, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (n, 16), generator=g)
    return [{"input_ids": x, "labels": x} for x in ids]


def args(tmp_path, **kw):
    base = dict(
        output_dir=str(tmp_path),
        use_cpu=True,
        per_device_train_batch_size=4,
        max_steps=4,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        logging_steps=2,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    return transformers.TrainingArguments(**{**base, **kw})


@pytest.mark.parametrize(
    "accum", [2, pytest.param(4, marks=pytest.mark.slow)]
)  # (slow: > 15 s here)
def test_bf16_equals_hugging_face_bf16(tmp_path, accum):
    theirs = tiny_gpt2()
    ours = tiny_gpt2()
    data = dataset()
    transformers.Trainer(
        theirs,
        args(tmp_path / "hf", bf16=True, gradient_accumulation_steps=accum, max_grad_norm=0.5),
        train_dataset=data,
    ).train()
    amp = MixedPrecision("bf16", device="cpu")
    trainer = AmpkitTrainer(
        ours,
        args(tmp_path / "ak", gradient_accumulation_steps=accum, max_grad_norm=0.5),
        train_dataset=data,
        amp=amp,
    )
    trainer.train()
    assert amp.optimizer_steps == 4
    for (name, a), b in zip(ours.named_parameters(), theirs.parameters()):
        assert torch.equal(a, b), name
    assert not torch.equal(
        ours.transformer.wte.weight, tiny_gpt2().transformer.wte.weight
    )  # it trained


@pytest.mark.slow
def test_fp16_trains_with_loss_scaling_and_skips_do_not_step_the_scheduler(tmp_path):
    model = tiny_gpt2()
    before = model.transformer.h[0].attn.c_attn.weight.detach().clone()
    amp = MixedPrecision(
        "fp16", device="cpu", init_scale=2.0**20
    )  # overflows at first: skipped steps
    callback = AmpkitCallback(amp, sinks=[JSONLSink(str(tmp_path / "log.jsonl"))], log_every=2)
    logged = []

    class Reporter(
        transformers.TrainerCallback
    ):  # what a reporting integration (W&B, MLflow) receives
        def on_log(self, args, state, control, logs=None, **kw):
            logged.append(dict(logs))

    trainer = AmpkitTrainer(
        model,
        args(tmp_path, gradient_accumulation_steps=2, max_steps=10, lr_scheduler_type="linear"),
        train_dataset=dataset(),
        amp=amp,
        callbacks=[callback, Reporter()],
    )
    trainer.train()
    stats = amp.stats()
    assert stats["precision"] == "fp16" and 0 < stats["skipped_steps"] < 10
    assert stats["scale"] < 2.0**20  # backed off
    assert (
        trainer.lr_scheduler.last_epoch == 10 - stats["skipped_steps"]
    )  # skipped steps: no LR step
    assert not torch.equal(model.transformer.h[0].attn.c_attn.weight, before)
    assert (
        logged
        and all("amp_scale" in h for h in logged)
        and logged[-1]["amp_skipped_steps"] == stats["skipped_steps"]
    )
    steps = [r for r in read_jsonl(str(tmp_path / "log.jsonl")) if r["type"] == "step"]
    assert [r["step"] for r in steps] == list(range(1, 11))
    assert sum(r["skipped"] for r in steps) == stats["skipped_steps"]
    assert all(r["precision"] == "fp16" for r in steps)


def test_refuses_hugging_faces_own_mixed_precision(tmp_path):
    with pytest.raises(ValueError, match="leave bf16 and fp16 off"):
        AmpkitTrainer(
            tiny_gpt2(),
            args(tmp_path, bf16=True),
            train_dataset=dataset(8),
            amp=MixedPrecision("bf16", device="cpu"),
        )


def test_bf16_pure_trains_with_masters(tmp_path):
    model = tiny_gpt2()
    amp = MixedPrecision("bf16-pure", device="cpu")
    AmpkitTrainer(
        model,
        args(tmp_path, gradient_accumulation_steps=2, max_grad_norm=1.0, max_steps=3),
        train_dataset=dataset(),
        amp=amp,
    ).train()
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert amp.master_params() and amp.optimizer_steps == 3


@pytest.mark.slow
def test_resume_from_a_checkpoint_restores_the_engine(tmp_path):
    """The engine's state (scale, skips, counters) is saved in the checkpoint and a resumed run
    ends where the uninterrupted one does, bitwise."""
    data = dataset(16)
    settings = dict(
        gradient_accumulation_steps=2,
        max_steps=4,
        save_strategy="steps",
        save_steps=2,
        lr_scheduler_type="constant",
    )
    whole, amp = (
        tiny_gpt2(),
        MixedPrecision("fp16", device="cpu", init_scale=2.0**19, growth_interval=2),
    )
    AmpkitTrainer(whole, args(tmp_path / "a", **settings), train_dataset=data, amp=amp).train()
    saved = torch.load(tmp_path / "a" / "checkpoint-2" / "ampkit_amp.pt", weights_only=True)
    assert saved["optimizer_steps"] == 2 and saved["precision"] == "fp16"
    resumed, amp2 = (
        tiny_gpt2(seed=5),
        MixedPrecision("fp16", device="cpu"),
    )  # state comes from the checkpoint
    AmpkitTrainer(resumed, args(tmp_path / "b", **settings), train_dataset=data, amp=amp2).train(
        resume_from_checkpoint=str(tmp_path / "a" / "checkpoint-2")
    )
    assert (
        amp.get_scale() != 2.0**19
    )  # the scale moved (backed off or grew): resuming must carry it
    assert amp2.optimizer_steps == 4 and amp2.get_scale() == amp.get_scale()
    assert amp2.state_dict()["scaler"] == amp.state_dict()["scaler"]
    for (name, a), b in zip(resumed.named_parameters(), whole.parameters()):
        assert torch.equal(a, b), name


def test_the_engine_state_in_a_checkpoint_is_verified_before_it_is_loaded(tmp_path):
    """``ampkit_amp.pt`` (the scale, the counters and, for the pure precisions, the fp32 master
    weights) was a bare ``torch.save``: a flipped byte inside a master loaded silently on resume.
    It is written as ampkit's checkpoints are (atomically, with its SHA-256 beside it) and checked
    before it is loaded; a file of the old form (no digest, no marker) still loads."""
    import types

    from ampkit import CheckpointError
    from ampkit.integrations.hf import AMP_STATE

    def engine():
        torch.manual_seed(0)
        model = torch.nn.Linear(64, 64)
        amp = MixedPrecision("bf16-pure", device="cpu")
        model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
        return types.SimpleNamespace(amp=amp), model, opt

    saver, model, opt = engine()
    amp = saver.amp
    amp.backward(model(torch.randn(4, 64, dtype=torch.bfloat16)).float().square().mean())
    amp.step(opt)
    AmpkitTrainer._save_scaler(saver, str(tmp_path))
    path = tmp_path / AMP_STATE
    assert (tmp_path / (AMP_STATE + ".sha256")).exists()
    loader = engine()[0]
    AmpkitTrainer._load_scaler(loader, str(tmp_path))
    assert loader.amp.optimizer_steps == 1
    for a, b in zip(loader.amp.master_params(), amp.master_params()):
        assert torch.equal(a, b)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="ampkit_amp.pt"):
        AmpkitTrainer._load_scaler(engine()[0], str(tmp_path))
    (tmp_path / (AMP_STATE + ".sha256")).unlink()
    torch.save(amp.state_dict(), path)  # the old form
    old = engine()[0]
    AmpkitTrainer._load_scaler(old, str(tmp_path))
    assert old.amp.optimizer_steps == 1


def _hf_engine():
    import types

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    amp = MixedPrecision("bf16-pure", device="cpu")
    model, opt = amp.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    return types.SimpleNamespace(amp=amp), model, opt


def _saved_engine(directory):
    """A stepped bf16-pure engine's ``ampkit_amp.pt`` in ``directory`` (made), as the Trainer saves it."""
    directory.mkdir(parents=True)
    saver, model, opt = _hf_engine()
    saver.amp.backward(model(torch.randn(4, 64, dtype=torch.bfloat16)).float().square().mean())
    saver.amp.step(opt)
    AmpkitTrainer._save_scaler(saver, str(directory))
    return saver.amp


def test_a_checkpoint_without_the_engine_state_is_refused_not_resumed_with_a_fresh_engine(tmp_path):
    """A ``checkpoint-N`` that holds the optimizer's state but no ``ampkit_amp.pt`` resumed with a
    fresh engine, silently (optimizer_steps restarted, a pure precision's fp32 masters rebuilt
    from the half weights): it lost the file, or was written without ampkit, and a resumed run
    would not be the run that was saved, so it is refused, naming the file and what it holds. A
    model-only checkpoint (``save_only_model``: Hugging Face resumes it with a fresh optimizer)
    resumes with a fresh engine too, with a warning that says so."""
    from ampkit import CheckpointError
    from ampkit.integrations.hf import AMP_STATE

    full = tmp_path / "checkpoint-4"
    full.mkdir()
    (full / "optimizer.pt").write_bytes(b"(the optimizer's state)")
    loader = _hf_engine()[0]
    with pytest.raises(CheckpointError) as e:
        AmpkitTrainer._load_scaler(loader, str(full))
    for words in (AMP_STATE, "checkpoint-4", "fp32 master weights", "fresh engine"):
        assert words in str(e.value), (words, str(e.value))
    model_only = tmp_path / "checkpoint-6"
    model_only.mkdir()
    (model_only / "model.safetensors").write_bytes(b"(weights)")
    with pytest.warns(UserWarning, match=rf"checkpoint-6' holds no training state.*{AMP_STATE}"):
        AmpkitTrainer._load_scaler(loader, str(model_only))
    assert loader.amp.optimizer_steps == 0


def test_a_damaged_engine_state_without_a_digest_is_an_error_naming_it(tmp_path):
    """Without its digest (and none beside it) a damaged ``ampkit_amp.pt`` loads unverified, and
    a flipped byte in its pickle crashed with ``TypeError: ParamEntry.__init__() missing ...
    'module_type'``: now an error naming the file. Beside ``checkpoint-N`` directories whose engine
    states have their digests, one without its own lost it: refused (the warning said "nor do the
    files beside it" there)."""
    from ampkit import CheckpointError
    from ampkit.integrations.hf import AMP_STATE

    _saved_engine(tmp_path / "alone" / "checkpoint-4")
    path = tmp_path / "alone" / "checkpoint-4" / AMP_STATE
    (tmp_path / "alone" / "checkpoint-4" / (AMP_STATE + ".sha256")).unlink()
    raw = path.read_bytes()
    assert b"module_type" in raw
    path.write_bytes(raw.replace(b"module_type", b"module_typf", 1))  # one flipped bit
    with (
        pytest.warns(UserWarning, match="unverified"),
        pytest.raises(CheckpointError, match=rf"checkpoint-4/{AMP_STATE}' .*not loaded"),
    ):
        AmpkitTrainer._load_scaler(_hf_engine()[0], str(tmp_path / "alone" / "checkpoint-4"))

    for n in (2, 4):
        _saved_engine(tmp_path / "run" / f"checkpoint-{n}")
    (tmp_path / "run" / "checkpoint-4" / (AMP_STATE + ".sha256")).unlink()
    with pytest.raises(
        CheckpointError, match=r"has no digest file .*beside it have theirs .*checkpoint-2"
    ):
        AmpkitTrainer._load_scaler(_hf_engine()[0], str(tmp_path / "run" / "checkpoint-4"))
