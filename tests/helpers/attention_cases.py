"""Random verification-attention inputs shared by the attention tests (the Triton kernel's and
the compiled CPU one's): q / k / v with one row using the whole buffer, and random token trees."""
import torch


def rand_case(B, Q, Hq, Hkv, D, S, seed, dtype=torch.float32, device="cpu"):
    """[q [B,Q,Hq,D], k, v [B,S,Hkv,D] in `dtype` on `device`, cache_lens [B] int32]."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Q, Hq, D, generator=g)
    k, v = torch.randn(B, S, Hkv, D, generator=g), torch.randn(B, S, Hkv, D, generator=g)
    lens = torch.randint(0, S - Q + 1, (B,), generator=g, dtype=torch.int32)
    lens[0] = S - Q  # one row uses the whole buffer
    return [t.to(device, dtype) for t in (q, k, v)] + [lens.to(device)]


def random_tree(B, Q, seed):
    """Each node's parent is an earlier node; mask[b, i, j] = j is i or an ancestor of i."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(B, Q, Q, dtype=torch.bool)
    for b in range(B):
        parent = [-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, Q)]
        for i in range(Q):
            j = i
            while j >= 0:
                mask[b, i, j] = True
                j = parent[j]
    return mask


def window_starts(lens, tree_mask, Q: int, window: int):
    """[B, Q] int32: each query's first visible position for a sliding window of `window`
    tokens: its position (cache_lens + its index, or its depth in a tree) - window + 1."""
    depth = torch.arange(Q)[None].expand(lens.shape[0], Q) if tree_mask is None else tree_mask.sum(-1).cpu() - 1
    return (lens.cpu().to(torch.int64)[:, None] + depth - window + 1).clamp(min=0).to(torch.int32)


def naive_window_attention(q, k, v, lens, tree_mask, window_start, scale=None):
    """A plain loop over (row, query, head): softmax over the positions the query sees (its
    chain / tree ancestors and the cache, those from its window's start on). The independent
    spec of the window argument."""
    B, Q, Hq, D = q.shape
    G = Hq // k.shape[2]
    scale = scale if scale is not None else D ** -0.5
    out = torch.zeros(B, Q, Hq, D, dtype=torch.float64)
    for b in range(B):
        n0 = int(lens[b])
        for i in range(Q):
            seen = [s for s in range(int(window_start[b, i]), n0)]
            seen += [n0 + j for j in range(Q) if (bool(tree_mask[b if tree_mask.shape[0] > 1 else 0, i, j])
                                                  if tree_mask is not None else j <= i)
                     and n0 + j >= int(window_start[b, i])]
            for h in range(Hq):
                keys, vals = k[b, seen, h // G].double(), v[b, seen, h // G].double()
                w = torch.softmax(keys @ q[b, i, h].double() * scale, 0)
                out[b, i, h] = w @ vals
    return out
