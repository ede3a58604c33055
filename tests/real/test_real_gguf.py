"""The default real pair's GGUF files (Qwen2.5-Coder 1.5B / 0.5B) kept as GGUF blocks: lossless for
every method, about the files' size in memory, close to the float model dequantized from the same
file. The small GGUF's tests (SmolLM2-135M: conversion, the blocks' measured choice, no float copy
written unless asked for) are in tests/runtime/test_real_smollm2.py, on the slow tier's light worker."""
import pytest
import torch

from helpers.real import HUGE_PAGES_IN_TESTS
from specengine import Engine
from specengine.models.fetch import cache_dir
from specengine.models.loading import load_model
from specengine.runtime.runner import ModelRunner

pytestmark = [pytest.mark.real, pytest.mark.slow]


# (the dequantizer check on every tensor of these files: tests/ops/test_real_dequantizer.py)
REAL_FILES = ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"]


def test_the_quantized_pair_is_lossless_small_and_close_to_the_float_model():
    """weights='gguf' on the real pair: every method gives the quantized target's own ar tokens
    (fp32 activations, greedy; batch-invariant mode on, as "auto" turns it on for blocks), the models hold about the files' bytes, and the quantized target
    stays close to the float model dequantized from the same file."""
    import os

    target, draft = REAL_FILES[:2]
    eng = Engine.from_pretrained(target, draft=draft, weights="gguf", max_seq_len=256, cpu_matmul="linear",
                                 huge_pages=HUGE_PAGES_IN_TESTS)
    files = sum(os.path.getsize(cache_dir() / "gguf" / f"{n}.gguf") for n in (target, draft))
    held = sum(b.numel() * b.element_size() for r in (eng.target, eng.draft)
               for b in list(r.model.buffers()) + list(r.model.parameters()))
    assert held <= 1.3 * files, (held, files)
    prompt = "def fibonacci(n):\n"
    ar = eng.generate(prompt, max_new_tokens=16, method="ar", ignore_eos=True).token_ids
    for method, kw in [("sd", {"gamma": 3}), ("sd", {"gamma": "auto"}), ("pearl", {}),
                       ("sd", {"policy": "specdec++", "gamma": 8}),  # the heads and drafter shipped for the
                       ("parallelspec", {"gamma": 3}), ("pearl", {"policy": "parallel"}),  # float draft fit its blocks
                       ("sd", {"tree": "3x3"})]:
        assert eng.generate(prompt, max_new_tokens=16, method=method, ignore_eos=True, **kw).token_ids == ar, method
    text = prompt + "".join(f"    # step {i}: add the two previous numbers\n" for i in range(6)) + "    return n\n"
    ids = torch.tensor([eng.tokenizer(text).input_ids])
    assert ids.shape[1] >= 60
    with torch.inference_mode():
        quant = ModelRunner(eng.target.model, cuda_graphs=False)
        dense = ModelRunner(load_model(target)[0], cuda_graphs=False)
        out = []
        for r in (quant, dense):
            r.allocate(1, 128)
            out.append(r.verify(ids))
    # the file's own `output` (Q6_K) against the float model's tied embedding (Q4_K): close, not equal
    assert (out[0].argmax(-1) == out[1].argmax(-1)).float().mean() >= 0.8
