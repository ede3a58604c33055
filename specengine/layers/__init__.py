"""Per-op layers that choose their implementation: our Triton kernel on CUDA (where Triton
is installed), the plain-PyTorch reference elsewhere. The reference is the spec and the CPU
path; the kernel is tested against it (under the interpreter on CPU). Ops: residual add +
RMSNorm (`norm.py`), RoPE + KV-cache write (`rotary.py`), SiLU-and-mul (`activation.py`);
the merged projections they read are models/decoder.py's (docs/design.md, "Fused step").

`force_kernels(True)` makes every op take its kernel on any device (the tests run them on
CPU tensors under TRITON_INTERPRET=1); `force_kernels(False)` the reference.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

_forced: bool | None = None


def use_kernels(x: torch.Tensor) -> bool:
    """Whether an op on x takes its Triton kernel."""
    if _forced is not None:
        return _forced
    if not x.is_cuda:
        return False
    from ..kernels import triton_available

    return triton_available()


@contextmanager
def force_kernels(on: bool | None):
    """Every op takes its kernel (True) or its reference (False); None: by device."""
    global _forced
    saved, _forced = _forced, on
    try:
        yield
    finally:
        _forced = saved
