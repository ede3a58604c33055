"""verify_attention_ref against a naive per-row, per-query loop (chain, tree, GQA, ragged)."""
import pytest
import torch

from specengine.kernels import verify_attention_ref


def naive(q, k, v, lens, tree_mask):
    B, Q, Hq, D = q.shape
    G = Hq // k.shape[2]
    out = torch.zeros_like(q)
    for b in range(B):
        n = int(lens[b])
        for i in range(Q):
            if tree_mask is None:
                new = list(range(i + 1))
            else:
                tm = tree_mask[min(b, tree_mask.shape[0] - 1)]
                new = [j for j in range(Q) if tm[i, j]]
            keys = list(range(n)) + [n + j for j in new]
            for h in range(Hq):
                s = (k[b, keys, h // G] @ q[b, i, h]) / D ** 0.5
                out[b, i, h] = torch.softmax(s, 0) @ v[b, keys, h // G]
    return out


@pytest.mark.parametrize("Q", [1, 3, 7])
@pytest.mark.parametrize("Hq,Hkv", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("tree", [False, True])
def test_matches_naive(Q, Hq, Hkv, tree):
    g = torch.Generator().manual_seed(Q * 10 + Hq)
    B, S, D = 3, 40, 16
    q = torch.randn(B, Q, Hq, D, generator=g)
    k, v = torch.randn(B, S, Hkv, D, generator=g), torch.randn(B, S, Hkv, D, generator=g)
    lens = torch.tensor([0, 5, 29], dtype=torch.int32)
    mask = None
    if tree:
        mask = torch.rand(B, Q, Q, generator=g) < 0.5
        mask |= torch.eye(Q, dtype=torch.bool)
        mask &= torch.ones(Q, Q, dtype=torch.bool).tril()
    got = verify_attention_ref(q, k, v, lens, mask)
    assert torch.allclose(got, naive(q, k, v, lens, mask), atol=1e-5)
