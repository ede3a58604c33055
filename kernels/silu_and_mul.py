"""Fused SiLU-and-mul over a merged gate/up projection: out = silu(g) * u with [g | u] the
two halves of the last dim. One launch; a program per (row, column tile).

Roundings follow transformers' MLP (`act_fn(gate) * up` in the model dtype): silu is
computed in fp32 and rounded to the dtype, then multiplied by u and rounded again.
`silu_and_mul_ref` below is the spec; `silu_and_mul_cpu` is the compiled CPU op
(csrc/fused_ops_cpu.cpp) with the same roundings.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_ext
from .jit import needs_triton, tl, triton

_CPU_OP = cpu_ext.op("silu_and_mul")  # the compiled CPU op (csrc/fused_ops_cpu.cpp), or None


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [gate | up] on the last dim, in the input dtype (transformers' MLP)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@triton.jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, I, s_in, s_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    g = tl.load(gu_ptr + row * s_in + cols, mask=ok, other=0.0)
    u = tl.load(gu_ptr + row * s_in + I + cols, mask=ok, other=0.0)
    gf = g.to(tl.float32)
    act = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)
    out = act.to(tl.float32) * u.to(tl.float32)
    tl.store(out_ptr + row * s_out + cols, out.to(out_ptr.dtype.element_ty), mask=ok)


@needs_triton
def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> [..., I]."""
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"silu_and_mul wants an even last dim (gate | up), got {two_i}")
    I = two_i // 2
    x = gate_up.reshape(-1, two_i)
    if x.stride(-1) != 1:
        x = x.contiguous()
    out = torch.empty(x.shape[0], I, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(I))
    _silu_and_mul_kernel[(x.shape[0], triton.cdiv(I, block))](x, out, I, x.stride(0), out.stride(0), BLOCK=block,
                                                             num_warps=4)
    return out.view(*gate_up.shape[:-1], I)


def silu_and_mul_cpu(gate_up: torch.Tensor) -> torch.Tensor:
    """The compiled CPU op (csrc/fused_ops_cpu.cpp): [..., 2I] -> [..., I]."""
    two_i = gate_up.shape[-1]
    if two_i % 2:
        raise ValueError(f"silu_and_mul wants an even last dim (gate | up), got {two_i}")
    out = _CPU_OP(gate_up.reshape(-1, two_i).contiguous())
    return out.view(*gate_up.shape[:-1], two_i // 2)
