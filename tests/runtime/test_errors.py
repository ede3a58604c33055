"""Bad input gives one clear error that names the problem, from the API and from the CLI."""
import json

import pytest
import torch
from conftest import save_tiny

from specengine import Engine, SpecEngineError
from specengine.cli import main


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), max_seq_len=64, dtype="float32")


@pytest.mark.parametrize("kw,match", [
    (dict(prompt=""), "prompt is empty"),
    (dict(prompt=[]), "prompt is empty"),
    (dict(prompt="a" * 80), "exceeds max_seq_len|cache holds"),
    (dict(prompt="a" * 30, max_new_tokens=40), "exceeds max_seq_len"),
    (dict(prompt=[1, 2, 10_000]), "outside the vocabulary"),
    (dict(prompt=3.5), "unsupported prompt type"),
    (dict(prompt=[{"content": "x"}]), "'role' and 'content'"),
    (dict(prompt="a", temperature=-1.0), "temperature"),
    (dict(prompt="a", temperature=float("nan")), "temperature"),
    (dict(prompt="a", top_p=0.0), "top_p"),
    (dict(prompt="a", top_k=-2), "top_k"),
    (dict(prompt="a", seed=-1), "seed"),
    (dict(prompt="a", max_new_tokens=0), "max_new_tokens"),
    (dict(prompt="a", method="beam"), "unknown method"),
    (dict(prompt="a", gamma=0), "gamma"),
    (dict(prompt="a", method="pearl", gamma=0), "pearl window gamma"),
    (dict(prompt="a", policy="magic"), "unknown draft-length policy"),
    (dict(prompt="a", stop=[""]), "stop strings"),
])
def test_api_errors(engine, kw, match):
    with pytest.raises(SpecEngineError, match=match):
        engine.generate(max_new_tokens=kw.pop("max_new_tokens", 4), **kw)


def test_sd_without_draft(tiny_dir):
    with pytest.raises(SpecEngineError, match="needs a draft model"):
        Engine.from_pretrained(str(tiny_dir), method="sd")


def test_a_draft_with_more_ids_than_its_target_is_refused(tiny_dir, tmp_path):
    save_tiny(tmp_path, "llama", vocab=100)
    with pytest.raises(SpecEngineError, match=r"draft's vocabulary \(100 ids\) is larger than the target's \(67\)"):
        Engine.from_pretrained(str(tiny_dir), draft=str(tmp_path))


def test_missing_and_unsupported_models(tmp_path):
    with pytest.raises(SpecEngineError, match="model not found"):
        Engine.from_pretrained(str(tmp_path / "nope"))
    with pytest.raises(SpecEngineError, match="no config.json"):
        Engine.from_pretrained(str(tmp_path))
    with pytest.raises(SpecEngineError, match="not in the local Hugging Face cache"):
        Engine.from_pretrained("no-such-org/no-such-model")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "vocab_size": 10}))
    with pytest.raises(SpecEngineError, match="unsupported model type 'gpt2'"):
        Engine.from_pretrained(str(tmp_path))
    other = tmp_path / "noweights"
    save_tiny(other, "llama")
    for f in other.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(SpecEngineError, match="no \\*.safetensors"):
        Engine.from_pretrained(str(other))
    with pytest.raises(SpecEngineError, match="GGUF file not found|model not found"):
        Engine.from_pretrained(str(tmp_path / "missing.gguf"))


def test_bad_dtype_and_device(tiny_dir):
    with pytest.raises(SpecEngineError, match="unknown dtype"):
        Engine.from_pretrained(str(tiny_dir), dtype="float8")
    with pytest.raises(SpecEngineError, match="max_seq_len"):
        Engine.from_pretrained(str(tiny_dir), max_seq_len=1)


@pytest.mark.parametrize("argv,match", [
    (["generate", "--prompt", "", "--max-new-tokens", "2"], "prompt is empty"),
    (["generate", "--prompt", "a", "--temperature", "-1"], "temperature"),
    (["generate", "--prompt", "a", "--method", "sd"], "needs a draft model"),
    (["generate", "--prompt", "a", "--max-seq-len", "8", "--max-new-tokens", "50"], "exceeds max_seq_len"),
    (["bench", "--providers", "sd:x"], "bad provider"),
    (["generate", "--prompt", "a", "--logprobs", "2"], "printed with --json"),
])
def test_cli_errors_are_one_line(tiny_dir, capsys, argv, match):
    assert main([argv[0], "--target", str(tiny_dir), *argv[1:]]) == 2
    err = capsys.readouterr().err.strip()
    # a first load's progress bar may come first (it clears itself with \r: what a terminal shows is the last)
    shown = err.split("\r")[-1]
    assert shown.startswith("error: ") and "\n" not in err and "Traceback" not in err
    assert __import__("re").search(match, shown)


def test_cli_missing_model(capsys, tmp_path):
    assert main(["generate", "--target", str(tmp_path / "missing"), "--prompt", "a"]) == 2
    assert "model not found" in capsys.readouterr().err


def test_cli_generate_json(tiny_dir, capsys):
    assert main(["generate", "--target", str(tiny_dir), "--draft", str(tiny_dir), "--prompt", "ab",
                 "--max-new-tokens", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["method"] == "sd" and len(out["token_ids"]) <= 6


def test_cli_generate_json_logprobs(tiny_dir, capsys):
    assert main(["generate", "--target", str(tiny_dir), "--prompt", "abc", "--max-new-tokens", "4", "--ignore-eos",
                 "--json", "--logprobs", "2", "--prompt-logprobs"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [e["token_id"] for e in out["logprobs"]] == out["token_ids"] and len(out["logprobs"][0]["top"]) == 2
    assert out["prompt_logprobs"][0] is None and out["prompt_logprobs"][1]["logprob"] <= 0


def test_cli_generate_pearl(tiny_dir, capsys):
    assert main(["generate", "--target", str(tiny_dir), "--draft", str(tiny_dir), "--method", "pearl",
                 "--gamma", "3", "--prompt", "ab", "--max-new-tokens", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["stats"]["method"] == "pearl" and out["stats"]["gamma"] == 3


def test_cli_generate_streams(tiny_dir, capsys):
    assert main(["generate", "--target", str(tiny_dir), "--prompt", "ab", "--max-new-tokens", "6"]) == 0
    captured = capsys.readouterr()
    assert "tokens_per_s=" in captured.err


def test_loads_from_the_local_hub_cache(tmp_path, monkeypatch):
    """A hub id resolves through the local Hugging Face cache, never the network."""
    snap = tmp_path / "models--tiny-org--tiny-llama" / "snapshots" / ("0" * 40)
    save_tiny(snap, "llama", seed=9)
    (tmp_path / "models--tiny-org--tiny-llama" / "refs").mkdir()
    (tmp_path / "models--tiny-org--tiny-llama" / "refs" / "main").write_text("0" * 40)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as c

    monkeypatch.setattr(c, "HF_HUB_CACHE", str(tmp_path))
    from specengine.models.loading import resolve

    assert resolve("tiny-org/tiny-llama") == snap
    assert Engine.from_pretrained("tiny-org/tiny-llama").generate("ab", max_new_tokens=3).token_ids


@pytest.mark.parametrize("edit,match", [
    ("drop k_proj", r"lacks parts of 1 merged projections, e.g. \['layers.0.self_attn.qkv_proj.weight'\]"),
    ("cut up_proj", r"model.layers.1.mlp.up_proj.weight in .* has shape \(3, .*expects"),
    ("drop a norm", r"lacks 1 weights, e.g. \['layers.0.input_layernorm.weight'\]"),
    ("add a stray", r"weights this architecture does not use, e.g. \['layers.0.mlp.stray.weight'\]"),
])
def test_a_checkpoint_that_misses_or_misshapes_a_weight_is_named(tiny_dir, tmp_path, edit, match):
    """The loader copies q/k/v and gate/up straight into their merged tensors' rows: a part that is
    missing or of another shape is named, never left as uninitialized rows."""
    import shutil

    from safetensors.torch import load_file, save_file

    from specengine.models.loading import load_model

    bad = tmp_path / "bad"
    shutil.copytree(tiny_dir, bad)
    (f,) = bad.glob("*.safetensors")
    state = load_file(f)
    if edit == "drop k_proj":
        del state["model.layers.0.self_attn.k_proj.weight"]
    elif edit == "cut up_proj":
        state["model.layers.1.mlp.up_proj.weight"] = state["model.layers.1.mlp.up_proj.weight"][:3].clone()
    elif edit == "drop a norm":
        del state["model.layers.0.input_layernorm.weight"]
    else:
        state["model.layers.0.mlp.stray.weight"] = torch.zeros(2, 2)
    save_file(state, f, metadata={"format": "pt"})
    with pytest.raises(SpecEngineError, match=match):
        load_model(bad)
