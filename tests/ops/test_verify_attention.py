"""Triton verification attention vs the torch reference (interpreter on CPU, same tests on GPU)."""
import warnings

import pytest
import torch
from helpers import attention_cases
from helpers.attention_cases import random_tree
from helpers.ops import DEVICE, on_cpu_fewer

from specengine.kernels import verify_attention_ref

pytest.importorskip("triton")
from specengine.kernels.verify_attention import verify_attention  # noqa: E402

pytestmark = pytest.mark.triton  # a Triton kernel against its reference: `make gpu-rehearsal` runs these


def rand_case(B, Q, Hq, Hkv, D, S, seed, dtype=torch.float32):
    return attention_cases.rand_case(B, Q, Hq, Hkv, D, S, seed, dtype, DEVICE)


LAYOUTS = [(12, 2, 16), (14, 2, 64), (8, 8, 16), (4, 1, 128)]  # (query heads, KV heads, head dim)
CASES = [(q, *layout) for q in (1, 3, 7, 17) for layout in LAYOUTS]
# interpreted: every layout at 1 and 7 queries, 3 and 17 (past a 16-query tile) on two layouts
INTERPRETED = [c for c in CASES if c[0] in (1, 7) or c[1:] in (LAYOUTS[0], LAYOUTS[3])]


@pytest.mark.parametrize("Q,Hq,Hkv,D", on_cpu_fewer(CASES, INTERPRETED))
@pytest.mark.parametrize("tree", [False, True])
def test_matches_reference_fp32(Q, Hq, Hkv, D, tree):
    q, k, v, lens = rand_case(3, Q, Hq, Hkv, D, 37 + Q, seed=Q * 100 + Hq)
    mask = random_tree(3, Q, Q).to(DEVICE) if tree else None
    ref = verify_attention_ref(q, k, v, lens, mask)
    for splits in (1, 3):
        out = verify_attention(q, k, v, lens, mask, num_splits=splits)
        assert (out - ref).abs().max().item() <= 1e-5, splits


@pytest.mark.parametrize("B", [1, 33])
def test_batch_1_and_33_gqa_7_to_1(B):
    """Odd batch sizes with GQA 7:1 at head_dim 64 and 128 (the real pairs' packing)."""
    for D in (64, 128):
        q, k, v, lens = rand_case(B, 4, 7, 1, D, 21, seed=B + D)
        ref = verify_attention_ref(q, k, v, lens)
        assert (verify_attention(q, k, v, lens, num_splits=2) - ref).abs().max().item() <= 1e-5


def test_broadcast_tree_mask_and_buffer_views():
    """A [1,Q,Q] mask shared by all rows, and K/V given as views of a shared layer buffer."""
    q, k, v, lens = rand_case(2, 5, 4, 2, 32, 24, seed=7)
    buf = torch.randn(3, 2, 2, 40, 2, 32, device=DEVICE)  # [layers, k|v, B, S, H, D]
    buf[1, 0, :, :24], buf[1, 1, :, :24] = k, v
    kv, vv = buf[1, 0, :, :24], buf[1, 1, :, :24]
    mask = random_tree(1, 5, 3).to(DEVICE)
    out = verify_attention(q, kv, vv, lens, mask)
    assert (out - verify_attention_ref(q, k, v, lens, mask)).abs().max().item() <= 1e-5


def test_every_tree_node_equals_causal_attention_over_its_path():
    B, Q, Hq, Hkv, D, S = 2, 9, 4, 2, 16, 30
    q, k, v, lens = rand_case(B, Q, Hq, Hkv, D, S, seed=11)
    mask = random_tree(B, Q, 5).to(DEVICE)
    out = verify_attention(q, k, v, lens, mask)
    for b in range(B):
        n = int(lens[b])
        for i in range(Q):
            path = [j for j in range(Q) if mask[b, i, j]]  # ancestors in order, then i
            keys = list(range(n)) + [n + j for j in path]
            kk, vv = k[b:b + 1, keys], v[b:b + 1, keys]
            qq = q[b:b + 1, i:i + 1]
            ref = verify_attention_ref(qq, kk, vv, torch.tensor([len(keys) - 1], device=DEVICE, dtype=torch.int32))
            assert (out[b, i] - ref[0, 0]).abs().max().item() <= 1e-5, (b, i)


def test_bad_shapes_are_clear_errors():
    q, k, v, lens = rand_case(1, 2, 6, 4, 16, 10, seed=1)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        verify_attention(q, k, v, lens)
    q, k, v, lens = rand_case(1, 2, 4, 2, 24, 10, seed=1)
    with pytest.raises(ValueError, match="power of two"):
        verify_attention(q, k, v, lens)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tree", [False, True])
def test_half_precision_error_within_2x_of_torch_same_dtype(dtype, tree):
    q, k, v, lens = rand_case(4, 8, 12, 2, 128, 4096, seed=3)
    mask = random_tree(4, 8, 1).cuda() if tree else None
    ref = verify_attention_ref(q, k, v, lens, mask)
    qh, kh, vh = q.to(dtype), k.to(dtype), v.to(dtype)
    err_torch = (verify_attention_ref(qh, kh, vh, lens, mask).float() - ref).abs().max().item()
    err_triton = (verify_attention(qh, kh, vh, lens, mask).float() - ref).abs().max().item()
    assert err_triton <= 2 * err_torch + 1e-6


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's limit (CPU)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("tree", [False, True])
def test_half_precision_under_the_interpreter_is_the_reference_in_that_dtype(dtype, tree):
    """On CPU the kernel runs under Triton's interpreter, whose bf16 `tl.dot` is wrong (off by
    ~1e10): verify_attention computes bf16 through fp32 there and says so. fp16 dots are
    exact. Either way the result is the reference's within 16-bit rounding, never garbage."""
    from specengine.kernels.verify_attention import INTERPRETER_BF16_NOTE

    q, k, v, lens = rand_case(2, 5, 4, 2, 32, 40, seed=13, dtype=dtype)
    mask = random_tree(2, 5, 2).to(DEVICE) if tree else None
    ref = verify_attention_ref(q.float(), k.float(), v.float(), lens, mask)
    err_torch = (verify_attention_ref(q, k, v, lens, mask).float() - ref).abs().max().item()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = verify_attention(q, k, v, lens, mask, num_splits=2)
    assert out.dtype == dtype
    assert (out.float() - ref).abs().max().item() <= 2 * err_torch + 1e-6
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert said == ([INTERPRETER_BF16_NOTE] if dtype == torch.bfloat16 else [])


@pytest.mark.parametrize("tree", [False, True])
def test_fixed_split_matches_the_reference_and_ignores_the_read_length(tree):
    """Batch-invariant mode's kernel: splits at fixed positions, so reading more of the cache
    (more, empty splits) changes no bit of any query's result."""
    from specengine.kernels.verify_attention import INVARIANT_TILE, verify_attention_fixed

    q, k, v, lens = rand_case(2, 5, 4, 2, 16, 2 * INVARIANT_TILE + 40, seed=11)
    lens[0], lens[1] = INVARIANT_TILE + 10, INVARIANT_TILE - 2  # row 1's new tokens straddle a boundary
    mask = random_tree(2, 5, 3).to(DEVICE) if tree else None
    out = verify_attention_fixed(q, k, v, lens, mask)
    assert (out - verify_attention_ref(q, k, v, lens, mask)).abs().max().item() <= 1e-5
    short = int(lens.max()) + 5  # the keys end here: one split fewer than the whole buffer
    assert torch.equal(verify_attention_fixed(q, k[:, :short], v[:, :short], lens, mask), out)


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize("splits", [5, 20])
def test_splits_follow_each_rows_real_length(tree, splits):
    """Batch-1 decoding: the grid's split count comes from the GPU and the buffer read, but
    each program splits its own row's length (read on the device). Rows far shorter than the
    buffer (every split still gets keys), a row of length 0, more splits than the merge
    combines per step (MERGE_BLOCK), odd lengths: all equal the reference."""
    from specengine.kernels.verify_attention import MERGE_BLOCK

    assert splits < MERGE_BLOCK or splits > MERGE_BLOCK
    q, k, v, lens = rand_case(3, 3, 6, 2, 32, 300, seed=splits)
    lens[0], lens[1], lens[2] = 7, 0, 261
    mask = random_tree(3, 3, 5).to(DEVICE) if tree else None
    out = verify_attention(q, k, v, lens, mask, num_splits=splits)
    assert (out - verify_attention_ref(q, k, v, lens, mask)).abs().max().item() <= 1e-5


def test_fixed_splits_past_one_merge_block_keep_the_bits():
    """Batch-invariant mode with more fixed splits than the merge takes per step: a longer
    read (more empty splits, one more merge step) changes no bit."""
    from specengine.kernels.verify_attention import MERGE_BLOCK, verify_attention_fixed

    q, k, v, lens = rand_case(1, 2, 2, 1, 16, 256 * (MERGE_BLOCK + 2), seed=3)
    lens[0] = 256 * (MERGE_BLOCK - 1) + 17
    out = verify_attention_fixed(q, k, v, lens)
    assert (out - verify_attention_ref(q, k, v, lens)).abs().max().item() <= 1e-5
    short = int(lens[0]) + 2
    assert torch.equal(verify_attention_fixed(q, k[:, :short], v[:, :short], lens), out)
