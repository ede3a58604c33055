"""Fused residual add + RMSNorm: one launch, one row per program.

    s = x + residual            (rounded to the input dtype: the new residual stream)
    y = weight * (s * rsqrt(mean(s^2) + eps)).to(dtype)

The order of roundings is transformers' (`LlamaRMSNorm`): the sum is stored in the model
dtype, the statistics are fp32, the normalized row is cast to the dtype before the weight
multiplies it. Without a residual (the first layer) it is RMSNorm alone and the residual
out is x itself. `add_rms_norm_ref` below is the spec; `add_rms_norm_cpu` is the compiled CPU
op (csrc/fused_ops_cpu.cpp) with the same roundings.
"""
from __future__ import annotations

import torch

from . import cpu_ext
from .jit import needs_triton, rms_scaled, tl, triton

_CPU_OP = cpu_ext.op("add_rms_norm")  # the compiled CPU op (csrc/fused_ops_cpu.cpp), or None


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(weight * rmsnorm(s), s) with s = x + residual (or x): transformers' roundings (the sum
    in the model dtype, statistics in fp32, the normed row cast before the weight)."""
    s = x if residual is None else x + residual
    sf = s.float()
    return weight * (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)).to(s.dtype), s


@triton.jit
def _add_rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, N, eps, s_x, s_r, s_y, s_s,
                         HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < N
    x = tl.load(x_ptr + row * s_x + cols, mask=ok, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + row * s_r + cols, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(s_ptr + row * s_s + cols, x, mask=ok)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    w = tl.load(w_ptr + cols, mask=ok, other=0.0)
    y = rms_scaled(x, inv, w)
    tl.store(y_ptr + row * s_y + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


@needs_triton
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(normed [..., N], new residual [..., N]) for x (+ residual) [..., N] (last dim contiguous)."""
    N = x.shape[-1]
    x2 = x.reshape(-1, N)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if residual is None:
        r2 = s = x2
    else:
        r2 = residual.reshape(-1, N)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        s = torch.empty_like(x2)
    block = triton.next_power_of_2(N)
    _add_rms_norm_kernel[(x2.shape[0],)](
        x2, r2, weight, y, s, N, eps, x2.stride(0), r2.stride(0), y.stride(0), s.stride(0),
        HAS_RES=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
    )
    return y.view(x.shape), s.view(x.shape)


def add_rms_norm_cpu(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """The compiled CPU op (csrc/fused_ops_cpu.cpp); the reference where its dtypes differ
    (a weight of another dtype promotes the output, which the op does not)."""
    if weight.dtype != x.dtype or (residual is not None and residual.dtype != x.dtype):
        return add_rms_norm_ref(x, residual, weight, eps)
    N = x.shape[-1]
    r2 = None if residual is None else residual.reshape(-1, N).contiguous()
    y, s = _CPU_OP(x.reshape(-1, N).contiguous(), r2, weight.contiguous(), eps)
    return y.view(x.shape), s.view(x.shape)
