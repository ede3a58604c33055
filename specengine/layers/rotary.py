"""RoPE + KV-cache write for one layer, reading the merged qkv projection
(kernels/rope_kv_write.py is the fused kernel).

The once-per-step part is `StepRope`: each token's RoPE position (tree nodes: their depth),
its clamped write position, cos/sin gathered there once for all layers (fp32 for the
kernel, which rounds once; cast to the model dtype once for the reference), and the row
index of every token (the reference's scatter). The per-layer part is `rope_kv_write`."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import use_kernels


@dataclass
class StepRope:
    cos: torch.Tensor  # [B,T,D]: fp32 for the kernel, the model dtype for the reference
    sin: torch.Tensor
    write_pos: torch.Tensor  # [B,T] int64, lens[b] + j clamped inside the buffer
    rows: torch.Tensor | None  # [B,T] int64 row of each token (reference path only)
    fused: bool  # the kernel path

    @classmethod
    def build(cls, cache, rope_pos: torch.Tensor, write_pos: torch.Tensor | None, like: torch.Tensor) -> "StepRope":
        cos, sin = cache.rope_cos[rope_pos], cache.rope_sin[rope_pos]
        if use_kernels(like):
            return cls(cos, sin, write_pos, None, True)
        rows = None if write_pos is None else \
            torch.arange(write_pos.shape[0], device=write_pos.device)[:, None].expand_as(write_pos)
        return cls(cos.to(like.dtype), sin.to(like.dtype), write_pos, rows, False)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B,T,H,D]; cos/sin [B,T,D] in x's dtype (rotate-half layout)."""
    cos, sin = cos[:, :, None], sin[:, :, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rotate_qkv(qkv, step: StepRope, num_heads: int, num_kv_heads: int):
    """(q, k rotated, v) of qkv [B,T,(Hq+2Hkv)*D] as [B,T,H,D]."""
    B, T, width = qkv.shape
    D = width // (num_heads + 2 * num_kv_heads)
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    cos, sin = step.cos.to(qkv.dtype), step.sin.to(qkv.dtype)  # no-ops on the reference path
    return (apply_rope(q.view(B, T, num_heads, D), cos, sin), apply_rope(k.view(B, T, num_kv_heads, D), cos, sin),
            v.view(B, T, num_kv_heads, D))


def rope_kv_write_ref(qkv, step: StepRope, k_cache, v_cache, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Rotate q and k of qkv [B,T,(Hq+2Hkv)*D], store k and v at step.write_pos of each row
    of k_cache / v_cache [B,S,Hkv,D]; returns q [B,T,Hq,D]."""
    q, k, v = rotate_qkv(qkv, step, num_heads, num_kv_heads)
    k_cache.index_put_((step.rows, step.write_pos), k)
    v_cache.index_put_((step.rows, step.write_pos), v)
    return q


def rope_kv_write(qkv, step: StepRope, k_cache, v_cache, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    if step.fused:
        from ..kernels.rope_kv_write import rope_kv_write as kernel

        return kernel(qkv, step.cos, step.sin, step.write_pos, k_cache, v_cache, num_heads, num_kv_heads)
    return rope_kv_write_ref(qkv, step, k_cache, v_cache, num_heads, num_kv_heads)
