"""The compiled CPU versions of the fused step's ops (csrc/fused_ops_cpu.cpp: add + RMSNorm,
SiLU-and-mul, RoPE + KV write) against their torch references: the same roundings, so fp32
RoPE and every residual sum are equal bit for bit; odd sizes, fp32 / bf16 / fp16, strided
inputs, tree positions, clamped writes; each row the same whatever the rows beside it; and
an engine on CPU takes them by default and gives the reference path's tokens."""
import pytest
import torch
from helpers.fused_cases import qk_norm_weights, rand, rope_case

from specengine import Engine
from specengine.kernels import cpu_ext
from specengine.kernels.add_rms_norm import add_rms_norm_cpu, add_rms_norm_ref
from specengine.kernels.ops import CPU_OPS, resolve
from specengine.kernels.rope_kv_write import rope_kv_write_cpu, rope_kv_write_ref
from specengine.kernels.silu_and_mul import exp_lanes_ref, silu_and_mul_cpu, silu_and_mul_ref, silu_lanes_ref

if cpu_ext.EXT is None:  # CI builds it; a strict run fails on this skip
    pytest.skip("the compiled extension is not built", allow_module_level=True)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# one ulp of the dtype: the norm's and silu's fp32 sums and exp differ from torch's vectorized
# ones in the last bits, which a rounding to 16 bits can carry over
TOL = {torch.float32: dict(atol=2e-6, rtol=2e-6), torch.bfloat16: dict(atol=1e-2, rtol=8e-3),
       torch.float16: dict(atol=1e-3, rtol=1e-3)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,N", [(1, 64), (3, 100), (9, 896), (2, 1536), (1, 7)])
@pytest.mark.parametrize("residual", [False, True])
def test_add_rms_norm_matches_the_reference(dtype, rows, N, residual):
    x = rand(rows, N, dtype=dtype, seed=1, scale=3.0)
    r = rand(rows, N, dtype=dtype, seed=2) if residual else None
    w = rand(N, dtype=dtype, seed=3)
    y, s = add_rms_norm_cpu(x, r, w, 1e-6)
    y_ref, s_ref = add_rms_norm_ref(x, r, w, 1e-6)
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    assert torch.equal(s, s_ref)  # the residual sum is rounded once, as torch's add does
    torch.testing.assert_close(y, y_ref, **TOL[dtype])


def test_add_rms_norm_takes_3d_strided_inputs_and_a_weight_of_another_dtype():
    x = rand(2, 5, 40, seed=4)[:, :, :33]
    r = rand(2, 5, 33, seed=5)
    y, s = add_rms_norm_cpu(x, r, rand(33, seed=6), 1e-5)
    y_ref, s_ref = add_rms_norm_ref(x, r, rand(33, seed=6), 1e-5)
    torch.testing.assert_close(y, y_ref, **TOL[torch.float32])
    assert torch.equal(s, s_ref)
    xb = x.to(torch.bfloat16)  # an fp32 weight promotes: the reference answers
    assert add_rms_norm_cpu(xb, None, rand(33, seed=6), 1e-5)[0].dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 64), (4, 136), (7, 1000), (1, 4864), (2, 3)])
def test_silu_and_mul_matches_the_reference(dtype, rows, inter):
    gu = rand(rows, 2 * inter, dtype=dtype, seed=7, scale=4.0)
    out = silu_and_mul_cpu(gu)
    assert out.dtype == dtype
    torch.testing.assert_close(out, silu_and_mul_ref(gu), **TOL[dtype])


@pytest.mark.parametrize("rows,inter", [(1, 16), (3, 37), (5, 8960), (2, 1)])
def test_fp32_silu_lanes_are_their_spec_bit_for_bit_on_every_copy(ext, rows, inter):
    """fp32 runs csrc/cpu/silu_impl.h: every instruction-set copy, every tail length and the special
    values give exactly silu_lanes_ref's bits (the op's spec, one torch op per step)."""
    gu = rand(rows, 2 * inter, seed=9, scale=8.0)
    special = torch.tensor([float("nan"), float("inf"), -float("inf"), 88.5, -88.5, -88.37, 87.4, -87.4, 0.0, -0.0,
                            1e-30, -1e-30, 100.0, -100.0, 20.0, -20.0])
    gu[0, :min(16, inter)] = special[:inter]
    out, ref = silu_and_mul_cpu(gu), silu_lanes_ref(gu)
    assert torch.equal(out.isnan(), ref.isnan())
    assert torch.equal(out.nan_to_num(), ref.nan_to_num()) and torch.equal(out.signbit(), ref.signbit())


def test_the_lanes_exp_is_exp_within_three_ulp():
    """The spec itself against float64 exp over the range where SiLU needs it (and +inf past it)."""
    import numpy as np

    a = torch.cat([torch.linspace(-87.3, 88.37, 400_001), torch.randn(20_000) * 3])
    got, true = exp_lanes_ref(a).double(), torch.exp(a.double())
    ulp = torch.from_numpy(np.spacing(true.float().numpy())).double()
    assert ((got - true).abs() / ulp).max() < 3
    assert torch.isinf(exp_lanes_ref(torch.tensor([88.4, 1e30]))).all()


def test_silu_and_mul_takes_a_batch_and_refuses_an_odd_width():
    gu = rand(2, 3, 20, seed=8)
    torch.testing.assert_close(silu_and_mul_cpu(gu), silu_and_mul_ref(gu), **TOL[torch.float32])
    with pytest.raises(ValueError, match="even"):
        silu_and_mul_cpu(rand(2, 7))


def _rope_case(B, T, Hq, Hkv, D, S, dtype, tree: bool, seed=0):
    """cos / sin in the model dtype, as the step hands them to every non-Triton op."""
    return rope_case(B, T, Hq, Hkv, D, S, dtype, tree, seed, rope_dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,Hq,Hkv,D", [(1, 1, 4, 2, 16), (3, 5, 6, 2, 34), (2, 6, 14, 2, 64), (1, 3, 8, 8, 128)])
@pytest.mark.parametrize("tree", [False, True])
def test_rope_kv_write_equals_the_reference(dtype, B, T, Hq, Hkv, D, tree):
    """Bit for bit in every dtype: each product and sum is rounded where the reference rounds."""
    S = 16
    qkv, cos, sin, wpos = _rope_case(B, T, Hq, Hkv, D, S, dtype, tree)
    kv = rand(2, B, S, Hkv, D, dtype=dtype, seed=9)  # stale contents must survive outside the writes
    kv_ref = kv.clone()
    q = rope_kv_write_cpu(qkv, cos, sin, wpos, kv[0], kv[1], Hq, Hkv)
    q_ref = rope_kv_write_ref(qkv, cos, sin, wpos, kv_ref[0], kv_ref[1], Hq, Hkv)
    assert torch.equal(q, q_ref) and torch.equal(kv, kv_ref)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,T,Hq,Hkv,D", [(1, 1, 4, 2, 16), (2, 5, 6, 2, 34), (1, 3, 8, 8, 128)])
def test_rope_kv_write_with_qk_norm_matches_the_reference(dtype, B, T, Hq, Hkv, D):
    """Qwen3's per-head q/k RMSNorm before the rotation: within the norm's last-bit differences."""
    S = 16
    qkv, cos, sin, wpos = _rope_case(B, T, Hq, Hkv, D, S, dtype, False, seed=4)
    norm = qk_norm_weights(D, dtype)
    kv = rand(2, B, S, Hkv, D, dtype=dtype, seed=9)
    kv_ref = kv.clone()
    q = rope_kv_write_cpu(qkv, cos, sin, wpos, kv[0], kv[1], Hq, Hkv, norm)
    q_ref = rope_kv_write_ref(qkv, cos, sin, wpos, kv_ref[0], kv_ref[1], Hq, Hkv, norm)
    torch.testing.assert_close(q, q_ref, **TOL[dtype])
    torch.testing.assert_close(kv, kv_ref, **TOL[dtype])
    swapped = rope_kv_write_cpu(qkv, cos, sin, wpos, kv[0].clone(), kv[1].clone(), Hq, Hkv, norm[1::-1] + norm[2:])
    assert not torch.equal(swapped, q)  # q's weight is q's, not k's


def test_rope_kv_write_into_a_row_view_of_a_layered_buffer_with_a_strided_qkv():
    B, T, Hq, Hkv, D, S = 3, 2, 4, 2, 16, 12
    qkv, cos, sin, wpos = _rope_case(2, T, Hq, Hkv, D, S, torch.float32, False)
    wide = torch.zeros(2, T, qkv.shape[-1] + 8)
    wide[..., :qkv.shape[-1]] = qkv
    buf = torch.zeros(2, 2, B, S, Hkv, D)  # [layer, k|v, row, pos, head, dim]
    ref = buf.clone()
    q = rope_kv_write_cpu(wide[..., :qkv.shape[-1]], cos, sin, wpos, buf[1, 0, :2], buf[1, 1, :2], Hq, Hkv)
    q_ref = rope_kv_write_ref(qkv, cos, sin, wpos, ref[1, 0, :2], ref[1, 1, :2], Hq, Hkv)
    assert torch.equal(q, q_ref) and torch.equal(buf, ref)
    assert not buf[0].any() and not buf[1, :, 2].any()  # other layers and rows untouched


def test_rope_kv_write_refuses_what_does_not_fit():
    qkv, cos, sin, wpos = _rope_case(1, 2, 4, 2, 16, 8, torch.float32, False)
    kv = torch.zeros(2, 1, 8, 2, 16)
    with pytest.raises(RuntimeError, match="is not"):
        rope_kv_write_cpu(qkv[..., :-2], cos, sin, wpos, kv[0], kv[1], 4, 2)
    with pytest.raises(RuntimeError, match="k_cache and v_cache"):
        rope_kv_write_cpu(qkv, cos, sin, wpos, kv[0].to(torch.bfloat16), kv[1], 4, 2)
    with pytest.raises(RuntimeError, match="outside the cache"):
        rope_kv_write_cpu(qkv, cos, sin, wpos + 7, kv[0], kv[1], 4, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_is_the_same_whatever_rows_share_the_call(dtype):
    """Batch invariance: one thread per row, one order (rows 0..12 alone equal rows 0..12 together)."""
    x, r, w = rand(13, 1536, dtype=dtype, seed=1), rand(13, 1536, dtype=dtype, seed=2), rand(1536, dtype=dtype)
    y, s = add_rms_norm_cpu(x, r, w, 1e-6)
    gu = rand(13, 2 * 8960, dtype=dtype, seed=3)
    act = silu_and_mul_cpu(gu)
    for i in (0, 5, 12):
        yi, si = add_rms_norm_cpu(x[i:i + 1], r[i:i + 1], w, 1e-6)
        assert torch.equal(yi, y[i:i + 1]) and torch.equal(si, s[i:i + 1])
        assert torch.equal(silu_and_mul_cpu(gu[i:i + 1]), act[i:i + 1])


def test_auto_takes_the_compiled_ops_on_cpu_and_cpu_is_refused_on_a_gpu():
    names = resolve("auto", "cpu").names
    assert {op for op, n in names.items() if n == "cpu"} == set(CPU_OPS)
    assert resolve("cpu", "cpu").names["attention"] == "cpu"  # the per-row attention at decode widths
    with pytest.raises(Exception, match="runs on CPU tensors"):
        resolve("cpu", "cuda")


@pytest.mark.parametrize("method,kw", [("ar", {}), ("sd", dict(gamma=3)), ("pearl", {})])
def test_an_engine_on_the_compiled_ops_gives_the_reference_tokens(tiny_dir, method, kw):
    eng = Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), max_seq_len=128, dtype="float32")
    assert eng.ops.names["rope_kv_write"] == "cpu"
    prompts = ["def add(a, b):\n", "x = [1"]
    fast = [r.token_ids for r in eng.generate(prompts, max_new_tokens=16, ignore_eos=True, method=method, **kw)]
    eng.set_kernels("torch")
    ref = [r.token_ids for r in eng.generate(prompts, max_new_tokens=16, ignore_eos=True, method="ar")]
    assert fast == ref
