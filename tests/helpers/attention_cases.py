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
