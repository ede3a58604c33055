"""The families beyond Llama 2 / Qwen2 / Mistral, end to end on tiny random models: `ar`
equals transformers' greedy generate, and every speculative method equals `ar` (fp32), for
Llama 3.x (llama3 RoPE scaling, tied head), Qwen3 (q/k norm, no bias, explicit head_dim) and
Gemma 3 (sliding windows far shorter than the text, GeGLU, sandwich norms).
Their logits against transformers: tests/runtime/test_model_vs_hf.py."""
import pytest
import torch
from conftest import save_tiny
from helpers.every_method import every_method, generate_tokens

from specengine import Engine

PROMPTS = ["def add(a, b):\n", "x = [1, 2"]
FAMILIES = {
    "llama3": ("llama", dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
                             rope_theta=500000.0, tie_word_embeddings=True)),
    "qwen3": ("qwen3", dict(head_dim=32, num_key_value_heads=1)),
    # 8-token windows: prompts + 30 new tokens run far past them, in every verify and tree
    "gemma3": ("gemma3", dict(num_hidden_layers=6, head_dim=32, num_key_value_heads=1, sliding_window=8)),
    "mistral-window": ("mistral", dict(sliding_window=8)),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(HF model, our engine with a perturbed copy of the target as its draft)."""
    kind, kw = FAMILIES[request.param]
    tdir, ddir = tmp_path_factory.mktemp(request.param), tmp_path_factory.mktemp(request.param + "_draft")
    hf = save_tiny(tdir, kind, seed=7, scale=4.0, **kw)
    draft = save_tiny(ddir, kind, seed=7, scale=4.0, **kw)
    with torch.no_grad():  # some drafts rejected
        for p in draft.parameters():
            p.add_(torch.randn_like(p) * 0.05 * p.abs().mean())
    draft.save_pretrained(ddir)
    eng = Engine.from_pretrained(str(tdir), draft=str(ddir), max_seq_len=128, dtype="float32")
    ar = [r.token_ids for r in eng.generate(PROMPTS, max_new_tokens=30, method="ar", ignore_eos=True)]
    return hf.eval(), eng, ar


def test_ar_equals_transformers_generate(family):
    hf, eng, ar = family
    hf.generation_config.eos_token_id = None
    for prompt, ours in zip(PROMPTS, ar):
        ids = torch.tensor([eng.encode(prompt)[0][0]])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=30, pad_token_id=0)
        assert ref[0, ids.shape[1]:].tolist() == ours


@every_method
def test_every_method_equals_ar(family, kw):
    _, eng, ar = family
    tokens, accepted = generate_tokens(eng, PROMPTS, kw)
    assert tokens == ar and accepted > 0
