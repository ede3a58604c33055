"""One description of a decoder layer, walked by both of its executors.

A layer is a chain of steps over one stream `h`; the residual stream rides beside it and joins
at each fused add-norm (nano-vllm's add_rms_forward). Each step names its op and the submodule
whose weights it takes. Two executors walk the same steps in the same order:

- decoder.py's DecoderLayer, in Python, with the forward's ops table (the torch references,
  Triton, or the "cpu" kernels), any weights, trees and sliding windows;
- csrc/decode_stack.cpp, in C++, with the "cpu" kernels, for GGUF-weight models at decode and
  verify widths, where the Python loop's dispatch would cost as much as a small draft's weights
  (models/cpu_stack.py hands it these steps and decides when it runs).

So the layer's order is written once; a family that needs another order adds a program here,
and the C++ executor either knows every op in it or the model stays on the Python loop.
"""
from __future__ import annotations

from operator import attrgetter

# op -> what it does to h (every op reads h and writes h)
OPS = {
    "add_norm": "h, residual = norm(h + residual), h + residual (residual starts as None)",
    "norm": "h = norm(h)",
    "linear": "h = h @ W.T (+ bias): a merged projection",
    "rope_kv_write": "(q/k norms,) RoPE on q and k of the merged qkv; k and v into the cache; h = q",
    "attention": "h = attention of q over the cache (and the step's tree or window)",
    "silu_and_mul": "h = silu(gate) * up",
    "gelu_tanh_and_mul": "h = gelu_tanh(gate) * up",
    # `fused(program)`'s: one launch each where the ops table has the few-row fused linears (gemv)
    "add_norm_linear": "h, residual = linear(norm(h + residual)), h + residual",
    "silu_and_mul_linear": "h = linear(silu(gate) * up)",
}

LLAMA = (  # Llama, Qwen2, Qwen3, Mistral
    ("add_norm", "input_layernorm"),
    ("linear", "self_attn.qkv_proj"),
    ("rope_kv_write", "self_attn"),
    ("attention", "self_attn"),
    ("linear", "self_attn.o_proj"),
    ("add_norm", "post_attention_layernorm"),
    ("linear", "mlp.gate_up_proj"),
    ("silu_and_mul", None),
    ("linear", "mlp.down_proj"),
)

GEMMA = (  # Gemma 3's sandwich: norms before and after attention and MLP
    ("add_norm", "input_layernorm"),
    ("linear", "self_attn.qkv_proj"),
    ("rope_kv_write", "self_attn"),
    ("attention", "self_attn"),
    ("linear", "self_attn.o_proj"),
    ("norm", "post_attention_layernorm"),
    ("add_norm", "pre_feedforward_layernorm"),
    ("linear", "mlp.gate_up_proj"),
    ("gelu_tanh_and_mul", None),
    ("linear", "mlp.down_proj"),
    ("norm", "post_feedforward_layernorm"),
)

FUSIONS = {("add_norm", "linear"): "add_norm_linear", ("silu_and_mul", "linear"): "silu_and_mul_linear"}


def fused(program) -> tuple:
    """The program with each pair of FUSIONS as one step (its names: both submodules', or the
    linear's alone); only the Python executor walks it, with the ops table's gemv kernels."""
    out, i = [], 0
    while i < len(program):
        pair = (program[i][0], program[i + 1][0]) if i + 1 < len(program) else None
        if pair in FUSIONS:
            names = tuple(n for _, n in program[i:i + 2] if n)
            out.append((FUSIONS[pair], names if len(names) > 1 else names[0]))
            i += 2
        else:
            out.append(program[i])
            i += 1
    return tuple(out)


assert all(op in OPS for program in (LLAMA, GEMMA) for op, _ in program + fused(program))


def program_for(cfg) -> tuple:
    return GEMMA if cfg.gemma else LLAMA


def bind(program, layer) -> list:
    """[(op, the submodule it takes its weights from (a tuple for a fused pair), or None)] of `layer`,
    resolved now (a layer's projections may be swapped after construction, e.g. for GGUF blocks)."""
    def get(name):
        if isinstance(name, tuple):
            return tuple(attrgetter(n)(layer) for n in name)
        return attrgetter(name)(layer) if name else None
    return [(op, get(name)) for op, name in program]
