"""Kernels of specengine, installed as `specengine.kernels` (never a bare `kernels`, which
is Hugging Face's package name). One file per op, Liger's discipline: the plain-PyTorch
reference (`<op>_ref`, the specification and the CPU path), the Triton kernel(s)
(`_<name>_kernel`) and the launcher, tested against the reference. Ops: `verify_attention`,
`rejection_sampling`, `draft_sampling`, `commit_tokens`, and the fused step's
`add_rms_norm`, `rope_kv_write`, `silu_and_mul`. Shared pieces: `jit.py` (Triton, or a
stand-in without it, and the `@triton.jit` helpers), `rng.py` (the samplers' random numbers
in torch). `ops.py` chooses per engine which one runs. Triton is optional: every reference
imports without it; on CPU the kernels run under TRITON_INTERPRET=1."""
from .jit import HAVE_TRITON
from .rejection_sampling import rejection_sample_ref
from .rng import counter_uniform
from .verify_attention import verify_attention_ref

__all__ = ["HAVE_TRITON", "counter_uniform", "rejection_sample_ref", "verify_attention_ref"]
