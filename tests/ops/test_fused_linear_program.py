"""Where the few-row fused linears run (the ops table's `gemv`, kernels/fused_linear.py): the fused
layer program (six launches a layer: test_fused_step.py counts them), `auto` keeping cuBLAS, a model's
tokens with them equal to the reference path's for every method in fp32, its decode logits equal
transformers' for every family, and the steps that keep the unfused program (prefill wider than 16 rows,
CPU-planned weights). The GPU op selection forced on CPU tensors: Triton's interpreter."""
import copy

import pytest
import torch

from specengine import Engine
from specengine.kernels import fused_linear as fl
from specengine.kernels.ops import resolve
from specengine.models import layer_program

pytestmark = pytest.mark.interpreter  # kernels on CPU tensors (conftest.py)
pytest.importorskip("triton")


def test_the_fused_program_pairs_each_norm_and_activation_with_its_linear():
    fused = layer_program.fused(layer_program.LLAMA)
    assert [op for op, _ in fused] == ["add_norm_linear", "rope_kv_write", "attention", "linear",
                                       "add_norm_linear", "silu_and_mul_linear"]
    assert fused[0][1] == ("input_layernorm", "self_attn.qkv_proj") and fused[-1][1] == "mlp.down_proj"
    gemma = layer_program.fused(layer_program.GEMMA)  # GeGLU stays two steps: no kernel fuses gelu
    assert ("gelu_tanh_and_mul", None) in gemma and ("linear", "mlp.down_proj") in gemma


def test_auto_keeps_cublas_until_a_gpu_times_the_kernel():
    assert resolve("auto", "cuda").names["gemv"] == "torch" and not resolve("auto", "cuda").kernel("gemv")
    assert resolve("auto", "cuda").names["attention"] == "triton"  # the others take their kernels
    assert resolve("auto,gemv=triton", "cuda").kernel("gemv")
    assert resolve("auto", "cpu").names["gemv"] == "torch"


CALLS = [dict(method="ar"), dict(method="sd", gamma=3), dict(method="sd", tree="2x3:5"), dict(method="pearl", gamma=2),
         dict(method="sd", gamma=2, temperature=0.8, seed=3)]  # decode, chain and tree verify, draft steps


@pytest.fixture(scope="module")
def engine(tiny_pair, tokenizer):
    """Plain F.linear weights (a CPU engine's matmul plans repack them, and the fused linears read
    only dense row-major weights: a planned layer keeps the unfused path)."""
    target, _, draft = (copy.deepcopy(m) for m in tiny_pair)
    return Engine(target, tokenizer, draft, max_seq_len=256, kernels="torch", cpu_matmul="linear")


@pytest.fixture()
def launched(monkeypatch):
    """The row counts of every fused-linear launch."""
    rows, real = [], fl._launch
    monkeypatch.setattr(fl, "_launch", lambda x2, *a, **k: rows.append(x2.shape[0]) or real(x2, *a, **k))
    return rows


@pytest.mark.parametrize("kw", CALLS, ids=[f"{c['method']}-{c.get('tree', c.get('temperature', ''))}" for c in CALLS])
def test_tokens_with_the_fused_linears_are_the_reference_paths_fp32(engine, launched, kw):
    prompts = ["def add(a, b):\n", "x = [1, 2"]
    engine.set_kernels("torch")
    want = [r.token_ids for r in engine.generate(prompts, max_new_tokens=8, ignore_eos=True, **kw)]
    assert not launched
    engine.set_kernels("torch,gemv=triton")
    try:
        got = [r.token_ids for r in engine.generate(prompts, max_new_tokens=8, ignore_eos=True, **kw)]
    finally:
        engine.set_kernels("torch")
    assert launched  # the kernels ran (both models' steps)
    assert got == want


def test_wide_steps_and_planned_weights_take_the_unfused_path(tiny_pair, launched):
    """A prefill wider than 16 rows never reaches the kernel (which would refuse it); neither does
    a layer whose weight a CPU plan holds."""
    from specengine.models.cpu_matmul import optimize
    from specengine.runtime.runner import ModelRunner

    model = copy.deepcopy(tiny_pair[0])
    runner = ModelRunner(model, "torch,gemv=triton", cuda_graphs=False)
    runner.allocate(1, 64)
    runner.prefill(torch.zeros(1, 20, dtype=torch.int64), torch.tensor([20]))
    assert launched == []
    runner.verify(torch.zeros(1, 3, dtype=torch.int64), attn_len=32)
    assert launched and set(launched) == {3}
    launched.clear()
    optimize(model, progress=False)  # every Linear takes a measured CPU path
    runner.verify(torch.zeros(1, 3, dtype=torch.int64), attn_len=32)
    assert launched == []


@pytest.mark.parametrize("kind,kw", [
    ("qwen2", {"tie_word_embeddings": True}),  # qkv bias, the tied head
    ("qwen3", {"head_dim": 32, "num_key_value_heads": 1}),  # q/k norms inside the RoPE step
    ("gemma3", {"num_hidden_layers": 3, "head_dim": 32, "num_key_value_heads": 1, "sliding_window": 8,
                "query_pre_attn_scalar": 24}),  # sandwich norms; GeGLU keeps its own step
    ("mistral", {"sliding_window": 8}),
])
@torch.inference_mode()
def test_fused_decode_steps_match_transformers_for_every_family(tmp_path, kind, kw):
    """The independent reference: transformers' logits on the same weights, fp32, over 12 decode
    steps of two rows (each a fused step; the 22-row prefill is not)."""
    from conftest import save_tiny

    from specengine.models.loading import load_model
    from specengine.runtime.runner import ModelRunner

    hf = save_tiny(tmp_path, kind, seed=3, **kw)
    biases = [p for name, p in hf.named_parameters() if name.endswith(".bias")]
    if biases:  # transformers starts them at zero: give the fused product's bias something to add
        g = torch.Generator().manual_seed(1)
        for p in biases:
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        hf.save_pretrained(tmp_path)
    ours = ModelRunner(load_model(tmp_path)[0], "torch,gemv=triton", cuda_graphs=False)
    ours.allocate(2, 64)
    ids = torch.randint(0, hf.config.vocab_size, (2, 23), generator=torch.Generator().manual_seed(0))
    ref = hf(ids).logits
    prompt = 11
    ours.prefill(ids[:, :prompt], torch.tensor([prompt, prompt]))
    ours.cache.set_lens(torch.tensor([prompt, prompt], dtype=torch.int32))
    for step in range(12):
        logits = ours.decode(ids[:, prompt + step])
        ours.cache.set_lens(ours.cache.lens + 1)
        assert (logits - ref[:, prompt + step]).abs().max() <= 1e-4, f"step {step}"
