"""Choose an implementation per engine: "torch" | "triton" | "auto".

auto = Triton on CUDA (when Triton is installed), the torch reference elsewhere. Triton on
a CPU tensor only runs under Triton's interpreter (TRITON_INTERPRET=1, set before import),
which is how the tests compare both paths on a machine without a GPU. The resolved name
travels with the function chosen, so nobody infers it from the function's identity.
"""
from __future__ import annotations

import os

import torch

from ..errors import SpecEngineError
from ..kernels import triton_available, verify_attention_ref

BACKENDS = ("torch", "triton", "auto")


def check_backend(name: str, what: str) -> None:
    """A backend name is one of BACKENDS (`what` names the op: "attention" | "sampler")."""
    if name not in BACKENDS:
        raise SpecEngineError(f"unknown {what} backend {name!r}; choose from {', '.join(BACKENDS)}",
                              f"{what}_backend")


def resolve_backend(name: str, device: torch.device, what: str) -> str:
    """"torch" or "triton" for a requested backend name on `device` (`what` names the op)."""
    check_backend(name, what)
    if name == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if name == "triton":
        if not triton_available():
            raise SpecEngineError(f"{what} backend 'triton' needs Triton: pip install 'specengine[triton]'",
                                  f"{what}_backend")
        if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
            raise SpecEngineError(f"{what} backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1 on CPU)",
                                  f"{what}_backend")
    return name


def attention_op(name: str, device: torch.device):
    """(resolved name, the verify_attention-contract function)."""
    resolved = resolve_backend(name, device, "attention")
    if resolved == "torch":
        return resolved, verify_attention_ref
    from ..kernels.verify_attention import verify_attention

    return resolved, verify_attention
