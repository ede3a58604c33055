"""Fused SiLU-and-mul over a merged gate/up projection: out = silu(g) * u with [g | u] the
two halves of the last dim. One launch; a program per (row, column tile).

Roundings follow transformers' MLP (`act_fn(gate) * up` in the model dtype): silu is
computed in fp32 and rounded to the dtype, then multiplied by u and rounded again.
`silu_and_mul_ref` below is the spec; `silu_and_mul_cpu` is the compiled CPU op
(csrc/fused_ops_cpu.cpp) with the same roundings. In fp32 the CPU op computes exp its own way
(csrc/cpu/silu_impl.h, a vector register at a time): `silu_lanes_ref` is that op's spec, bit for bit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import cpu_ext
from .jit import needs_triton, silu_mul, tl, triton

_CPU_OP = cpu_ext.op("silu_and_mul")  # the compiled CPU op (csrc/fused_ops_cpu.cpp), or None


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [gate | up] on the last dim, in the input dtype (transformers' MLP)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def exp_lanes_ref(a: torch.Tensor) -> torch.Tensor:
    """fp32 exp as csrc/cpu/silu_impl.h computes it, one IEEE operation at a time (torch's elementwise
    fp32 ops on CPU round each result, as the compiled lanes do): Cody-Waite reduction to 2^n e^r with
    ln 2 in two parts, Cephes' degree-6 polynomial, 2^n from the exponent bits. a > 88.37 -> +inf;
    a < -87.3 is clamped (1 + exp(a) is 1 there)."""
    f = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731  (constants rounded to fp32 once)
    over = a > 88.37
    a = a.clamp(max=88.37).clamp(min=-87.3)
    n = (a * f(1.44269504088896341) + f(12582912.0)) - f(12582912.0)
    r = a - n * f(0.693359375)
    r = r - n * f(-2.12194440e-4)
    p = torch.full_like(a, 1.9875691500e-4)
    for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = p * r + f(c)
    e = p * (r * r) + r + f(1.0)
    scale = ((n.to(torch.int32) + 127) << 23).view(torch.float32)
    return torch.where(over, torch.inf, e * scale)


def silu_lanes_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """The fp32 CPU op's spec, bit for bit: x / (1 + exp(-x)) * u with exp as exp_lanes_ref."""
    x, u = gate_up.float().chunk(2, dim=-1)
    return x / (1.0 + exp_lanes_ref(-x)) * u


@triton.jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, I, s_in, s_out, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < I
    g = tl.load(gu_ptr + row * s_in + cols, mask=ok, other=0.0)
    u = tl.load(gu_ptr + row * s_in + I + cols, mask=ok, other=0.0)
    tl.store(out_ptr + row * s_out + cols, silu_mul(g, u).to(out_ptr.dtype.element_ty), mask=ok)


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
