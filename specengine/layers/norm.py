"""RMSNorm with the residual add fused in (nano-vllm's `add_rms_forward`): a decoder layer
hands its output and the residual stream to the next norm, which returns the normed input
of the next block and the updated residual (op `add_rms_norm`, kernels/add_rms_norm.py)."""
from __future__ import annotations

import torch
from torch import nn

from ..kernels.ops import TORCH, Ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops: Ops = TORCH) -> torch.Tensor:
        return ops.add_rms_norm(x, None, self.weight, self.eps)[0]

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor | None, ops: Ops = TORCH):
        """(normed x + residual, x + residual)."""
        return ops.add_rms_norm(x, residual, self.weight, self.eps)
