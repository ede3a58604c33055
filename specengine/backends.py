"""Choose the attention and sampler implementations per engine: "torch" | "triton" | "auto".

auto = Triton on CUDA (when Triton is installed), the torch reference elsewhere. Triton on
a CPU tensor only runs under Triton's interpreter (TRITON_INTERPRET=1, set before import),
which is how the tests compare both paths on a machine without a GPU.
"""
from __future__ import annotations

import os

import torch

from .errors import SpecEngineError
from .kernels import rejection_sample_ref, triton_available, verify_attention_ref
from .sampling import sample_draft

BACKENDS = ("torch", "triton", "auto")


def _resolve(name: str, device: torch.device, what: str) -> str:
    if name not in BACKENDS:
        raise SpecEngineError(f"unknown {what} backend {name!r}; choose from {', '.join(BACKENDS)}")
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if name == "triton":
        if not triton_available():
            raise SpecEngineError(f"{what} backend 'triton' needs Triton: pip install 'specengine[triton]'")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise SpecEngineError(f"{what} backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1 on CPU)")
    return name


def attention_op(name: str, device: torch.device):
    if _resolve(name, device, "attention") == "torch":
        return verify_attention_ref
    from .kernels.verify_attention import verify_attention

    return verify_attention


def sampler_op(name: str, device: torch.device):
    if _resolve(name, device, "sampler") == "torch":
        return rejection_sample_ref
    from .kernels.rejection_sampling import rejection_sample

    return rejection_sample


def draft_sampler_op(name: str, device: torch.device):
    """Draft-token sampling follows the sampler backend: the fused kernel or the reference."""
    if _resolve(name, device, "sampler") == "torch":
        return sample_draft
    from .kernels.draft_sampling import sample_draft_fused

    return sample_draft_fused
