"""Hugging Face models built from their config class (never downloaded), text data from files,
and ``--save_model``: through ``ampkit plan`` and ``ampkit train`` as a user runs them."""

import json

import pytest
import torch

from ampkit.models.data import TextSamples, load_texts

transformers = pytest.importorskip("transformers")

SMALL = "n_layer=2,n_embd=64,n_head=2,n_positions=64"
TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "import os\nprint(os.getcwd())\n",
    "x = [i * i for i in range(9)]\n",
]


def test_text_samples_pad_ignore_and_visit_every_text_once_per_epoch():
    data = TextSamples(TEXTS, batch_size=1, max_length=20, seed=3)
    assert data.length == 20 and data.batches_per_epoch == 3
    seen = set()
    for i in range(3):
        x, y = data(i)
        row = bytes(
            t for t in x[0].tolist() if t
        )  # x holds the text's bytes but the last, then padding (0)
        seen.add(row)
        valid = y[0] != -100
        assert torch.equal(y[0][valid][:-1], x[0][1 : int(valid.sum())])  # y is x shifted by one
    assert seen == {t.encode()[:20] for t in TEXTS}
    full = TextSamples(["ab", "abcdef"], batch_size=2, max_length=512)
    x, y = full(0)
    assert x.shape == (2, 5) and (y == -100).sum() == 4  # "ab" -> 1 target, padded to 5
    with pytest.raises(ValueError, match="fewer than 2 bytes"):
        TextSamples(["a"], batch_size=1)


def test_load_texts_formats(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"texts": TEXTS}))
    (tmp_path / "b.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in TEXTS))
    assert load_texts(str(tmp_path / "a.json")) == TEXTS == load_texts(str(tmp_path / "b.jsonl"))
    (tmp_path / "c.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="list of strings"):
        load_texts(str(tmp_path / "c.json"))


@pytest.mark.slow
def test_plan_takes_a_config_class_path(capsys):
    from ampkit.cli import main

    argv = [
        "plan",
        "--model",
        "transformers.GPT2Config",
        "--model_config",
        SMALL + ",vocab_size=256",
        "--memory",
        "64MiB",
        "--precisions",
        "fp32,bf16",
        "--batch_size",
        "4",
        "--json",
    ]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    rows = {r["precision"]: r for r in out["rows"]}
    assert rows["bf16"]["largest_batch"] >= rows["fp32"]["largest_batch"] >= 1
    assert "transformers.GPT2Config" in out["model"]
    for bad, says in (
        (["--model_config", "n_layr=2"], "no field(s) 'n_layr'"),
        (["--model_config", "n_layer"], "is not key=value"),
        (["--model", "transformers.NoSuchConfig"], "has no config class"),
        (["--model_config", "vocab_size=100"], "needs >= 256"),
    ):
        args = ["plan", "--model", "gpt2", "--memory", "1GiB", "--precisions", "fp32", *bad]
        assert main(args) == 2
        err = capsys.readouterr().err
        assert says in err and len(err.strip().splitlines()) == 1, err


LLAMA_LIKE = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 256,
    "max_position_embeddings": 64,
}


def test_families_by_name_keyword_fields_or_a_config_file(tmp_path):
    """Llama, Mistral, Qwen2 (and GPT-2) by alias with keyword fields, or from a model's config.json
    (its model_type names the family; --model_config still overrides); nothing downloaded."""
    from ampkit.models.hf_configs import hf_config, is_hf
    from ampkit.plan.depth import stack_for

    for alias, cls in (
        ("llama", "LlamaConfig"),
        ("mistral", "MistralConfig"),
        ("qwen2", "Qwen2Config"),
    ):
        cfg = hf_config(alias, LLAMA_LIKE)
        assert type(cfg).__name__ == cls and cfg.num_key_value_heads == 2 and cfg.hidden_size == 64
    assert type(hf_config("gpt2", {"n_layer": 2})).__name__ == "GPT2Config"
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {
                "model_type": "qwen2",
                "architectures": ["Qwen2ForCausalLM"],
                "transformers_version": "4.0",
                **LLAMA_LIKE,
            }
        )
    )
    assert is_hf(str(path))
    cfg = hf_config(str(path), {"num_hidden_layers": 5})
    assert (
        type(cfg).__name__ == "Qwen2Config"
        and cfg.num_hidden_layers == 5
        and cfg.intermediate_size == 128
    )
    st = stack_for(str(path))
    assert (
        st is not None and st.depth == 3 and '"intermediate_size": 128' in st.spec
    )  # the file's fields name it
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model_type": "no-such-family"}))
    with pytest.raises(
        ValueError,
        match="model_type 'no-such-family' is not a transformers model family; e.g. gpt2",
    ):
        hf_config(str(bad))
    with pytest.raises(ValueError, match="cannot be read"):
        hf_config(str(tmp_path / "missing.json"))


def test_a_saved_config_with_per_layer_types_takes_another_depth(tmp_path):
    """transformers writes ``layer_types`` (one entry per layer) into a Qwen2 config.json; a
    layer count given on top (--model_config, and plan's 1- and 2-block copies) was refused:
    "num_hidden_layers (1) must be equal to the number of layer_types (2)". The list follows
    the count, its pattern kept."""
    from ampkit.models.hf_configs import hf_config
    from ampkit.plan.depth import stack_for

    cfg = transformers.Qwen2Config(**LLAMA_LIKE)
    if not isinstance(getattr(cfg, "layer_types", None), list):
        pytest.skip("this transformers writes no layer_types")
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json_string())
    for n in (1, 2, 5):
        got = hf_config(str(path), {"num_hidden_layers": n})
        assert got.num_hidden_layers == n and got.layer_types == ["full_attention"] * n
    raw = json.loads(path.read_text())
    raw["layer_types"] = ["sliding_attention", "full_attention", "full_attention"]
    raw["sliding_window"] = 16
    path.write_text(json.dumps(raw))
    assert hf_config(str(path), {"num_hidden_layers": 4}).layer_types == [
        "sliding_attention",
        "full_attention",
        "full_attention",
        "sliding_attention",
    ]
    st = stack_for(str(path))
    assert st is not None and st.depth == 3
    assert st.factory(1)().hf.config.layer_types == ["sliding_attention"]


def test_a_saved_model_directory_is_its_config_json(tmp_path):
    """``save_pretrained(DIR)`` writes DIR/config.json; ``--model DIR`` was "neither a built-in
    (gpt, mlp, cnn) nor 'module:factory'", an error that named none of the Hugging Face choices."""
    from ampkit.models.builtin import load_factory
    from ampkit.models.hf_configs import hf_config, is_hf
    from ampkit.plan.depth import stack_for

    transformers.MistralConfig(**LLAMA_LIKE).save_pretrained(tmp_path)
    assert is_hf(str(tmp_path))
    cfg = hf_config(str(tmp_path), {"num_hidden_layers": 2})
    assert type(cfg).__name__ == "MistralConfig" and cfg.intermediate_size == 128
    st = stack_for(str(tmp_path))
    assert st is not None and st.depth == 3 and '"intermediate_size": 128' in st.spec
    empty = tmp_path / "empty"
    empty.mkdir()
    assert not is_hf(str(empty))
    with pytest.raises(ValueError, match=r"llama.*config\.json.*module:factory"):
        load_factory(str(empty))


@pytest.mark.slow
def test_plan_a_config_file_for_a_named_gpu(tmp_path, capsys):
    from ampkit.cli import main

    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "mistral", **LLAMA_LIKE}))
    assert (
        main(
            [
                "plan",
                "--model",
                str(path),
                "--device",
                "a100-40gb",
                "--precisions",
                "bf16,bf16-pure,bf16-pure:stochastic",
                "--batch_size",
                "2",
                "--workers",
                "1",
                "--no_cache",
                "--json",
            ]
        )
        == 0
    )
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == "a100-40gb" and out["model"] == str(path)
    assert [r["method"] for r in out["rows"]] == ["depth", "depth", "depth, rung of bf16-pure"]
    assert all(r["fits"] and r["largest_batch"] >= 2 for r in out["rows"])


@pytest.mark.slow
def test_train_gpt2_on_texts_and_save_the_model(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    from ampkit.cli import main

    texts = tmp_path / "texts.json"
    texts.write_text(json.dumps(TEXTS))
    out_dir = tmp_path / "model"
    argv = [
        "train",
        "--model",
        "gpt2",
        "--model_config",
        SMALL,
        "--data",
        str(texts),
        "--batch_size",
        "3",
        "--epochs",
        "8",
        "--lr",
        "3e-3",
        "--precision",
        "bf16-pure",
        "--device",
        "cpu",
        "--json",
        "--no-progress",
        "--log_dir",
        str(tmp_path / "run"),
        "--save_model",
        str(out_dir),
    ]
    assert main(argv) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["optimizer_steps"] == 8 and s["final_loss"] < s["first_loss"] - 0.5
    assert s["model_path"] == str(out_dir) and not (tmp_path / "model.partial").exists()
    meta = json.loads((out_dir / "ampkit.json").read_text())
    assert meta["format"] == "huggingface" and meta["precision"] == "bf16-pure"
    loaded = AutoModelForCausalLM.from_pretrained(str(out_dir))
    # bf16-pure: the fp32 masters are saved (fp32 tensors, not the bf16 weights rounded back)
    w = loaded.transformer.h[0].mlp.c_fc.weight
    assert w.dtype == torch.float32
    assert not torch.equal(w, w.to(torch.bfloat16).float())
    with pytest.raises(ValueError, match="module:factory brings its own data"):
        from ampkit.cli.common import model_and_data

        model_and_data(
            type(
                "A", (), {"model": "x:y", "data": "t.txt", "block_size": None, "model_config": None}
            )(),
            None,
        )


@pytest.mark.slow
def test_train_builtin_gpt_on_a_text_file(tmp_path, capsys):
    from ampkit.cli import main

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(TEXTS) * 40)
    argv = [
        "train",
        "--model",
        "gpt",
        "--size",
        "tiny",
        "--data",
        str(corpus),
        "--block_size",
        "32",
        "--steps",
        "3",
        "--precision",
        "fp32",
        "--device",
        "cpu",
        "--json",
        "--no-progress",
        "--log_dir",
        str(tmp_path / "r"),
        "--save_model",
        str(tmp_path / "m"),
    ]
    assert main(argv) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["optimizer_steps"] == 3 and s["tokens_per_s"] > 0
    state = torch.load(tmp_path / "m" / "model.pt", weights_only=True)
    assert all(v.dtype == torch.float32 for v in state.values() if v.is_floating_point())
    assert main([*argv[:-2], "--block_size", "999"]) == 2
    assert "exceeds the model's maximum sequence length" in capsys.readouterr().err


@pytest.mark.parametrize(
    "fields, words",
    [
        ("n_layer=abc", ["n_layer='abc'", "an integer", "default is 12"]),
        ("n_embd=1.5", ["n_embd=1.5", "an integer"]),
        ("n_layer=-1", ["n_layer=-1", "at least 1"]),
        ("n_head=0", ["n_head=0", "at least 1"]),
        ("n_layerr=2", ["'n_layerr'", "did you mean 'n_layer'"]),
    ],
)
def test_bad_model_config_values_get_one_clear_error(fields, words):
    """``--model_config`` values are checked like the service's ``model_overrides``: a wrong type
    ended in a huggingface_hub traceback (strict dataclasses), a negative layer count in
    "__len__() should return >= 0", a mistyped field without a suggestion."""
    pytest.importorskip("transformers")
    from ampkit.models.hf_configs import hf_config, parse_overrides

    with pytest.raises(ValueError) as e:
        hf_config("gpt2", parse_overrides(fields))
    for w in words:
        assert w in str(e.value), str(e.value)


def test_a_config_file_with_a_mistyped_field_is_refused(tmp_path):
    """A config.json with ``n_layr`` (for ``n_layer``) was planned and trained as the default 12
    layers without a word (transformers keeps any key as an attribute). A key that is no field of
    the family but is one letter or two from a field is refused, naming the file and the field;
    the other extra keys a saved config carries (``n_ctx``, ``_name_or_path``, ...) still load."""
    from ampkit.models.hf_configs import hf_config

    path = tmp_path / "config.json"
    base = {"model_type": "gpt2", "n_embd": 64, "n_head": 2, "n_ctx": 1024, "_name_or_path": "x"}
    path.write_text(json.dumps({**base, "n_layr": 3}))
    with pytest.raises(ValueError) as e:
        hf_config(str(path))
    msg = str(e.value)
    assert str(path) in msg and "'n_layr'" in msg and "did you mean 'n_layer'" in msg, msg
    assert "--model_config" not in msg, msg  # the key came from the file
    path.write_text(json.dumps({**base, "n_layer": 3}))
    assert hf_config(str(path)).n_layer == 3


def test_a_field_given_twice_in_model_config_is_refused():
    """``--model_config n_layer=2,n_layer=3`` planned 3 layers while the title showed both."""
    from ampkit.models.hf_configs import parse_overrides

    with pytest.raises(ValueError, match="'n_layer' twice"):
        parse_overrides("n_layer=2,n_layer=3")
    assert parse_overrides("n_layer=2, n_embd=64") == {"n_layer": 2, "n_embd": 64}
