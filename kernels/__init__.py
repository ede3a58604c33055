"""Kernels of specengine, installed as `specengine.kernels` (never a bare `kernels`, which
is Hugging Face's package name). Each op has a plain-PyTorch reference in `reference.py`
that is its specification and its CPU fallback; `rng.py` is the counter-based random
number generator both paths share. The Triton versions live in
`verify_attention.py` and `rejection_sampling.py` and are imported only when asked for
(Triton is optional; on CPU they run under TRITON_INTERPRET=1)."""
from .reference import rejection_sample_ref, verify_attention_ref
from .rng import counter_uniform

__all__ = ["counter_uniform", "rejection_sample_ref", "verify_attention_ref", "triton_available"]


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
