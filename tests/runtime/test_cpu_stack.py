"""The compiled layer stack (models/cpu_stack.py, csrc/decode_stack.cpp) is the Python layer loop
bit for bit, both walking the layer program (models/layer_program.py): logits and every K/V it
writes, at decode and verify widths, batches, Qwen2's q/k/v bias, Qwen3's q/k norms, Gemma 3's
sandwich of norms and GeGLU, fp32 and bf16 activations, layers whose formats differ per segment
and that are held interleaved or as the file's rows, Gemma 3's sliding windows and local RoPE; a
layout change rebuilds it; what it cannot run (trees, wider steps, float weights, an op it does not
know) takes the Python loop; generation gives the same tokens."""
import pytest
import torch
from conftest import tiny_config

from ops.test_quant_matmul import random_blocks
from specengine.kernels import cpu_ext
from specengine.layers.norm import RMSNorm
from specengine.models import cpu_stack, layer_program
from specengine.models.config import ModelConfig
from specengine.models.decoder import Transformer
from specengine.models.quant_linear import QuantLinear, quant_layers
from specengine.runtime.runner import ModelRunner

pytestmark = pytest.mark.skipif(not cpu_ext.has("DecodeStack"), reason="needs the compiled extension")

# (format of a projection's first rows, of the rest): a merged qkv keeps a segment per file format
FORMATS = {"qkv_proj": ("Q4_K", "Q6_K"), "o_proj": ("Q5_0", None), "gate_up_proj": ("Q4_K", None),
           "down_proj": ("Q8_0", "Q6_K")}


def quantized_tiny(kind="qwen2", dtype=torch.float32, seed=0, **kw):
    """A tiny random decoder (hidden 256: whole K-quant blocks) whose projections are GGUF blocks."""
    torch.manual_seed(seed)
    if kind == "gemma3":
        kw.setdefault("sliding_window", None)  # windows take the Python loop (a test below)
    cfg = ModelConfig.from_hf(tiny_config(kind, hidden_size=256, intermediate_size=512, head_dim=64, **kw))
    model = Transformer(cfg)
    for i, layer in enumerate(model.layers):
        for norm in (m for m in layer.modules() if isinstance(m, RMSNorm)):  # q/k norms too
            norm.weight.data = 1 + 0.3 * torch.randn_like(norm.weight)
        # random blocks make outputs of ~30: scale the MLP's input so its gates sit where silu and
        # gelu bend (else gelu(x) = x or 0 and an activation's error would not show)
        steps = [name for _, name in layer_program.program_for(cfg)]
        layer.get_submodule(steps[steps.index("mlp.gate_up_proj") - 1]).weight.data *= 0.05
        for parent in (layer.self_attn, layer.mlp):
            for name, (first, rest) in FORMATS.items():
                lin = getattr(parent, name, None)
                if lin is None:
                    continue
                rows, cols = lin.weight.shape
                split = rows if rest is None else rows - 64
                segs = [(first, random_blocks(first, split, cols, seed=100 * i + split))]
                if rest is not None:
                    segs.append((rest, random_blocks(rest, rows - split, cols, seed=100 * i + 7)))
                bias = None if lin.bias is None else torch.randn(rows) * 0.1
                setattr(parent, name, QuantLinear(segs, bias, lin.parts))
    model.lm_head = QuantLinear([("Q8_0", random_blocks("Q8_0", cfg.vocab_size, 256, seed=9))])
    return model.to(dtype).eval()


def runner_for(model, batch=2):
    runner = ModelRunner(model, kernels="auto", cuda_graphs=False, max_batch=batch)
    runner.allocate(batch, 64)
    return runner


def step(model, monkeypatch, tokens, prefix, stacked: bool, tree_mask=None):
    """Logits of one forward of `tokens` [B,T] after a prefill of `prefix` [B,P], and the cache after
    it; stacked=False takes the Python loop. Asserts which path ran."""
    used = []
    real = cpu_stack.run

    def spy(*a):
        out = real(*a) if stacked else None
        used.append(out is not None)
        return out

    monkeypatch.setattr(cpu_stack, "run", spy)
    runner = runner_for(model, tokens.shape[0])
    runner.prefill(prefix, torch.full((prefix.shape[0],), prefix.shape[1]))
    logits = runner.verify(tokens, tree_mask=tree_mask, attn_len=prefix.shape[1] + tokens.shape[1])
    monkeypatch.setattr(cpu_stack, "run", real)
    return logits, runner.cache.kv.clone(), used[-1]


def ids(B, T, seed, vocab):
    return torch.randint(0, vocab, (B, T), generator=torch.Generator().manual_seed(seed))


def assert_stack_is_loop(model, monkeypatch, B, T, prefix_len, seed):
    """One step of T tokens after a prefill of `prefix_len`: the stack ran, and its logits and every
    K/V it wrote equal the Python loop's bit for bit."""
    V = model.config.vocab_size
    prefix, new = ids(B, prefix_len, seed, V), ids(B, T, seed + 1, V)
    got, kv_got, ran = step(model, monkeypatch, new, prefix, stacked=True)
    want, kv_want, python = step(model, monkeypatch, new, prefix, stacked=False)
    assert ran and not python
    assert torch.equal(got, want) and torch.equal(kv_got, kv_want)


@pytest.mark.parametrize("kind", ["qwen2", "qwen3", "llama", "gemma3"])  # qkv bias, q/k norms, neither, sandwich
@pytest.mark.parametrize("B,T", [(1, 1), (2, 1), (1, 5), (2, 16)])
@pytest.mark.parametrize("interleave", [False, True])
@torch.inference_mode()
def test_the_stack_is_the_python_loop_bit_for_bit(monkeypatch, kind, B, T, interleave):
    model = quantized_tiny(kind)
    if interleave:
        for layer in quant_layers(model):
            layer.pack()
        assert any(n is not None for layer in quant_layers(model) for n in layer.packed)
    assert_stack_is_loop(model, monkeypatch, B, T, prefix_len=7, seed=1)


@torch.inference_mode()
def test_bf16_activations_too(monkeypatch):
    model = quantized_tiny("qwen2", torch.bfloat16)
    assert_stack_is_loop(model, monkeypatch, 2, 4, prefix_len=9, seed=3)


@torch.inference_mode()
def test_a_layout_change_rebuilds_the_stack(monkeypatch):
    model = quantized_tiny("qwen2")
    prefix, new = ids(1, 6, 5, model.config.vocab_size), ids(1, 3, 6, model.config.vocab_size)
    before = cpu_stack.stack_for(model)
    assert before is not None and len(before) == model.config.num_layers
    model.layers[1].mlp.gate_up_proj.pack()  # new weight tensors: the old stack must not be used
    assert cpu_stack.stack_for(model) is not before
    got, _, ran = step(model, monkeypatch, new, prefix, stacked=True)
    want, _, _ = step(model, monkeypatch, new, prefix, stacked=False)
    assert ran and torch.equal(got, want)


@torch.inference_mode()
def test_what_the_stack_cannot_run_takes_the_python_loop(monkeypatch):
    model = quantized_tiny("qwen2")
    V = model.config.vocab_size
    _, _, ran = step(model, monkeypatch, ids(1, cpu_stack.MAX_WIDTH + 1, 7, V), ids(1, 4, 8, V), stacked=True)
    assert not ran  # wider than the per-row attention's widths: prefill-like
    tree = torch.tril(torch.ones(1, 3, 3, dtype=torch.bool))
    _, _, ran = step(model, monkeypatch, ids(1, 3, 9, V), ids(1, 4, 8, V), stacked=True, tree_mask=tree)
    assert not ran
    float_layer = quantized_tiny("qwen2")
    float_layer.layers[1].self_attn.o_proj = torch.nn.Linear(256, 256, bias=False)
    float_layer.layers[1].self_attn.o_proj.parts = ()
    assert cpu_stack.build(float_layer) is None
    assert cpu_stack.refusal(float_layer) == "layer 1's self_attn.o_proj are not GGUF blocks the extension multiplies"


@pytest.mark.parametrize("B,T", [(1, 1), (2, 3), (1, 9)])
@torch.inference_mode()
def test_gemma_sliding_windows_and_local_rope_too(monkeypatch, B, T):
    """Gemma 3's local layers read only their window, with their own RoPE base: a 5-token window
    under a 7-token prefix cuts every local layer's reads, and a wrong window, a global RoPE on a
    local layer or the reverse would change the logits."""
    model = quantized_tiny("gemma3", num_hidden_layers=3, sliding_window=5,
                           layer_types=["sliding_attention", "sliding_attention", "full_attention"])
    assert model.windows == [5] and [layer.self_attn.window for layer in model.layers] == [5, 5, None]
    assert_stack_is_loop(model, monkeypatch, B, T, prefix_len=7, seed=11)


@torch.inference_mode()
def test_a_program_with_an_op_the_executor_does_not_know_takes_the_python_loop(monkeypatch):
    model = quantized_tiny("llama")
    assert cpu_stack.build(model) is not None
    unknown = layer_program.LLAMA + (("softcap", None),)
    monkeypatch.setattr(layer_program, "program_for", lambda cfg: unknown)
    assert cpu_stack.build(model) is None
    assert cpu_stack.refusal(model) == "its layer program has ops the compiled executor lacks: softcap"
    with pytest.raises(RuntimeError, match="no op 'softcap'"):
        cpu_ext.EXT.DecodeStack(4, 2, 1e-6, 0.0, 0.125).add_layer(["softcap"], [], [], None, None)
    with pytest.raises(RuntimeError, match="takes 2 norms and 4 projections"):
        cpu_ext.EXT.DecodeStack(4, 2, 1e-6, 0.0, 0.125).add_layer([op for op, _ in layer_program.LLAMA], [], [],
                                                                  None, None)


@torch.inference_mode()
def test_the_plan_says_which_executor_runs_the_layers_and_why():
    model = quantized_tiny("qwen2")
    cpu_ops = ModelRunner(model, kernels="auto", cuda_graphs=False).ops.names
    assert cpu_stack.refusal(model) is None
    assert cpu_stack.describe(model, cpu_ops).startswith("compiled layer stack (csrc/decode_stack.cpp)")
    torch_ops = ModelRunner(model, kernels="torch", cuda_graphs=False).ops.names
    assert cpu_stack.describe(model, torch_ops) == ("Python layer loop: the ops table's add_rms_norm=torch, "
                                                    "rope_kv_write=torch, silu_and_mul=torch, attention=torch "
                                                    "are not the compiled ones")


@torch.inference_mode()
def test_torch_ops_take_the_python_loop(monkeypatch):
    model = quantized_tiny("qwen2")
    runner = ModelRunner(model, kernels="torch", cuda_graphs=False)
    runner.allocate(1, 32)
    calls = []
    real = cpu_stack.run
    monkeypatch.setattr(cpu_stack, "run", lambda *a: calls.append(real(*a)) or calls[-1])
    runner.prefill(ids(1, 4, 1, model.config.vocab_size), torch.tensor([4]))
    runner.verify(ids(1, 2, 2, model.config.vocab_size), attn_len=6)
    assert calls and all(c is None for c in calls)


@torch.inference_mode()
def test_generation_gives_the_python_loops_tokens_and_sd_gives_ar_s(monkeypatch, tokenizer):
    from specengine import Engine

    target, draft = quantized_tiny("qwen2", seed=1), quantized_tiny("qwen2", seed=2)
    eng = Engine(target, tokenizer, draft=draft, cpu_matmul="linear", cuda_graphs=False)
    prompt = "hello there"
    used, real = [], cpu_stack.run
    monkeypatch.setattr(cpu_stack, "run", lambda *a: used.append(real(*a)) or used[-1])
    runs = {m: eng.generate(prompt, max_new_tokens=24, ignore_eos=True, method=m, gamma=3).token_ids
            for m in ("ar", "sd")}
    assert sum(u is not None for u in used) > 24  # the decode and verify steps took the stack
    monkeypatch.setattr(cpu_stack, "run", lambda *a: None)
    python = eng.generate(prompt, max_new_tokens=24, ignore_eos=True, method="ar").token_ids
    assert runs["ar"] == runs["sd"] == python
