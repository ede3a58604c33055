"""A GGUF model's decoder layers in one compiled call at decode and verify widths (CPU).

The Python layer loop dispatches ~15 short ops a layer; on a 2-core CPU that is ~5 ms a step,
a third of what a 0.5B draft's weights take to read. `csrc/decode_stack.cpp` walks the same
layer program as decoder.py's loop (layer_program.py: one description of the layer) in C++
(the CPU's counterpart of a CUDA graph), calling the functions the "cpu" ops table calls with
the same arguments, so the result is the Python loop's bit for bit
(tests/runtime/test_cpu_stack.py compares them).

It applies where that equivalence holds: a CPU model whose projections are all GGUF blocks the
extension multiplies (QuantLinear), whose program's ops the executor knows (DecodeStack.OPS),
sliding windows included (Gemma 3); a chain step (no tree) of at most MAX_WIDTH tokens per row; the
compiled ops (attention "cpu" or "cpu-rows": the per-row attention at these widths); outside
any tracing (a trace, e.g. a graph stand-in's make_fx, would record one call's result, not the
ops). Anything else runs the Python loop. The stack is built on first use per model and rebuilt when a layer's layout
changes (QuantLinear.pack_segment) or the model's dtype does.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ..kernels import cpu_ext
from ..kernels.row_attention import ROW_ATTENTION_WIDTH
from . import layer_program, quant_linear
from .quant_linear import EXT_CODES, QuantLinear

MAX_WIDTH = ROW_ATTENTION_WIDTH  # tokens per row: where the "cpu" attention is the per-row one
MAX_ROWS = 64  # B*T: decode and verify steps; a prefill takes the Python loop (same kernels and arithmetic)
_FUSED = {"add_rms_norm": ("cpu",), "rope_kv_write": ("cpu",), "silu_and_mul": ("cpu",),
          "attention": ("cpu", "cpu-rows")}
_STACKS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # model -> (key, DecodeStack | None, why not)
quant_linear.on_layout_change(_STACKS.clear)  # a stale stack would keep the old weights alive


def _segments(layer) -> list | None:
    """DecodeStack's (weight, format code, rows, interleaved) per segment, or None if the layer is
    not one it can run."""
    if not isinstance(layer, QuantLinear) or any(q not in EXT_CODES for q in layer.qtypes):
        return None
    return [(w, EXT_CODES[q], w.shape[0] if n is None else n, n is not None)
            for (q, w), n in zip(layer.stored(), layer.packed)]


class Unfit(Exception):
    """Why a model's layers take the Python loop (`refusal`, engine.plan says it)."""


def build(model):
    """The model's DecodeStack, or None where some layer needs the Python loop (`refusal` says why)."""
    return _built(model)[0]


def _built(model) -> tuple:
    """(the model's DecodeStack, None) or (None, why its layers take the Python loop)."""
    try:
        return _build(model), None
    except Unfit as why:
        return None, str(why)


def _build(model):
    cfg, dtype = model.config, model.dtype
    if not cpu_ext.has("DecodeStack"):
        raise Unfit("the compiled extension is not built")
    if model.device.type != "cpu":
        raise Unfit(f"the model is on {model.device.type}, not a CPU")
    program = layer_program.program_for(cfg)
    lacking = sorted({op for op, _ in program} - set(cpu_ext.EXT.DecodeStack.OPS))
    if lacking:
        raise Unfit(f"its layer program has ops the compiled executor lacks: {', '.join(lacking)}")
    first = model.layers[0]
    eps, attn = first.input_layernorm.eps, first.self_attn
    qk_eps = attn.q_norm.eps if hasattr(attn, "q_norm") else 0.0
    scale = attn.scale if attn.scale is not None else attn.hd ** -0.5
    stack = cpu_ext.EXT.DecodeStack(attn.nh, attn.nkv, eps, qk_eps, scale)
    for i, layer in enumerate(model.layers):
        steps = layer_program.bind(program, layer)
        norms = [m for op, m in steps if op in ("norm", "add_norm")]
        named = [(name, m) for (op, m), (_, name) in zip(steps, program) if op == "linear"]
        linears = [m for _, m in named]
        projections = [_segments(p) for p in linears]
        a = layer.self_attn
        qk = (a.q_norm.weight, a.k_norm.weight) if hasattr(a, "q_norm") else (None, None)
        floats = [name for (name, _), p in zip(named, projections) if p is None]
        if floats:
            raise Unfit(f"layer {i}'s {', '.join(floats)} are not GGUF blocks the extension multiplies")
        if (any(n.eps != eps for n in norms)
                or any(w is not None and w.dtype != dtype for w in [n.weight for n in norms] + list(qk))
                or (qk[0] is not None and a.q_norm.eps != qk_eps)):
            raise Unfit(f"layer {i}'s norms differ in eps or dtype from layer 0's")
        window = -1 if a.window is None else model.windows.index(a.window)  # Gemma 3's local layers
        stack.add_layer([op for op, _ in program], [n.weight for n in norms],
                        [(segs, lin.bias) for segs, lin in zip(projections, linears)], *qk, window)
    return stack


def refusal(model) -> str | None:
    """Why `model`'s layers take the Python loop at every width, or None: the compiled stack runs them
    (read from the cached build, made now if there is none)."""
    stack_for(model)
    return _STACKS[model][2]


def _uncompiled(ops_names):
    """The ops whose implementation in this table the stack does not run (lazily: `run` stops at the
    first, every forward)."""
    return (op for op, ok in _FUSED.items() if ops_names.get(op) not in ok)


def describe(model, ops_names) -> str:
    """What runs `model`'s layers under an ops table with these names (engine.plan)."""
    why = refusal(model)
    other = [f"{op}={ops_names.get(op)}" for op in _uncompiled(ops_names)]
    if why is None and other:
        why = f"the ops table's {', '.join(other)} are not the compiled ones"
    if why is not None:
        return f"Python layer loop: {why}"
    return (f"compiled layer stack (csrc/decode_stack.cpp) for decode and verify steps of up to {MAX_WIDTH} tokens "
            "a row; the Python layer loop for prefill and trees")


def stack_for(model):
    """The cached DecodeStack of `model` (None: it runs the Python loop), rebuilt after a layout change
    (which empties the cache) or a dtype / device change."""
    key = (model.dtype, model.device)
    have = _STACKS.get(model)
    if have is None or have[0] != key:
        have = _STACKS[model] = (key, *_built(model))
    return have[1]


def run(model, x: torch.Tensor, cache, step):
    """(the last layer's MLP output, the residual stream) [B,T,H] from the compiled stack, or None
    where this step must take the Python loop."""
    B, T, _ = x.shape
    if (T > MAX_WIDTH or B * T > MAX_ROWS or step.tree_mask is not None
            or x.device.type != "cpu" or torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None
            or any(_uncompiled(step.ops.names))):
        return None
    stack = stack_for(model)
    if stack is None:
        return None
    attn_len = cache.max_seq_len if step.attn_len is None else step.attn_len
    local = step.rope_local
    windows = [step.windows[w] for w in model.windows] if step.windows else []
    return stack.forward(x, step.rope.cos, step.rope.sin, step.rope.write_pos, cache.kv, cache.lens, attn_len,
                         None if local is None else local.cos, None if local is None else local.sin, windows)
