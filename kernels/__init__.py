"""Kernels of specengine, installed as `specengine.kernels` (never a bare `kernels`, which
is Hugging Face's package name). Each op has a plain-PyTorch reference in `reference.py`
that is its specification and its CPU fallback; Triton versions plug in as backends."""
from .reference import (
    counter_uniform,
    rejection_sample_ref,
    total_variation_bound,
    verify_attention_ref,
)

__all__ = ["counter_uniform", "rejection_sample_ref", "total_variation_bound", "verify_attention_ref"]
