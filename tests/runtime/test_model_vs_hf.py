"""Our decoder's logits equal transformers' on the same weights (fp32, prefill + decode), for
every family: Llama 2 / 3.x, Qwen2, Qwen3, Mistral, Gemma 3 (sliding windows included: Gemma 3's,
Mistral's, Qwen2's)."""
import pytest
import torch
from conftest import save_tiny

from specengine.models.loading import load_model
from specengine.runtime.runner import ModelRunner


@pytest.mark.parametrize("kind,kw", [
    ("llama", {}),
    ("llama", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    ("qwen2", {"tie_word_embeddings": True}),
    ("mistral", {"num_key_value_heads": 1}),
    ("llama", {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}),
    # Llama 3.x: its RoPE scaling (frequencies past the original context stretched) and a tied head
    ("llama", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 16}, "rope_theta": 500000.0,
               "tie_word_embeddings": True}),
    # Qwen3: q/k RMSNorm per head, no qkv bias, a head_dim that is not hidden / heads
    ("qwen3", {}),
    ("qwen3", {"head_dim": 32, "tie_word_embeddings": True, "num_key_value_heads": 1}),
    # Gemma 3: GeGLU, scaled embeddings, (1 + w) sandwich norms, q/k norm, query_pre_attn_scalar, and
    # 5 local layers of 8-token windows (their own RoPE base) per global one: windows far shorter than the
    # 31 positions read here
    ("gemma3", {"num_hidden_layers": 6, "head_dim": 32, "num_key_value_heads": 1, "sliding_window": 8,
                "query_pre_attn_scalar": 24}),
    # Mistral's window on every layer; Qwen2's on the layers from max_window_layers on
    ("mistral", {"sliding_window": 8}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
])
@torch.inference_mode()
def test_prefill_and_20_decode_steps_match_transformers(tmp_path, kind, kw):
    hf = save_tiny(tmp_path, kind, seed=3, **kw)
    ours = ModelRunner(load_model(tmp_path)[0])
    ours.allocate(2, 128)
    ids = torch.randint(0, hf.config.vocab_size, (2, 31), generator=torch.Generator().manual_seed(0))
    ref = hf(ids).logits  # full causal forward over prompt + continuation
    prompt = 11
    last = ours.prefill(ids[:, :prompt], torch.tensor([prompt, prompt]))
    assert (last - ref[:, prompt - 1]).abs().max() <= 1e-4
    ours.cache.set_lens(torch.tensor([prompt, prompt], dtype=torch.int32))
    for step in range(20):
        logits = ours.decode(ids[:, prompt + step])
        ours.cache.set_lens(ours.cache.lens + 1)
        assert (logits - ref[:, prompt + step]).abs().max() <= 1e-4, f"step {step}"


@torch.inference_mode()
def test_sharded_checkpoint_and_ragged_prefill(tmp_path):
    hf = save_tiny(tmp_path, "qwen2", seed=4, shard="20KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ours = ModelRunner(load_model(tmp_path)[0])
    ours.allocate(3, 64)
    lens = [9, 4, 1]
    rows = [torch.randint(0, hf.config.vocab_size, (n,), generator=torch.Generator().manual_seed(n)) for n in lens]
    padded = torch.zeros(3, 9, dtype=torch.long)
    for b, r in enumerate(rows):
        padded[b, : len(r)] = r
    last = ours.prefill(padded, torch.tensor(lens))
    for b, r in enumerate(rows):
        assert (last[b] - hf(r[None]).logits[0, -1]).abs().max() <= 1e-4


@torch.inference_mode()
def test_verify_with_tree_mask_equals_causal_path(tmp_path):
    """Every tree node's logits equal a plain causal forward over its root-to-node path."""
    hf = save_tiny(tmp_path, "llama", seed=5)
    ours = ModelRunner(load_model(tmp_path)[0])
    ours.allocate(1, 64)
    prefix = torch.randint(0, hf.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1))
    ours.prefill(prefix, torch.tensor([6]))
    parent = [-1, 0, 0, 1, 1, 2, 4]  # a 7-node tree
    nodes = torch.randint(0, hf.config.vocab_size, (1, 7), generator=torch.Generator().manual_seed(2))
    mask = torch.zeros(1, 7, 7, dtype=torch.bool)
    for i in range(7):
        j = i
        while j >= 0:
            mask[0, i, j] = True
            j = parent[j]
    logits = ours.verify(nodes, tree_mask=mask)
    for i in range(7):
        path = [j for j in range(7) if mask[0, i, j]]
        ref = hf(torch.cat([prefix, nodes[:, path]], 1)).logits[0, -1]
        assert (logits[0, i] - ref).abs().max() <= 1e-4, f"node {i}"


def test_loaded_weights_are_the_process_own_and_read_in_chunks(tmp_path, monkeypatch):
    """The loader copies every tensor off the file's mapping (a weight left on it pins the whole
    mapping resident: a repacked weight was held twice, 15.5 GiB for the real fp32 pair against
    10.7 after) and opens the file per chunk: overwriting the file after the load changes no
    weight, and chunks far smaller than the file still load every tensor."""
    from specengine.models import loading

    save_tiny(tmp_path, "qwen2", seed=3)
    monkeypatch.setattr(loading, "CHUNK_BYTES", 4096)
    f, = tmp_path.glob("*.safetensors")
    assert len(loading._chunks(f)) > 3
    model = load_model(tmp_path)[0]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    size = f.stat().st_size
    with open(f, "r+b") as fh:  # the header stays; every tensor byte becomes zero
        head = 8 + int.from_bytes(fh.read(8), "little")
        fh.seek(head)
        fh.write(bytes(size - head))
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
