"""The few-row fused linears (kernels/fused_linear.py, the ops table's `gemv`) against their
plain-torch compositions (add_rms_norm_ref / silu_and_mul_ref, then F.linear): odd shapes, fp32 /
bf16 / fp16 (16-bit within tolerance: the interpreter's conversions truncate where a GPU rounds),
leading dims and strides, the rows beside a row, refusals. Where they run in a model:
test_fused_linear_program.py."""
import pytest
import torch
from helpers.ops import DEVICE

from specengine.kernels import fused_linear as fl

pytest.importorskip("triton")
pytestmark = pytest.mark.triton  # a Triton kernel against its reference: `make gpu-rehearsal` runs these

TOL = {torch.float32: 2e-5, torch.bfloat16: 5e-2, torch.float16: 5e-3}  # relative to the output's scale


def close(got, want, dtype):
    scale = want.float().abs().max().clamp(min=1)
    err = (got.float() - want.float()).abs().max() / scale
    assert err <= TOL[dtype], f"max error {err:.2e} of the output's scale"


def tensors(M, K, N, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(DEVICE, dtype)  # noqa: E731
    return r(M, K), r(M, K), (torch.rand(K, generator=g) + 0.5).to(DEVICE, dtype), r(N, K) / K ** 0.5, r(N)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,K,N", [(1, 64, 32), (3, 96, 40), (16, 50, 17), (2, 200, 129)])
def test_each_op_matches_its_torch_composition(dtype, M, K, N):
    x, res, nw, W, b = tensors(M, K, N, dtype)
    for residual, bias in ((res, b), (None, None), (res, None)):
        y, s = fl.norm_linear(x, residual, nw, 1e-6, W, bias)
        y_ref, s_ref = fl.norm_linear_ref(x, residual, nw, 1e-6, W, bias)
        close(y, y_ref, dtype)
        assert y.dtype == y_ref.dtype and s.shape == x.shape
        if dtype == torch.float32:  # the new residual: one rounded add, as the reference's
            assert torch.equal(s, s_ref)
        else:
            close(s, s_ref, dtype)
    close(fl.linear(x, W, b), fl.linear_ref(x, W, b), dtype)
    gate_up = torch.randn(M, 2 * K).to(DEVICE, dtype)
    close(fl.silu_linear(gate_up, W), fl.silu_linear_ref(gate_up, W), dtype)


def test_leading_dims_and_strided_inputs():
    x, res, nw, W, b = tensors(6, 48, 24, torch.float32)
    x3, r3 = x.view(2, 3, 48), res.view(2, 3, 48)
    y, s = fl.norm_linear(x3, r3, nw, 1e-5, W, b)
    y_ref, s_ref = fl.norm_linear_ref(x3, r3, nw, 1e-5, W, b)
    assert y.shape == (2, 3, 24) and s.shape == (2, 3, 48)
    close(y, y_ref, torch.float32)
    wide = torch.randn(6, 96, device=DEVICE)[:, ::2]  # a non-contiguous input is copied, not misread
    close(fl.linear(wide, W), fl.linear_ref(wide, W), torch.float32)


def test_the_rows_beside_a_row_change_none_of_its_sums():
    """The first k rows alone and among 16 (other values, other count) give the same bits."""
    x, res, nw, W, b = tensors(16, 80, 48, torch.float32, seed=3)
    full = fl.norm_linear(x, res, nw, 1e-6, W, b)[0]
    for k in (1, 5, 15):
        assert torch.equal(fl.norm_linear(x[:k], res[:k], nw, 1e-6, W, b)[0], full[:k])
    gate_up = torch.randn(16, 160, device=DEVICE)
    assert torch.equal(fl.silu_linear(gate_up[:3], W), fl.silu_linear(gate_up, W)[:3])


def test_refusals_name_the_problem():
    x, res, nw, W, b = tensors(17, 32, 16, torch.float32)
    with pytest.raises(ValueError, match="at most 16 rows, got 17"):
        fl.linear(x, W)
    with pytest.raises(ValueError, match="row-major"):
        fl.linear(x[:2], W[:, :16])
    with pytest.raises(ValueError, match="even last dim"):
        fl.silu_linear(torch.randn(1, 33, device=DEVICE), W)
