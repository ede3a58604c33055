"""The compiled per-row CPU attention (batch-invariant mode's attention on a CPU) vs the torch
reference, on every instruction-set copy this CPU runs; its invariance checked bit for bit."""
import pytest
import torch
from helpers.attention_cases import rand_case, random_tree

from specengine.kernels import row_attention
from specengine.kernels.row_attention import verify_attention_rows
from specengine.kernels.verify_attention import verify_attention_ref

if row_attention._EXT is None:  # CI builds it; the strict-skips plugin fails a run that skips this
    pytest.skip("the compiled extension is not built", allow_module_level=True)


@pytest.fixture(params=row_attention._EXT.isas())
def isa(request):
    ext = row_attention._EXT
    widest = ext.isa()
    ext.set_isa(request.param)
    yield request.param
    ext.set_isa(widest)


@pytest.mark.parametrize("Q", [1, 3, 9])
@pytest.mark.parametrize("Hq,Hkv,D", [(12, 2, 128), (7, 7, 17), (4, 1, 40)])  # odd head dims: the 16-lane tail
@pytest.mark.parametrize("tree", [False, True])
def test_matches_the_reference_fp32(isa, Q, Hq, Hkv, D, tree):
    q, k, v, lens = rand_case(3, Q, Hq, Hkv, D, 70, seed=Q * D)
    tm = random_tree(3, Q, seed=Q) if tree else None
    torch.testing.assert_close(verify_attention_rows(q, k, v, lens, tm), verify_attention_ref(q, k, v, lens, tm),
                               rtol=0, atol=2e-6)


@pytest.mark.parametrize("Hq,Hkv,D", [(12, 2, 128), (7, 7, 17)])
def test_a_prefill_matches_the_reference_fp32(isa, Hq, Hkv, D):
    """A prefill's width (an empty cache, then a short one): each chain query stops reading at its own
    position, and the threads take positions out of order (csrc/cpu/attention_impl.h, QueryRow)."""
    q, k, v, lens = rand_case(2, 41, Hq, Hkv, D, 64, seed=D)
    lens = torch.tensor([0, 23], dtype=torch.int32)
    torch.testing.assert_close(verify_attention_rows(q, k, v, lens), verify_attention_ref(q, k, v, lens),
                               rtol=0, atol=2e-6)


def test_bf16_is_the_fp32_computation_rounded_once():
    q, k, v, lens = rand_case(2, 4, 8, 2, 64, 50, seed=1, dtype=torch.bfloat16)
    want = verify_attention_ref(q.float(), k.float(), v.float(), lens).bfloat16()
    got = verify_attention_rows(q, k, v, lens)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-5)  # one bf16 rounding apart


def test_cache_views_and_a_shared_tree_mask():
    """k / v as the runner passes them: strided views of a [layers, B, S, 2, Hkv, D] buffer,
    read only up to a prefix; the mask shared by every row ([1, Q, Q])."""
    g = torch.Generator().manual_seed(2)
    buf = torch.randn(3, 2, 90, 2, 2, 32, generator=g)
    k, v = buf[1, :, :60, 0], buf[1, :, :60, 1]
    q = torch.randn(2, 5, 6, 32, generator=g)
    lens = torch.tensor([40, 55], dtype=torch.int32)
    tm = random_tree(1, 5, seed=3)
    torch.testing.assert_close(verify_attention_rows(q, k, v, lens, tm),
                               verify_attention_ref(q, k.contiguous(), v.contiguous(), lens, tm), rtol=0, atol=2e-6)


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tree", [False, True])
def test_the_vectorized_loops_give_the_scalar_loops_bits(isa, D, dtype, tree):
    """Head dims 64 / 128 / 256 take loops that sum 16 keys' lanes at once (a transpose in registers):
    the same float operations in the same order as the scalar loops, so the same bits. Ragged key
    counts (not multiples of 16) and sliding-window starts put blocks at every offset."""
    ext = row_attention._EXT
    q, k, v, lens = rand_case(2, 5, 6, 2, D, 83, seed=D, dtype=dtype)
    tm = random_tree(2, 5, seed=D) if tree else None
    window = torch.randint(0, 40, (2, 5), generator=torch.Generator().manual_seed(D)) if tree else None
    fast = verify_attention_rows(q, k, v, lens, tm, window=window)
    ext.set_plain_attention(True)
    try:
        plain = verify_attention_rows(q, k, v, lens, tm, window=window)
    finally:
        ext.set_plain_attention(False)
    assert torch.equal(fast.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       plain.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


@pytest.mark.parametrize("Hq,Hkv,D", [(6, 2, 128), (20, 2, 64), (14, 2, 64)])
def test_the_heads_of_a_kv_head_give_their_bits_however_the_threads_split_them(isa, Hq, Hkv, D):
    """The AVX2 copy takes the query heads of a KV head together (up to 8 at a time: 20 / 2 makes
    groups of 8 and 2); a thread's share of rows may end inside a group. Every split (1-4 threads) and
    the scalar loops give the same bits."""
    q, k, v, lens = rand_case(2, 3, Hq, Hkv, D, 90, seed=Hq)
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3, 4):
            torch.set_num_threads(n)
            outs.append(verify_attention_rows(q, k, v, lens))
        row_attention._EXT.set_plain_attention(True)
        outs.append(verify_attention_rows(q, k, v, lens))
    finally:
        row_attention._EXT.set_plain_attention(False)
        torch.set_num_threads(threads)
    assert all(torch.equal(o.view(torch.int32), outs[0].view(torch.int32)) for o in outs[1:])


def test_a_querys_bits_depend_neither_on_the_other_queries_nor_the_read_length(isa):
    """Decoding token j alone (lens = n + j, Q = 1) and verifying it at position j of a chain
    (lens = n, Q = W), over any prefix of the cache that holds it: the same bits."""
    q, k, v, _ = rand_case(2, 6, 12, 2, 128, 300, seed=4)
    n = torch.tensor([100, 250], dtype=torch.int32)
    together = verify_attention_rows(q, k, v, n)
    for j in range(6):
        alone = verify_attention_rows(q[:, j:j + 1].contiguous(), k[:, :260], v[:, :260], n + j)
        assert torch.equal(alone[:, 0], together[:, j])
    assert torch.equal(verify_attention_rows(q, k[:, :256], v[:, :256], n), together)


def test_bad_inputs_are_named():
    q, k, v, lens = rand_case(1, 2, 4, 2, 16, 20, seed=5)
    with pytest.raises(RuntimeError, match="one dtype"):
        verify_attention_rows(q.double(), k, v, lens)
    with pytest.raises(RuntimeError, match="does not fit k"):
        verify_attention_rows(q[..., :8], k, v, lens)
    with pytest.raises(RuntimeError, match="tree mask must be"):
        verify_attention_rows(q, k, v, lens, torch.ones(1, 3, 3, dtype=torch.bool))


@pytest.mark.parametrize("Q", [1, row_attention.ROW_ATTENTION_WIDTH, row_attention.ROW_ATTENTION_WIDTH + 1])
def test_the_cpu_choice_is_the_row_attention_at_verify_widths_and_the_reference_above(Q):
    q, k, v, lens = rand_case(2, Q, 8, 2, 32, 60, seed=Q)
    got = row_attention.attention_cpu(q, k, v, lens)
    rows = Q <= row_attention.ROW_ATTENTION_WIDTH
    assert torch.equal(got, (verify_attention_rows if rows else verify_attention_ref)(q, k, v, lens))
    torch.testing.assert_close(got, verify_attention_ref(q, k, v, lens), rtol=0, atol=2e-6)
