"""SiLU-and-mul over the merged gate/up projection (kernels/silu_and_mul.py is the kernel)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import use_kernels


def silu_and_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for [gate | up] on the last dim, in the input dtype (transformers' MLP)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    if use_kernels(gate_up):
        from ..kernels.silu_and_mul import silu_and_mul as kernel

        return kernel(gate_up)
    return silu_and_mul_ref(gate_up)
