"""A lean Llama-family decoder (Llama, Qwen2, Qwen3, Mistral, Gemma 3) over a static KV buffer.

Parameter names mirror transformers' (minus the `model.` prefix), except that q/k/v and
gate/up are merged into one projection each (`qkv_proj`, `gate_up_proj`: one GEMM instead
of three or two); `merged_homes` maps a checkpoint's HF names onto their rows. Each op
comes from the forward's ops table (kernels/ops.py: the torch reference or the Triton
kernel, as the engine's `kernels` option chose; the runner passes it), in the order the layer
program says (layer_program.py; csrc/decode_stack.cpp walks the same program in C++).
Every entry point writes the new tokens' K/V at `cache.lens[b] + j` and
returns logits; the caller decides what to commit and sets `cache.lens` (rollback is
lowering it). Nothing here syncs with the host.
"""
from __future__ import annotations

from dataclasses import dataclass
import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_stack, layer_program
from .config import ModelConfig
from ..kernels import fused_linear
from ..kernels.ops import TORCH, Ops
from ..layers.norm import RMSNorm
from ..layers.rotary import StepRope


class Linear(nn.Linear):
    """nn.Linear whose CPU matmul path per row count is chosen by measurement.

    `use(plan)` (the planner's cpu_matmul.Plan: a path per row count 1..16, one for larger
    inputs, and the weight's storage) may move the weight into oneDNN's packed layout
    (`packed_weight`, with `weight` then None); `plain()` undoes it. Without a plan (GPU, or
    not tuned) this is plain F.linear. `parts`: for a merged projection, the checkpoint's
    projections it stacks (name, rows), in order (the loader merges them; the parallel
    drafter adapts each part).
    """
    plan = plan_fns = packed_weight = None
    parts: tuple[tuple[str, int], ...] = ()

    def use(self, plan) -> None:
        """Multiply along `plan`, packing (or unpacking) the weight to its storage: one copy of
        the weight in memory, never two."""
        if plan.pack is None:
            self.plain()
        elif self.packed_weight is None:
            self.packed_weight, self.weight = plan.pack(self.weight.detach()), None
        self.plan, self.plan_fns = plan, plan.fns()

    def plain(self) -> None:
        """Back to the plain weight and F.linear (before a move to a GPU, or a head re-cut)."""
        if self.packed_weight is not None:
            self.weight = nn.Parameter(self.packed_weight.to_dense(), requires_grad=False)
            self.packed_weight = None
        self.plan = self.plan_fns = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.plan_fns is None:
            return F.linear(x, self.weight, self.bias)
        by_rows, large = self.plan_fns
        rows = x.numel() // x.shape[-1]
        fn = by_rows[rows] if rows < len(by_rows) else large
        w = self.weight if self.packed_weight is None else self.packed_weight
        y = fn(x.reshape(rows, x.shape[-1]).contiguous(), w)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def __deepcopy__(self, memo):
        """A copy with plain weights and no plan (oneDNN's packed tensor cannot be deep-copied;
        the copy is re-planned where an engine takes it)."""
        import copy

        clone = copy.copy(self)
        memo[id(self)] = clone
        skip = ("packed_weight", "plan", "plan_fns")
        clone.__dict__ = copy.deepcopy({k: v for k, v in self.__dict__.items() if k not in skip}, memo)
        if self.packed_weight is not None:
            clone.weight = nn.Parameter(self.packed_weight.to_dense(), requires_grad=False)
        clone.packed_weight = clone.plan = clone.plan_fns = None
        return clone


def merged_linear(in_features: int, parts: dict[str, int], bias: bool) -> Linear:
    layer = Linear(in_features, sum(parts.values()), bias=bias)
    layer.parts = tuple(parts.items())
    return layer


@dataclass
class Step:
    """What every layer of one forward shares, computed once per forward."""
    rope: StepRope
    tree_mask: torch.Tensor | None
    attn_len: int | None
    ops: Ops
    rope_local: StepRope | None = None  # sliding-window layers' own RoPE (Gemma 3), when it differs
    windows: dict | None = None  # window -> [B,T] first position each token sees
    gemv: bool = False  # the few-row linears fused with their inputs (the ops table's gemv; kernels/fused_linear.py)


def fusable(linear) -> bool:
    """Whether a projection is a dense nn.Linear weight that the fused linears can read (not GGUF
    blocks, not a CPU plan's packed weight)."""
    return isinstance(linear, nn.Linear) and getattr(linear, "plan_fns", None) is None and linear.weight is not None


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU (Gemma): gelu_tanh(gate) * up, in the input dtype, transformers' roundings."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class Attention(nn.Module):
    """The attention's weights and its two steps of the layer program (layer_program.py)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window = cfg.layer_windows[layer] if cfg.layer_windows else None
        self.scale = cfg.attn_scale
        q, kv = self.nh * self.hd, self.nkv * self.hd
        self.qkv_proj = merged_linear(cfg.hidden_size, {"q_proj": q, "k_proj": kv, "v_proj": kv}, cfg.qkv_bias)
        self.o_proj = Linear(q, cfg.hidden_size, bias=False)
        if cfg.qk_norm:  # Qwen3: per-head RMSNorm of q and k, done inside the RoPE + KV-write op
            self.q_norm, self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps), RMSNorm(self.hd, cfg.rms_norm_eps)

    def qk_norm(self):
        """(q weight, k weight, eps) for the rope_kv_write op, or None."""
        return (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if hasattr(self, "q_norm") else None

    def rope_kv_write(self, qkv, layer_idx, cache, step: Step):
        """The rotated q of the merged projection; k and v go into the cache."""
        rope = step.rope_local if self.window is not None and step.rope_local is not None else step.rope
        return cache.store(layer_idx, qkv, rope, self.nh, self.nkv, step.ops.rope_kv_write, self.qk_norm())

    def attention(self, q, layer_idx, cache, step: Step):
        B, T = q.shape[:2]
        k_all, v_all = cache.layer(layer_idx, step.attn_len)
        window = step.windows[self.window] if self.window is not None else None
        out = step.ops.attention(q, k_all, v_all, cache.lens, step.tree_mask, sm_scale=self.scale, window=window)
        return out.reshape(B, T, self.nh * self.hd)


class MLP(nn.Module):
    """The MLP's weights (its steps: layer_program.py)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = merged_linear(cfg.hidden_size, {"gate_proj": inter, "up_proj": inter}, False)
        self.down_proj = Linear(inter, cfg.hidden_size, bias=False)


class DecoderLayer(nn.Module):
    """A layer's weights, and the Python executor of its program (layer_program.py: LLAMA, or
    GEMMA's sandwich of norms before and after attention and MLP, whose norm weights are held as
    Gemma's (1 + w): loading.py adds the 1). csrc/decode_stack.cpp walks the same program."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.program = layer_program.program_for(cfg)
        self.fused_program = layer_program.fused(self.program)
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.gemma:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, residual, layer_idx, cache, step: Step):
        """(this layer's last output, the residual stream before it): the next norm adds them."""
        fl = fused_linear
        for op, module in layer_program.bind(self.fused_program if step.gemv else self.program, self):
            if op == "add_norm_linear":
                norm, linear = module
                if fusable(linear):
                    h, residual = fl.norm_linear(h, residual, norm.weight, norm.eps, linear.weight, linear.bias)
                else:
                    h, residual = norm.add_forward(h, residual, step.ops)
                    h = linear(h)
            elif op == "silu_and_mul_linear":
                h = fl.silu_linear(h, module.weight) if fusable(module) else module(step.ops.silu_and_mul(h))
            elif op == "linear" and step.gemv and fusable(module):
                h = fl.linear(h, module.weight, module.bias)
            elif op == "add_norm":
                h, residual = module.add_forward(h, residual, step.ops)
            elif op == "norm":
                h = module(h, step.ops)
            elif op == "linear":
                h = module(h)
            elif op == "rope_kv_write":
                h = module.rope_kv_write(h, layer_idx, cache, step)
            elif op == "attention":
                h = module.attention(h, layer_idx, cache, step)
            elif op == "silu_and_mul":
                h = step.ops.silu_and_mul(h)
            elif op == "gelu_tanh_and_mul":
                h = gelu_tanh_and_mul(h)
            else:
                raise ValueError(f"decoder layer: no Python executor for op {op!r}")
        return h, residual


class Transformer(nn.Module):
    """The decoder as a plain module: it computes, and never decides where its state lives.
    The KV cache and the ops table come in as arguments (the ModelRunner owns them,
    runner.py)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.windows = sorted({w for w in cfg.layer_windows if w is not None})  # the distinct sliding windows
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        """The activation dtype (the norms', never quantized; GGUF weights keep their blocks)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def forward(self, tokens, cache, ops: Ops = TORCH, tree_mask=None,
                attn_len=None, logits_at=None, return_hidden=False, inputs_embeds=None):
        """tokens [B,T] written at cache.lens[b] + (0..T-1) (tree: rotated as depth of the node).

        ops: the implementation of every op (kernels/ops.py; default: the torch references).
        attn_len: optional host bound on cache.lens + T to read less of the buffer.
        logits_at: optional [B,N] indices into T; LM head only there (prefill).
        inputs_embeds: optional [B,T,H] in place of the token embeddings (parallel drafter masks).
        Returns logits [B,T|N,V] (fp32), and the final hidden states when asked.
        """
        B, T = tokens.shape
        write_pos = cache.write_positions(T)
        pos = write_pos
        if tree_mask is not None:  # a node sits at its depth = number of ancestors
            depth = tree_mask.to(torch.int64).sum(-1).expand(B, T) - 1
            pos = (cache.lens.to(torch.int64)[:, None] + depth).clamp(max=cache.max_seq_len - 1)
        x = self.embed_tokens(tokens) if inputs_embeds is None else inputs_embeds
        if self.config.embed_scale is not None and inputs_embeds is None:  # Gemma: sqrt(hidden), in the dtype
            x = x * torch.tensor(self.config.embed_scale, dtype=x.dtype)
        kernel = ops.kernel("rope_kv_write")
        step = Step(StepRope.build(cache, pos, write_pos, x, kernel), tree_mask, attn_len, ops)
        step.gemv = ops.kernel("gemv") and fused_linear.fits(B * T)  # a decode, verify or draft step
        if self.windows:
            if tree_mask is not None and T > self.windows[0]:
                raise ValueError(f"a tree of {T} tokens is wider than a {self.windows[0]}-token sliding window")
            # a token sees positions > its own - window; int32 once per step, as every attention takes it
            step.windows = {w: (pos - (w - 1)).to(torch.int32) for w in self.windows}
            if cache.rope_local is not None:
                step.rope_local = StepRope.build(cache, pos, write_pos, x, kernel, local=True)
        stacked = cpu_stack.run(self, x, cache, step)  # the same layer program in one compiled call, where it can
        if stacked is not None:
            x, residual = stacked
        else:
            residual = None
            for i, layer in enumerate(self.layers):
                x, residual = layer(x, residual, i, cache, step)
        if logits_at is not None:
            at = logits_at[..., None].expand(B, logits_at.shape[1], x.shape[-1])
            x, residual = x.gather(1, at), residual.gather(1, at)
        if step.gemv and logits_at is None and not return_hidden and fusable(self.lm_head):  # the final norm inside
            logits = fused_linear.norm_linear(x, residual, self.norm.weight, self.norm.eps, self.lm_head.weight,
                                             self.lm_head.bias)[0].float()
        else:
            h, _ = self.norm.add_forward(x, residual, ops)
            logits = self.lm_head(h).float()
        own = self.config.trained_vocab_size
        if own is not None:  # a draft padded to its target's vocabulary (models/vocab.py): q = 0 there
            logits[..., own:] = float("-inf")
        return (logits, h) if return_hidden else logits


def _merged_projections(model: Transformer):
    """(merged name, its checkpoint prefix, its parts) of every merged projection."""
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.parts:
            yield name, name.rsplit(".", 1)[0], module.parts


def merged_homes(model: Transformer) -> dict[str, tuple[str, int, int]]:
    """HF name of each part of a merged projection -> (this model's name, first row, rows): where a
    load copies the part, straight into the merged tensor (one copy of the weights, written once)."""
    names, homes = set(model.state_dict()), {}
    for name, prefix, parts in _merged_projections(model):
        start = 0
        for part, rows in parts:
            for kind in ("weight", "bias"):
                if f"{name}.{kind}" in names:
                    homes[f"{prefix}.{part}.{kind}"] = (f"{name}.{kind}", start, rows)
            start += rows
    return homes


def split_checkpoint(model: Transformer) -> dict[str, torch.Tensor]:
    """This model's tensors by HF name (merged projections split into their `parts`): the
    inverse of `merged_homes`, for handing the same weights to transformers."""
    out = dict(model.state_dict())
    for name, prefix, parts in _merged_projections(model):
        for kind in ("weight", "bias"):
            merged = out.pop(f"{name}.{kind}", None)
            if merged is not None:
                for (part, _), piece in zip(parts, merged.split([rows for _, rows in parts])):
                    out[f"{prefix}.{part}.{kind}"] = piece
    return out
