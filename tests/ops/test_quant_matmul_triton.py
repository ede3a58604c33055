"""The GPU kernel for GGUF blocks (kernels/quant_matmul.py, `quant_matmul_triton`) against the
reference matmul (dequantize, then matmul), under the interpreter on CPU: every format it reads,
odd row counts (1 decode row, a verify, more than one row tile) and weight rows that end mid-tile.
fp32 only off a GPU: the interpreter's 16-bit tl.dot is not the GPU's (bf16/fp16 run on CUDA)."""
import pytest
import torch
from helpers.ops import DEVICE
from ops.test_quant_matmul import random_blocks

from specengine.kernels.quant_matmul import CODES, quant_matmul_ref

pytest.importorskip("triton")
from specengine.kernels.quant_matmul import quant_matmul_triton  # noqa: E402

pytestmark = pytest.mark.triton  # a Triton kernel against its reference: `make gpu-rehearsal` runs these

DTYPES = [torch.float32] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("qtype", list(CODES))
@pytest.mark.parametrize("N,K,M", [(37, 256, 1), (33, 512, 5), (8, 256, 17)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_equals_the_reference_matmul(qtype, N, K, M, dtype):
    w = random_blocks(qtype, N, K, seed=N + M)
    x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(dtype)
    ref = quant_matmul_ref(x, w, qtype)
    got = quant_matmul_triton(x.to(DEVICE), w.to(DEVICE), qtype).cpu()
    scale = float((x.float().abs() @ quant_matmul_ref(torch.eye(K), w, qtype).abs()).max())
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # 16-bit: the weights rounded to the activations' dtype
    assert got.dtype == torch.float32 and got.shape == (M, N)
    torch.testing.assert_close(got, ref, rtol=0, atol=tol * scale)


def test_kernel_refuses_what_it_cannot_read():
    x = torch.zeros(1, 256, device=DEVICE)
    with pytest.raises(ValueError, match="the GPU kernel reads .* 'Q5_K' is not one of them"):
        quant_matmul_triton(x, torch.zeros(2, 176, dtype=torch.uint8, device=DEVICE), "Q5_K")
    with pytest.raises(ValueError, match="x has 256 columns"):
        quant_matmul_triton(x, torch.zeros(2, 34, dtype=torch.uint8, device=DEVICE), "Q8_0")
