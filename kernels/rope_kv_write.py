"""Fused RoPE + KV-cache write, reading the merged qkv projection.

For each token (b, t) of a step: rotate its q heads (rotate-half layout) into `q_out`,
rotate its k heads and store them, with its v heads, at cache position `wpos[b, t]` of
row b. cos/sin are the step's fp32 rows [B, T, D], gathered once per step at each token's
RoPE position (tree nodes: their depth). Write positions come clamped from
`KVCache.write_positions`, which also keeps the high-water mark (once per step, not per
layer). One launch per layer; a program per (token, head), the Hq query heads then the
Hkv KV heads. Rotation is fp32 with one rounding. `rope_kv_write_ref` below is the spec
(transformers' roundings: cos/sin in the model dtype); `rope_kv_write_cpu`, the compiled CPU
op (csrc/fused_ops_cpu.cpp), keeps those roundings.

Contract: rope_kv_write(qkv[B,T,(Hq+2Hkv)*D], cos[B,T,D], sin[B,T,D], wpos[B,T] int64 (clamped),
k_cache[B,S,Hkv,D], v_cache, Hq, Hkv) -> q[B,T,Hq,D] rotated; k rotated and v stored in place.
"""
from __future__ import annotations

import torch

from . import cpu_ext
from .jit import needs_triton, tl, triton


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B,T,H,D]; cos/sin [B,T,D] in x's dtype (rotate-half layout)."""
    cos, sin = cos[:, :, None], sin[:, :, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rotate_qkv(qkv, cos, sin, num_heads: int, num_kv_heads: int):
    """(q, k rotated, v) of qkv [B,T,(Hq+2Hkv)*D] as [B,T,H,D] (cos/sin cast to qkv's dtype)."""
    B, T, width = qkv.shape
    D = width // (num_heads + 2 * num_kv_heads)
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    cos, sin = cos.to(qkv.dtype), sin.to(qkv.dtype)  # no-ops when the caller cast them once per step
    return (apply_rope(q.view(B, T, num_heads, D), cos, sin), apply_rope(k.view(B, T, num_kv_heads, D), cos, sin),
            v.view(B, T, num_kv_heads, D))


def rope_kv_write_ref(qkv, cos, sin, wpos, k_cache, v_cache, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """The contract above in torch: rotate q and k, store k and v at wpos of each row."""
    q, k, v = rotate_qkv(qkv, cos, sin, num_heads, num_kv_heads)
    rows = torch.arange(wpos.shape[0], device=wpos.device)[:, None].expand_as(wpos)
    k_cache.index_put_((rows, wpos), k)
    v_cache.index_put_((rows, wpos), v)
    return q


@triton.jit
def _rotate(x_ptr, c_ptr, s_ptr, HALF, BLOCK_H: tl.constexpr):
    """(first half, second half) of the rotated head at x_ptr, fp32."""
    j = tl.arange(0, BLOCK_H)
    ok = j < HALF
    x1 = tl.load(x_ptr + j, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF + j, mask=ok, other=0.0).to(tl.float32)
    c1 = tl.load(c_ptr + j, mask=ok, other=0.0)
    c2 = tl.load(c_ptr + HALF + j, mask=ok, other=0.0)
    s1 = tl.load(s_ptr + j, mask=ok, other=0.0)
    s2 = tl.load(s_ptr + HALF + j, mask=ok, other=0.0)
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2, j, ok


@triton.jit
def _rope_kv_write_kernel(qkv_ptr, cos_ptr, sin_ptr, wpos_ptr, q_ptr, k_ptr, v_ptr,
                          T, HQ, HKV, HALF, s_qkv, s_rope, s_qb, s_qt, s_qh, s_kb, s_ks, s_kh,
                          BLOCK_H: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)  # b * T + t
    h = tl.program_id(1)
    b = tok // T
    t = tok % T
    D = 2 * HALF
    row = qkv_ptr + tok * s_qkv
    c_ptr, s_ptr = cos_ptr + tok * s_rope, sin_ptr + tok * s_rope
    if h < HQ:
        o1, o2, j, ok = _rotate(row + h * D, c_ptr, s_ptr, HALF, BLOCK_H)
        dst = q_ptr + b * s_qb + t * s_qt + h * s_qh
        tl.store(dst + j, o1.to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(dst + HALF + j, o2.to(q_ptr.dtype.element_ty), mask=ok)
    else:
        kh = h - HQ
        pos = tl.load(wpos_ptr + tok)
        o1, o2, j, ok = _rotate(row + (HQ + kh) * D, c_ptr, s_ptr, HALF, BLOCK_H)
        at = b * s_kb + pos * s_ks + kh * s_kh
        tl.store(k_ptr + at + j, o1.to(k_ptr.dtype.element_ty), mask=ok)
        tl.store(k_ptr + at + HALF + j, o2.to(k_ptr.dtype.element_ty), mask=ok)
        v_src = row + (HQ + HKV + kh) * D
        v1 = tl.load(v_src + j, mask=ok, other=0.0)
        v2 = tl.load(v_src + HALF + j, mask=ok, other=0.0)
        tl.store(v_ptr + at + j, v1.to(v_ptr.dtype.element_ty), mask=ok)
        tl.store(v_ptr + at + HALF + j, v2.to(v_ptr.dtype.element_ty), mask=ok)


@needs_triton
def rope_kv_write(qkv, cos, sin, wpos, k_cache, v_cache, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """qkv [B,T,(Hq+2Hkv)*D]; cos/sin [B,T,D] fp32; wpos [B,T] int64 (clamped); k_cache /
    v_cache [B,S,Hkv,D] (one layer, written in place). Returns the rotated q [B,T,Hq,D]."""
    B, T, width = qkv.shape
    D = width // (num_heads + 2 * num_kv_heads)
    if D * (num_heads + 2 * num_kv_heads) != width or D % 2:
        raise ValueError(f"qkv width {width} is not (Hq={num_heads} + 2*Hkv={num_kv_heads}) * an even head_dim")
    if k_cache.stride(-1) != 1 or v_cache.stride() != k_cache.stride():
        raise ValueError("k_cache and v_cache must share a layout with a contiguous head_dim")
    x = qkv if qkv.stride(-1) == 1 and qkv.stride(0) == T * qkv.stride(1) else qkv.contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    wpos = wpos.to(torch.int64).contiguous()
    q = torch.empty(B, T, num_heads, D, dtype=qkv.dtype, device=qkv.device)
    _rope_kv_write_kernel[(B * T, num_heads + num_kv_heads)](
        x, cos, sin, wpos, q, k_cache, v_cache, T, num_heads, num_kv_heads, D // 2, x.stride(1), cos.stride(1),
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_H=triton.next_power_of_2(D // 2), num_warps=1,
    )
    return q


def rope_kv_write_cpu(qkv, cos, sin, wpos, k_cache, v_cache, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """The contract above, compiled for CPU (csrc/fused_ops_cpu.cpp): cos/sin are cast to
    qkv's dtype (no-ops when the step already did, as StepRope does for every non-Triton op)."""
    B, T, width = qkv.shape
    x = qkv if qkv.stride(-1) == 1 and qkv.stride(0) == T * qkv.stride(1) else qkv.contiguous()
    cos, sin = cos.to(qkv.dtype).contiguous(), sin.to(qkv.dtype).contiguous()
    return cpu_ext.EXT.rope_kv_write(x, cos, sin, wpos.to(torch.int64).contiguous(), k_cache, v_cache,
                                     num_heads, num_kv_heads)
