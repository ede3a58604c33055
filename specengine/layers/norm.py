"""RMSNorm with the residual add fused in (nano-vllm's `add_rms_forward`): a decoder layer
hands its output and the residual stream to the next norm, which returns the normed input
of the next block and the updated residual. kernels/add_rms_norm.py is the fused kernel."""
from __future__ import annotations

import torch
from torch import nn

from . import use_kernels


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """(weight * rmsnorm(s), s) with s = x + residual (or x): transformers' roundings (the sum
    in the model dtype, statistics in fp32, the normed row cast before the weight)."""
    s = x if residual is None else x + residual
    sf = s.float()
    return weight * (sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)).to(s.dtype), s


def add_rms_norm(x, residual, weight, eps):
    if use_kernels(x):
        from ..kernels.add_rms_norm import add_rms_norm as kernel

        return kernel(x, residual, weight, eps)
    return add_rms_norm_ref(x, residual, weight, eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_rms_norm(x, None, self.weight, self.eps)[0]

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None):
        """(normed x + residual, x + residual)."""
        return add_rms_norm(x, residual, self.weight, self.eps)
