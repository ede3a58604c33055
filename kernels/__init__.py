"""Kernels of specengine, installed as `specengine.kernels` (never a bare `kernels`, which
is Hugging Face's package name). Each op has a plain-PyTorch reference in `reference.py`
that is its specification and its CPU fallback; `rng.py` is the counter-based random
number generator both paths share. The Triton versions, one file per kernel
(`verify_attention.py`, `rejection_sampling.py` and its split path, `draft_sampling.py`,
the fused step ops), are imported only when asked for (Triton is optional; on CPU they run
under TRITON_INTERPRET=1); the samplers' shared `@triton.jit` helpers are `sampler_jit.py`."""
from .reference import rejection_sample_ref, verify_attention_ref
from .rng import counter_uniform

__all__ = ["counter_uniform", "rejection_sample_ref", "verify_attention_ref", "triton_available"]


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
