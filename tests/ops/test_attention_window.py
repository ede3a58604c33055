"""Sliding-window attention (Gemma 3's local layers): every verification attention — the torch
reference, the batch-invariant tiled one, the compiled CPU rows and the Triton kernel (under the
interpreter on CPU) — reads only each query's window, against a plain loop; chains and trees
(a node's window counts from its depth), GQA, odd head dims where the implementation allows."""
import pytest
import torch
from helpers.attention_cases import naive_window_attention, rand_case, random_tree, window_starts

from specengine.kernels import cpu_ext
from specengine.kernels.row_attention import verify_attention_rows
from specengine.kernels.verify_attention import verify_attention_ref, verify_attention_tiled

pytestmark = pytest.mark.triton  # a Triton kernel against its reference: `make gpu-rehearsal` runs these

SHAPES = [(1, 4, 2, 16, 40, 5), (3, 6, 2, 32, 37, 8), (7, 4, 1, 16, 30, 3), (2, 8, 8, 16, 300, 260)]
# (shape, tree): a tree's new tokens are windowed by slot, so trees only where the window holds them
# (the decoder refuses a tree wider than a layer's window)
CASES = [(*shape, tree) for shape in SHAPES for tree in (False, True) if not (tree and shape[-1] < shape[0])]


def case(Q, Hq, Hkv, D, S, window, tree, seed=0):
    q, k, v, lens = rand_case(3, Q, Hq, Hkv, D, S, seed)
    mask = random_tree(3, Q, seed) if tree else None
    return q, k, v, lens, mask, window_starts(lens, mask, Q, window)


@pytest.mark.parametrize("Q,Hq,Hkv,D,S,window,tree", CASES)
def test_the_reference_reads_only_the_window(Q, Hq, Hkv, D, S, window, tree):
    q, k, v, lens, mask, ws = case(Q, Hq, Hkv, D, S, window, tree)
    want = naive_window_attention(q, k, v, lens, mask, ws)
    torch.testing.assert_close(verify_attention_ref(q, k, v, lens, mask, window=ws).double(), want,
                               rtol=1e-5, atol=1e-5)
    full = verify_attention_ref(q, k, v, lens, mask)
    assert (full - want).abs().max() > 1e-3  # the window changes the answer here


@pytest.mark.parametrize("Q,Hq,Hkv,D,S,window,tree", CASES)
def test_tiled_and_rows_follow_the_window(Q, Hq, Hkv, D, S, window, tree):
    q, k, v, lens, mask, ws = case(Q, Hq, Hkv, D, S, window, tree, seed=1)
    want = verify_attention_ref(q, k, v, lens, mask, window=ws)
    torch.testing.assert_close(verify_attention_tiled(q, k, v, lens, mask, window=ws, tile=64), want,
                               rtol=1e-5, atol=1e-5)
    if cpu_ext.has("row_attention"):
        torch.testing.assert_close(verify_attention_rows(q, k, v, lens, mask, window=ws), want, rtol=1e-5, atol=2e-6)


@pytest.mark.interpreter
@pytest.mark.parametrize("Q,Hq,Hkv,D,S,window,tree", CASES[:5])
def test_the_triton_kernel_follows_the_window(Q, Hq, Hkv, D, S, window, tree):
    pytest.importorskip("triton")
    from helpers.ops import DEVICE

    from specengine.kernels.verify_attention import verify_attention, verify_attention_fixed

    q, k, v, lens, mask, ws = case(Q, Hq, Hkv, D, S, window, tree, seed=2)
    want = verify_attention_ref(q, k, v, lens, mask, window=ws)
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    for out in (verify_attention(*map(dev, (q, k, v, lens, mask)), window=dev(ws), num_splits=2),
                verify_attention_fixed(*map(dev, (q, k, v, lens, mask)), window=dev(ws))):
        assert (out.cpu() - want).abs().max().item() <= 1e-5
