"""Each op's implementations, for tests parametrized over backends: the torch reference on
CPU tensors, the Triton kernel on DEVICE (a GPU, or CPU tensors under the interpreter)."""
import pytest
import torch

from specengine.kernels.ops import OPS

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # kernels: GPU, or the interpreter
BACKENDS = ["torch", "triton"]


def implementation(op: str, backend: str):
    """(function, device) of `op` (a name in kernels/ops.py OPS) on `backend`."""
    module, ref, kernel = OPS[op]
    if backend == "torch":
        return getattr(module, ref), "cpu"
    pytest.importorskip("triton")
    return getattr(module, kernel), DEVICE


def on_cpu_fewer(cases: list, interpreted: list) -> list:
    """A kernel test's cases: all of them on a GPU; on a CPU, where Triton's interpreter costs
    ~0.2 s a launch, the subset `interpreted` (odd shapes kept; the GPU run covers the rest)."""
    assert all(c in cases for c in interpreted), "the interpreter's cases are a subset"
    return cases if DEVICE == "cuda" else interpreted
