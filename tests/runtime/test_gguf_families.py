"""GGUF files of the newer families load with their weights kept as blocks: a tiny Qwen3 and a
tiny Gemma 3 written with the `gguf` package under llama.cpp's tensor names (q/k norms and
Gemma's sandwich norms, stored as 1 + w, included), Q8_0
blocks for every matrix, gives the float model's logits within the int8 rounding of its
activations, and far from them without the q/k norms."""
import numpy as np
import pytest
import torch
from conftest import save_tiny

from specengine import SpecEngineError
from specengine.models.config import ModelConfig
from specengine.models.decoder import Transformer
from specengine.models.gguf_weights import load_quantized
from specengine.models.loading import load_model
from specengine.runtime.runner import ModelRunner
from helpers.gguf_files import write_gguf
from helpers.cache import fresh_cache

gguf = pytest.importorskip("gguf")

def logits(model, ids):
    runner = ModelRunner(model, kernels="torch")
    runner.allocate(1, 64)
    return runner.prefill(ids, torch.tensor([ids.shape[1]]))


@pytest.mark.parametrize("kind,kw", [("qwen3", dict(tie_word_embeddings=False)), ("qwen3", dict(tie_word_embeddings=True)),
                                     ("gemma3", dict(num_hidden_layers=3, sliding_window=4))])
@torch.inference_mode()
def test_a_gguf_of_a_newer_family_loads_as_blocks_and_matches_the_float_model(tmp_path, kind, kw):
    hf = save_tiny(tmp_path, kind, seed=11, head_dim=32, **kw)
    write_gguf(hf, tmp_path / "m.gguf", kind)
    write_gguf(hf, tmp_path / "no_norm.gguf", kind, skip=("attn_q_norm", "attn_k_norm"))
    cfg = ModelConfig.from_hf(hf.config)
    with torch.device("meta"):
        skeleton = Transformer(cfg)
    quant = load_quantized(skeleton, tmp_path / "m.gguf", torch.float32)
    assert type(quant.layers[0].self_attn.qkv_proj).__name__ == "QuantLinear"
    ids = torch.randint(0, cfg.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    ref, got = logits(load_model(tmp_path)[0], ids), logits(quant, ids)
    err = (got - ref).abs().max() / ref.abs().max()
    # Q8_0 weights and int8 activations: each about 1-2% of the logits' range (tiny Gemma 3: 1.9% + 2.0%);
    # a norm read without Gemma's 1 + w, or a missing one, moves them by their whole size
    assert err < 0.06, err
    with torch.device("meta"):
        skeleton = Transformer(cfg)
    with pytest.raises(SpecEngineError, match=f"no_norm.gguf .{kind}. has no tensor 'blk.0.attn_q_norm.weight'"):
        load_quantized(skeleton, tmp_path / "no_norm.gguf", torch.float32)  # refused, never run without them


def test_tensors_read_through_the_cached_index_are_the_gguf_packages(tmp_path, monkeypatch):
    """A load reads tensors where our header walk (gguf_weights._read_index) finds them: every tensor
    the same bytes, format and shape as the `gguf` package's GGUFReader, and a second load never parses."""
    from specengine.models import gguf_weights

    fresh_cache(monkeypatch, tmp_path / "cache")
    path = tiny_qwen3_gguf(tmp_path, layers=2)
    reader = gguf.GGUFReader(path)
    ours = gguf_weights._Tensors(path)
    for t in reader.tensors:
        kind, data = ours.get(t.name)
        assert kind == t.tensor_type.name
        assert np.array_equal(data.numpy().reshape(-1).view(np.uint8), np.asarray(t.data).reshape(-1).view(np.uint8))
    (tmp_path / "not.gguf").write_bytes(b"GGML" + bytes(64))
    with pytest.raises(SpecEngineError, match="not a GGUF file"):
        gguf_weights.tensor_index(tmp_path / "not.gguf")
    monkeypatch.setattr(gguf_weights, "_read_index", lambda *a: pytest.fail("parsed the file again"))
    assert set(gguf_weights._Tensors(path).by_name) == {t.name for t in reader.tensors}


def test_a_load_reads_the_files_pages_in_place_and_never_writes_the_file(tmp_path):
    """Tensors are views of the file's copy-on-write mapping, not copies (a copy of every weight's
    bytes had cost a 1.6 GB load ~7 s of fresh-page faults on the 2-vCPU EPYC VM); a write into a
    loaded tensor changes the process's copy only, never the file other loads read."""
    from specengine.models import gguf_weights

    path = tiny_qwen3_gguf(tmp_path, layers=1)
    before = path.read_bytes()
    src = gguf_weights._Tensors(path)
    _, norm = src.get("output_norm.weight")
    mapped = src._bytes.ctypes.data
    assert mapped <= norm.data_ptr() < mapped + len(before)  # in place: no copy made
    norm.add_(1.0)
    _, again = src.get("output_norm.weight")
    assert torch.equal(again, norm)  # the process sees its write ...
    assert path.read_bytes() == before  # ... the file does not


def AutoModelForCausalLM_from(config):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config).eval()


def tiny_qwen3_gguf(tmp_path, layers: int):
    """A tiny random Qwen3 written as a GGUF file (Q8_0 matrices) -> its path."""
    from transformers import Qwen3Config

    torch.manual_seed(0)
    hf = AutoModelForCausalLM_from(Qwen3Config(vocab_size=96, hidden_size=64, intermediate_size=96,
                                              num_hidden_layers=layers, num_attention_heads=4,
                                              num_key_value_heads=2, head_dim=16))
    path = tmp_path / "tiny.gguf"
    write_gguf(hf, path, "qwen3")
    return path
