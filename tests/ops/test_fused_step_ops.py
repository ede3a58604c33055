"""The fused step's Triton kernels (add + RMSNorm, SiLU-and-mul, RoPE + KV write) against
their plain-PyTorch references in specengine/layers/, under the interpreter on CPU: odd
sizes, fp32 / bf16 / fp16, strided inputs, tree positions, clamped write positions."""
from functools import partial

import pytest
import torch
from helpers import fused_cases
from helpers.ops import DEVICE

from specengine.kernels.silu_and_mul import silu_and_mul_ref
from specengine.kernels.add_rms_norm import add_rms_norm_ref
from specengine.kernels.rope_kv_write import rope_kv_write_ref

pytest.importorskip("triton")
from specengine.kernels.add_rms_norm import add_rms_norm  # noqa: E402
from specengine.kernels.rope_kv_write import rope_kv_write  # noqa: E402
from specengine.kernels.silu_and_mul import silu_and_mul  # noqa: E402

pytestmark = pytest.mark.triton  # a Triton kernel against its reference: `make gpu-rehearsal` runs these

TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float16: dict(atol=2e-3, rtol=2e-3)}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
rand = partial(fused_cases.rand, device=DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,N", [(1, 64), (3, 100), (9, 896), (2, 1536)])
@pytest.mark.parametrize("residual", [False, True])
def test_add_rms_norm_matches_the_reference(dtype, rows, N, residual):
    x = rand(rows, N, dtype=dtype, seed=1, scale=3.0)
    r = rand(rows, N, dtype=dtype, seed=2) if residual else None
    w = rand(N, dtype=dtype, seed=3)
    y, s = add_rms_norm(x, r, w, 1e-6)
    y_ref, s_ref = add_rms_norm_ref(x, r, w, 1e-6)
    assert y.dtype == y_ref.dtype and s.shape == s_ref.shape
    # fp32: the same sum exactly; 16-bit: within an ulp (the interpreter's casts may truncate
    # where a GPU rounds to nearest)
    torch.testing.assert_close(s, s_ref, **(dict(atol=0, rtol=0) if dtype == torch.float32 else TOL[dtype]))
    torch.testing.assert_close(y, y_ref, **TOL[dtype])


def test_add_rms_norm_takes_3d_and_strided_inputs():
    x = rand(2, 5, 40, seed=4)[:, :, :33]  # a row stride that is not the width
    r = rand(2, 5, 33, seed=5)
    w = rand(33, seed=6)
    y, s = add_rms_norm(x, r, w, 1e-5)
    y_ref, s_ref = add_rms_norm_ref(x, r, w, 1e-5)
    torch.testing.assert_close(y, y_ref, **TOL[torch.float32])
    torch.testing.assert_close(s, s_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 64), (4, 136), (7, 1000), (1, 4864)])
def test_silu_and_mul_matches_the_reference(dtype, rows, inter):
    gu = rand(rows, 2 * inter, dtype=dtype, seed=7, scale=4.0)
    torch.testing.assert_close(silu_and_mul(gu), silu_and_mul_ref(gu), **TOL[dtype])


def test_silu_and_mul_refuses_an_odd_width():
    with pytest.raises(ValueError, match="even"):
        silu_and_mul(rand(2, 7))


def _rope_case(B, T, Hq, Hkv, D, S, dtype, tree: bool, seed=0):
    return fused_cases.rope_case(B, T, Hq, Hkv, D, S, dtype, tree, seed, DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,Hq,Hkv,D", [(1, 1, 4, 2, 16), (3, 5, 6, 2, 32), (2, 6, 14, 2, 64), (1, 3, 8, 8, 128)])
@pytest.mark.parametrize("tree", [False, True])
def test_rope_kv_write_matches_the_reference(dtype, B, T, Hq, Hkv, D, tree):
    S = 16
    qkv, cos, sin, wpos = _rope_case(B, T, Hq, Hkv, D, S, dtype, tree)
    kv = rand(2, B, S, Hkv, D, dtype=dtype, seed=9)  # stale contents must survive outside the writes
    kv_ref = kv.clone()
    q = rope_kv_write(qkv, cos, sin, wpos, kv[0], kv[1], Hq, Hkv)
    q_ref = _check_kv_writes(kv, kv_ref, qkv, cos, sin, wpos, Hq, Hkv, dtype)
    torch.testing.assert_close(q, q_ref, **TOL[dtype])
    v_ref = qkv[..., (Hq + Hkv) * D:].reshape(B, T, Hkv, D)
    for b in range(B):  # v is copied exactly: each element of a written slot is a writer's
        for p in wpos[b].unique().tolist():
            writers = v_ref[b, wpos[b] == p]  # [n, Hkv, D]
            assert (writers == kv[1, b, p]).any(0).all()


def _check_kv_writes(kv, kv_ref, qkv, cos, sin, wpos, Hq, Hkv, dtype, norm=None):
    """The cache the kernel wrote (kv) against the reference's, from the stale kv_ref: slots one
    token writes match; a slot several tokens of a clamped (overrun) row write holds, element by
    element, one of theirs (racing programs, no order: kernels/rope_kv_write.py). Returns the reference q."""
    B, T = wpos.shape
    stale = kv_ref.clone()
    q_ref = rope_kv_write_ref(qkv, cos.to(dtype), sin.to(dtype), wpos, kv_ref[0], kv_ref[1], Hq, Hkv, norm)
    shared = torch.zeros(B, kv.shape[2], dtype=torch.bool, device=kv.device)
    for b in range(B):
        slots, counts = wpos[b].unique(return_counts=True)
        shared[b, slots[counts > 1]] = True
    torch.testing.assert_close(kv[:, ~shared], kv_ref[:, ~shared], **TOL[dtype])
    for b, p in shared.nonzero().tolist():
        writers = []  # each writer's k and v at the slot, written alone into the stale cache
        for t in (wpos[b] == p).nonzero().flatten().tolist():
            one = stale[:, b:b + 1].clone()
            rope_kv_write_ref(qkv[b:b + 1, t:t + 1], cos[b:b + 1, t:t + 1].to(dtype), sin[b:b + 1, t:t + 1].to(dtype),
                              wpos[b:b + 1, t:t + 1], one[0], one[1], Hq, Hkv, norm)
            writers.append(one[:, 0, p].float())
        tol = TOL[dtype]
        near = [(kv[:, b, p].float() - w).abs() <= tol["atol"] + tol["rtol"] * w.abs() for w in writers]
        assert torch.stack(near).any(0).all(), f"row {b} slot {p} holds values none of its writers wrote"
    return q_ref


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,Hq,Hkv,D", [(1, 1, 4, 2, 16), (2, 5, 6, 2, 34), (1, 3, 8, 8, 128)])
def test_rope_kv_write_with_qk_norm_matches_the_reference(dtype, B, T, Hq, Hkv, D):
    """Qwen3's per-head q/k RMSNorm folded into the same launch (weights differ for q and k)."""
    S = 16
    qkv, cos, sin, wpos = _rope_case(B, T, Hq, Hkv, D, S, dtype, False, seed=4)
    norm = fused_cases.qk_norm_weights(D, dtype, DEVICE)
    kv = rand(2, B, S, Hkv, D, dtype=dtype, seed=9)
    kv_ref = kv.clone()
    q = rope_kv_write(qkv, cos, sin, wpos, kv[0], kv[1], Hq, Hkv, norm)
    q_ref = _check_kv_writes(kv, kv_ref, qkv, cos, sin, wpos, Hq, Hkv, dtype, norm)
    torch.testing.assert_close(q, q_ref, **TOL[dtype])
    plain = rope_kv_write_ref(qkv, cos.to(dtype), sin.to(dtype), wpos, kv_ref[0].clone(), kv_ref[1].clone(), Hq, Hkv)
    assert (plain - q_ref).abs().max() > 0.1  # the norm changes what is rotated


def test_rope_kv_write_writes_into_a_row_view_of_a_layered_buffer():
    """The cache hands the kernel one layer of the 6-D buffer, sometimes a row view of it."""
    B, T, Hq, Hkv, D, S = 3, 2, 4, 2, 16, 12
    qkv, cos, sin, wpos = _rope_case(2, T, Hq, Hkv, D, S, torch.float32, False)
    buf = torch.zeros(2, 2, B, S, Hkv, D, device=DEVICE)  # [layer, k|v, row, pos, head, dim]
    ref = buf.clone()
    rope_kv_write(qkv, cos, sin, wpos, buf[1, 0, :2], buf[1, 1, :2], Hq, Hkv)
    rope_kv_write_ref(qkv, cos, sin, wpos, ref[1, 0, :2], ref[1, 1, :2], Hq, Hkv)
    torch.testing.assert_close(buf, ref)
    assert not buf[0].any() and not buf[1, :, 2].any()  # other layers and rows untouched
