"""A lean Llama-family decoder (Llama, Qwen2, Mistral) over a static KV buffer.

Parameter names mirror transformers' (minus the `model.` prefix) so HF checkpoints load
as they are. Every entry point writes the new tokens' K/V at `cache.lens[b] + j` and
returns logits; the caller decides what to commit and sets `cache.lens` (rollback is
lowering it). Nothing here syncs with the host.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .kernels.reference import verify_attention_ref
from .kv_cache import KVCache
from .rope import apply_rope, rope_tables

AttentionFn = Callable[..., torch.Tensor]  # the verify_attention contract (docs/design.md, "Kernel contracts")


class Linear(nn.Linear):
    """nn.Linear whose CPU matmul path per row count is chosen by measurement.

    `cpu_matmul.apply` sets `plan_fns` (a path per row count 1..16 and one for larger
    inputs) and may move the weight into oneDNN's packed layout (`packed_weight`, with
    `weight` then None). Without a plan (GPU, or not tuned) this is plain F.linear.
    """
    plan = plan_fns = packed_weight = None

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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.nh, self.nkv, self.hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.nh * self.hd, bias=cfg.qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, self.nkv * self.hd, bias=cfg.qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, self.nkv * self.hd, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.nh * self.hd, cfg.hidden_size, bias=False)

    def forward(self, x, layer_idx, cache: KVCache, pos, cos, sin, tree_mask, attn_len, attn_fn):
        B, T, _ = x.shape
        q = apply_rope(self.q_proj(x).view(B, T, self.nh, self.hd), cos, sin)
        k = apply_rope(self.k_proj(x).view(B, T, self.nkv, self.hd), cos, sin)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd)
        cache.write(layer_idx, k, v, pos)
        k_all, v_all = cache.layer(layer_idx, attn_len)
        out = attn_fn(q, k_all, v_all, cache.lens, tree_mask)
        return self.o_proj(out.reshape(B, T, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, *attn_args):
        x = x + self.self_attn(self.input_layernorm(x), *attn_args)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """The decoder as a plain module: it computes, and never decides where its state lives.
    The KV cache and the attention function come in as arguments (the ModelRunner owns
    them, runner.py)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def new_cache(self, batch: int, max_seq_len: int) -> KVCache:
        """A static KV buffer (and RoPE tables) for this model, on its device and in its dtype."""
        p, c = self.embed_tokens.weight, self.config
        rope = rope_tables(c.hf_config, c.head_dim, max_seq_len, p.device)
        return KVCache(c.num_layers, batch, max_seq_len, c.num_kv_heads, c.head_dim, p.dtype, p.device, rope)

    def forward(self, tokens, cache: KVCache, attn_fn: AttentionFn = verify_attention_ref, tree_mask=None,
                attn_len=None, logits_at=None, return_hidden=False, inputs_embeds=None):
        """tokens [B,T] written at cache.lens[b] + (0..T-1) (tree: rotated as depth of the node).

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
        cos, sin = cache.rope_cos[pos], cache.rope_sin[pos]
        x = self.embed_tokens(tokens) if inputs_embeds is None else inputs_embeds
        for i, layer in enumerate(self.layers):
            x = layer(x, i, cache, write_pos, cos, sin, tree_mask, attn_len, attn_fn)
        if logits_at is not None:
            x = x.gather(1, logits_at[..., None].expand(B, logits_at.shape[1], x.shape[-1]))
        h = self.norm(x)
        logits = self.lm_head(h).float()
        return (logits, h) if return_hidden else logits
