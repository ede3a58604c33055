"""The baselines the attention benchmarks compare against, kept free of pytest: bench/gpu_kernels.py
(and through it the GPU command, scripts/gpu_run.sh) imports them on a machine that may not have it."""
import torch
import torch.nn.functional as F

from specengine.methods.token_tree import ancestor_mask


def sdpa(q, k, v, lens, tree_mask=None):
    """SDPA over the whole cache with an explicit boolean mask (what a user would write)."""
    B, Q, Hq, _ = q.shape
    S = k.shape[1]
    s = torch.arange(S, device=q.device)
    rel = s[None, None, :] - lens.long()[:, None, None]
    if tree_mask is None:
        mask = rel <= torch.arange(Q, device=q.device)[None, :, None]
    else:
        tm = torch.gather(tree_mask.expand(B, Q, Q), 2, rel.clamp(0, Q - 1).expand(B, Q, S))
        mask = (rel < 0) | ((rel < Q) & tm)
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                          attn_mask=mask[:, None], enable_gqa=Hq != k.shape[2]).transpose(1, 2)


def binary_tree_mask(nodes: int, device) -> torch.Tensor:
    """[1,N,N] ancestor mask of a binary tree: node i's parent is (i - 1) // 2."""
    parent = torch.tensor([[-1] + [(i - 1) // 2 for i in range(1, nodes)]], device=device)
    return ancestor_mask(parent)
