"""On a GPU: `Engine.warmup()`'s timed choice between cuBLAS and the fused few-row linears with its
real timer (graphed steps on runners of its own), then the engine's tokens against one that names
cuBLAS. Needs CUDA (`make gpu-check` runs it there); the choice's logic is tested on CPU in
test_kernel_choice.py."""
import copy

import pytest
import torch

from specengine import Engine

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_the_timed_choice_on_a_gpu_leaves_the_tokens(tiny_pair, tokenizer):
    prompts = ["def add(a, b):\n", "x = [1, 2"]
    models = lambda: (copy.deepcopy(tiny_pair[0]).cuda(), tokenizer, copy.deepcopy(tiny_pair[2]).cuda())  # noqa: E731
    ref = Engine(*models(), max_seq_len=256, kernels="auto,gemv=torch")
    engine = Engine(*models(), max_seq_len=256, kernels="auto")
    engine.warmup()
    assert set(engine.kernel_choice) == {"target", "draft"}
    for role, runner in (("target", engine.target), ("draft", engine.draft)):
        c = engine.kernel_choice[role]
        assert all(ms > 0 for ms in c["ms"].values()) and runner.ops.names["gemv"] == c["chosen"]
    for kw in (dict(method="ar"), dict(method="sd", gamma=3)):
        want = [r.token_ids for r in ref.generate(prompts, max_new_tokens=8, ignore_eos=True, **kw)]
        assert [r.token_ids for r in engine.generate(prompts, max_new_tokens=8, ignore_eos=True, **kw)] == want
