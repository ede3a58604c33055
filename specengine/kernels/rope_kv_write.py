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
k_cache[B,S,Hkv,D], v_cache, Hq, Hkv, qk_norm=None) -> q[B,T,Hq,D] rotated; k rotated and v
stored in place. qk_norm = (q weight [D], k weight [D], eps): each q and k head is RMS-normed
first (Qwen3, Gemma 3; transformers' roundings, as add_rms_norm's), in the same launch.
A slot that several tokens of a row write (only a row that overran the buffer, whose clamped
writes the high-water check turns into an error) holds, element by element, one of those
tokens' values: the programs race, in no set order on a GPU (index_put_ promises none either).
"""
from __future__ import annotations

import torch

from . import cpu_ext
from .add_rms_norm import add_rms_norm_ref
from .jit import needs_triton, tl, triton

_CPU_OP = cpu_ext.op("rope_kv_write")  # the compiled CPU op (csrc/fused_ops_cpu.cpp), or None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B,T,H,D]; cos/sin [B,T,D] in x's dtype (rotate-half layout)."""
    cos, sin = cos[:, :, None], sin[:, :, None]
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def rotate_qkv(qkv, cos, sin, num_heads: int, num_kv_heads: int, qk_norm=None):
    """(q, k rotated, v) of qkv [B,T,(Hq+2Hkv)*D] as [B,T,H,D] (cos/sin cast to qkv's dtype);
    qk_norm (q weight, k weight, eps): q and k heads RMS-normed before the rotation."""
    B, T, width = qkv.shape
    D = width // (num_heads + 2 * num_kv_heads)
    q, k, v = qkv.split([num_heads * D, num_kv_heads * D, num_kv_heads * D], dim=-1)
    q, k = q.view(B, T, num_heads, D), k.view(B, T, num_kv_heads, D)
    if qk_norm is not None:
        wq, wk, eps = qk_norm
        q, k = add_rms_norm_ref(q, None, wq, eps)[0], add_rms_norm_ref(k, None, wk, eps)[0]
    cos, sin = cos.to(qkv.dtype), sin.to(qkv.dtype)  # no-ops when the caller cast them once per step
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.view(B, T, num_kv_heads, D)


def rope_kv_write_ref(qkv, cos, sin, wpos, k_cache, v_cache, num_heads: int, num_kv_heads: int,
                      qk_norm=None) -> torch.Tensor:
    """The contract above in torch: (norm and) rotate q and k, store k and v at wpos of each row."""
    q, k, v = rotate_qkv(qkv, cos, sin, num_heads, num_kv_heads, qk_norm)
    rows = torch.arange(wpos.shape[0], device=wpos.device)[:, None].expand_as(wpos)
    k_cache.index_put_((rows, wpos), k)
    v_cache.index_put_((rows, wpos), v)
    return q


@triton.jit
def _rotate(x_ptr, c_ptr, s_ptr, w_ptr, eps, HALF, BLOCK_H: tl.constexpr, NORM: tl.constexpr):
    """(first half, second half) of the rotated head at x_ptr, fp32; NORM: the head RMS-normed
    with weight w_ptr first (fp32 statistics, the normed row and its product with the weight
    rounded to the model dtype, as add_rms_norm)."""
    j = tl.arange(0, BLOCK_H)
    ok = j < HALF
    x1 = tl.load(x_ptr + j, mask=ok, other=0.0)
    x2 = tl.load(x_ptr + HALF + j, mask=ok, other=0.0)
    if NORM:
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        inv = 1.0 / tl.sqrt((tl.sum(f1 * f1, 0) + tl.sum(f2 * f2, 0)) / (2 * HALF) + eps)
        w1 = tl.load(w_ptr + j, mask=ok, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + j, mask=ok, other=0.0).to(tl.float32)
        x1 = (w1 * (f1 * inv).to(x1.dtype).to(tl.float32)).to(x1.dtype)
        x2 = (w2 * (f2 * inv).to(x2.dtype).to(tl.float32)).to(x2.dtype)
    x1 = x1.to(tl.float32)
    x2 = x2.to(tl.float32)
    c1 = tl.load(c_ptr + j, mask=ok, other=0.0)
    c2 = tl.load(c_ptr + HALF + j, mask=ok, other=0.0)
    s1 = tl.load(s_ptr + j, mask=ok, other=0.0)
    s2 = tl.load(s_ptr + HALF + j, mask=ok, other=0.0)
    return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2, j, ok


@triton.jit
def _rope_kv_write_kernel(qkv_ptr, cos_ptr, sin_ptr, wpos_ptr, q_ptr, k_ptr, v_ptr, qn_ptr, kn_ptr, eps,
                          T, HQ, HKV, HALF, s_qkv, s_rope, s_qb, s_qt, s_qh, s_kb, s_ks, s_kh,
                          BLOCK_H: tl.constexpr, NORM: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)  # b * T + t
    h = tl.program_id(1)
    b = tok // T
    t = tok % T
    D = 2 * HALF
    row = qkv_ptr + tok * s_qkv
    c_ptr, s_ptr = cos_ptr + tok * s_rope, sin_ptr + tok * s_rope
    if h < HQ:
        o1, o2, j, ok = _rotate(row + h * D, c_ptr, s_ptr, qn_ptr, eps, HALF, BLOCK_H, NORM)
        dst = q_ptr + b * s_qb + t * s_qt + h * s_qh
        tl.store(dst + j, o1.to(q_ptr.dtype.element_ty), mask=ok)
        tl.store(dst + HALF + j, o2.to(q_ptr.dtype.element_ty), mask=ok)
    else:
        kh = h - HQ
        pos = tl.load(wpos_ptr + tok)
        o1, o2, j, ok = _rotate(row + (HQ + kh) * D, c_ptr, s_ptr, kn_ptr, eps, HALF, BLOCK_H, NORM)
        at = b * s_kb + pos * s_ks + kh * s_kh
        tl.store(k_ptr + at + j, o1.to(k_ptr.dtype.element_ty), mask=ok)
        tl.store(k_ptr + at + HALF + j, o2.to(k_ptr.dtype.element_ty), mask=ok)
        v_src = row + (HQ + HKV + kh) * D
        v1 = tl.load(v_src + j, mask=ok, other=0.0)
        v2 = tl.load(v_src + HALF + j, mask=ok, other=0.0)
        tl.store(v_ptr + at + j, v1.to(v_ptr.dtype.element_ty), mask=ok)
        tl.store(v_ptr + at + HALF + j, v2.to(v_ptr.dtype.element_ty), mask=ok)


@needs_triton
def rope_kv_write(qkv, cos, sin, wpos, k_cache, v_cache, num_heads: int, num_kv_heads: int,
                  qk_norm=None) -> torch.Tensor:
    """qkv [B,T,(Hq+2Hkv)*D]; cos/sin [B,T,D] fp32; wpos [B,T] int64 (clamped); k_cache /
    v_cache [B,S,Hkv,D] (one layer, written in place); qk_norm (q weight [D], k weight [D], eps)
    or None. Returns the rotated q [B,T,Hq,D]."""
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
    wq, wk, eps = qk_norm if qk_norm is not None else (q, q, 0.0)  # unread without NORM
    _rope_kv_write_kernel[(B * T, num_heads + num_kv_heads)](
        x, cos, sin, wpos, q, k_cache, v_cache, wq, wk, eps, T, num_heads, num_kv_heads, D // 2, x.stride(1),
        cos.stride(1), q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_H=triton.next_power_of_2(D // 2), NORM=qk_norm is not None, num_warps=1,
    )
    return q


def rope_kv_write_cpu(qkv, cos, sin, wpos, k_cache, v_cache, num_heads: int, num_kv_heads: int,
                      qk_norm=None) -> torch.Tensor:
    """The contract above, compiled for CPU (csrc/fused_ops_cpu.cpp): cos/sin are cast to
    qkv's dtype (no-ops when the step already did, as StepRope does for every non-Triton op)."""
    B, T, width = qkv.shape
    x = qkv if qkv.stride(-1) == 1 and qkv.stride(0) == T * qkv.stride(1) else qkv.contiguous()
    cos, sin = cos.to(qkv.dtype).contiguous(), sin.to(qkv.dtype).contiguous()
    wq, wk, eps = qk_norm if qk_norm is not None else (None, None, 0.0)
    if qk_norm is not None and (wq.dtype != qkv.dtype or wk.dtype != qkv.dtype):  # as add_rms_norm_cpu
        return rope_kv_write_ref(qkv, cos, sin, wpos, k_cache, v_cache, num_heads, num_kv_heads, qk_norm)
    return _CPU_OP(x, cos, sin, wpos.to(torch.int64).contiguous(), k_cache, v_cache,
                                     num_heads, num_kv_heads, wq, wk, eps)
