"""Plain-PyTorch references of the kernels: the specification and the CPU fallback.

Contracts (docs/design.md, "Kernel contracts"):
  verify_attention(q[B,Q,Hq,D], k_cache[B,S,Hkv,D], v_cache, cache_lens[B] int32,
                   tree_mask=None | [B|1,Q,Q] bool, sm_scale=None) -> [B,Q,Hq,D]
  rejection_sample(target_logits[B,K+1,V], draft_tokens[B,K], draft_probs[B,K,V] | None,
                   num_draft[B], temperature[B], seed[B], offset[B] | []) -> (tokens[B,K+1], n_acc[B])
  commit_tokens(tokens[B,S], n[B], offset[B], active[B] bool, out_tokens[B,W], n_new[B]) -> None (in place)

The sampler's random numbers come from the counter-based generator in `rng.py`, which
the Triton kernel reproduces bit for bit.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .rng import STREAM_ACCEPT, STREAM_SAMPLE, categorical_from_counter, counter_uniform, row_offsets


def verify_attention_ref(q, k_cache, v_cache, cache_lens, tree_mask=None, sm_scale=None):
    """Q new tokens per row attend to the cache prefix and (chain or tree) to each other.

    The new tokens' K/V must already be written at cache_lens[b] + j. Only the first
    `k_cache.shape[1]` positions are read, so callers may pass a prefix view.
    """
    B, Q, Hq, D = q.shape
    L = k_cache.shape[1]
    s = torch.arange(L, device=q.device)
    lens = cache_lens.to(torch.long)[:, None, None]  # [B,1,1]
    rel = s[None, None, :] - lens  # [B,1,L] position relative to the first new token
    if tree_mask is None:
        i = torch.arange(Q, device=q.device)[None, :, None]
        mask = rel <= i  # cached prefix (rel < 0) plus the causal chain
    else:
        tm = tree_mask.to(torch.bool).expand(B, Q, Q)
        in_new = (rel >= 0) & (rel < Q)
        gathered = torch.gather(tm, 2, rel.clamp(0, Q - 1).expand(B, Q, L))
        mask = (rel < 0) | (in_new & gathered)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
        attn_mask=mask[:, None], scale=sm_scale, enable_gqa=Hq != k_cache.shape[2],
    )
    return out.transpose(1, 2)


def tempered_softmax(logits: torch.Tensor, temperature) -> torch.Tensor:
    """softmax(logits / T) over the last dim in fp32, as softmax((l - max) / T): the same
    distribution, but finite for every T > 0 (l / T overflows fp32 when T is tiny). The
    Triton samplers compute it the same way. temperature: a number, or a tensor that
    broadcasts against logits[..., :1]."""
    x = logits.float()
    m = x.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))  # a fully masked row stays masked
    return torch.softmax((x - m) / temperature, dim=-1)


def rejection_sample_ref(target_logits, draft_tokens, draft_probs, num_draft, temperature, seed, offset):
    """Speculative rejection sampling for a batch; lossless w.r.t. softmax(target_logits / T).

    Accept draft x_i with prob min(1, p_i(x_i)/q_i(x_i)); at the first rejection sample from
    norm(max(p_i - q_i, 0)); if all num_draft[b] are accepted sample the bonus from p_{num_draft}.
    Temperature 0: accept iff x_i == argmax p_i and the correction is argmax p_i.
    """
    B, K1, V = target_logits.shape
    K = K1 - 1
    dev = target_logits.device
    rows = torch.arange(B, device=dev)
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature).float()
    logits = target_logits.float()
    p = tempered_softmax(logits, temp[:, None, None])  # [B,K+1,V]
    num_draft = num_draft.to(torch.long)
    pos = torch.arange(K, device=dev)
    tokens = draft_tokens.clamp(0, V - 1)

    # --- accept / reject every draft position at once
    p_x = p[:, :K].gather(-1, tokens[..., None]).squeeze(-1)
    q_x = torch.ones_like(p_x) if draft_probs is None else \
        draft_probs.float().gather(-1, tokens[..., None]).squeeze(-1)
    offset = row_offsets(offset, B)
    u = counter_uniform(seed[:, None], offset[:, None], pos[None, :], 0, STREAM_ACCEPT)
    ok_sample = u * q_x < p_x
    ok_greedy = tokens == logits[:, :K].argmax(-1)
    ok = torch.where(greedy[:, None], ok_greedy, ok_sample) & (pos[None, :] < num_draft[:, None])
    n_acc = torch.cumprod(ok.long(), dim=1).sum(1) if K > 0 else torch.zeros(B, dtype=torch.long, device=dev)

    # --- one corrected (residual) or bonus token at position n_acc
    at = n_acc[:, None, None].expand(B, 1, V)
    p_end = p.gather(1, at).squeeze(1)  # [B,V]
    rejected = n_acc < num_draft
    if K > 0:
        at_q = n_acc.clamp(max=K - 1)
        if draft_probs is None:
            q_end = F.one_hot(tokens[rows, at_q], V).float()
        else:
            q_end = draft_probs.float()[rows, at_q]
        resid = torch.where(rejected[:, None], (p_end - q_end).clamp_min(0), p_end)
        resid = torch.where(resid.sum(-1, keepdim=True) > 0, resid, p_end)
    else:
        resid = p_end
    sampled = categorical_from_counter(resid, seed, offset, n_acc, STREAM_SAMPLE)
    argmax = logits.gather(1, at).squeeze(1).argmax(-1)
    last = torch.where(greedy, argmax, sampled)

    out = torch.where(pos[None, :] < n_acc[:, None], draft_tokens, torch.full_like(draft_tokens, -1))
    out = torch.cat([out, torch.full((B, 1), -1, dtype=out.dtype, device=dev)], dim=1)
    out.scatter_(1, n_acc[:, None], last[:, None])
    return out, n_acc.to(torch.int32)


INVARIANT_TILE = 256  # cache positions per step of the fixed-tile attention below


def verify_attention_tiled(q, k_cache, v_cache, cache_lens, tree_mask=None, sm_scale=None, tile=INVARIANT_TILE):
    """`verify_attention_ref`'s contract, computed so that a query's result does not depend on
    how many positions are read (`k_cache.shape[1]`) or how many queries share the call:
    fp32 online softmax over fixed tiles of `tile` positions from position 0 (the last tile
    zero-padded to full size: every matmul has the same shape), queries of a KV head packed
    as rows. Masked tiles change nothing exactly (max and sum unchanged, weights 0).
    Batch-invariant mode uses it (docs/design.md, "Batch-invariant mode")."""
    B, Q, Hq, D = q.shape
    L, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    scale = sm_scale if sm_scale is not None else D ** -0.5
    qf = q.float().reshape(B, Q, Hkv, G, D).permute(0, 2, 1, 3, 4).reshape(B, Hkv, Q * G, D) * scale
    qi = torch.arange(Q, device=q.device).repeat_interleave(G)  # query index of each packed row
    lens = cache_lens.to(torch.long)[:, None, None, None]
    m = torch.full((B, Hkv, Q * G), float("-inf"), device=q.device)
    l_sum = torch.zeros(B, Hkv, Q * G, device=q.device)
    acc = torch.zeros(B, Hkv, Q * G, D, device=q.device)
    tm = None if tree_mask is None else tree_mask.to(torch.bool).expand(B, Q, Q)
    for s0 in range(0, L, tile):
        kt, vt = k_cache[:, s0:s0 + tile], v_cache[:, s0:s0 + tile]
        if kt.shape[1] < tile:  # same shapes for every tile
            kt = F.pad(kt, (0, 0, 0, 0, 0, tile - kt.shape[1]))
            vt = F.pad(vt, (0, 0, 0, 0, 0, tile - vt.shape[1]))
        kt, vt = kt.float().permute(0, 2, 3, 1), vt.float().permute(0, 2, 1, 3)  # [B,Hkv,D,t], [B,Hkv,t,D]
        s = qf @ kt  # [B,Hkv,QG,t]
        rel = torch.arange(s0, s0 + tile, device=q.device)[None, None, None, :] - lens  # [B,1,1,t]
        if tm is None:
            visible = rel <= qi[None, None, :, None]
        else:
            j = rel.clamp(0, Q - 1).expand(B, 1, Q * G, tile)
            rows = tm[:, qi][:, None].expand(B, 1, Q * G, Q)
            visible = (rel < 0) | ((rel < Q) & torch.gather(rows, 3, j))
        visible = visible & (rel < Q)  # positions past the new tokens (and the padding) never count
        s = s.masked_fill(~visible, float("-inf"))
        m_new = torch.maximum(m, s.amax(-1))
        m_safe = torch.where(m_new == float("-inf"), torch.zeros_like(m_new), m_new)
        p = torch.exp(s - m_safe[..., None])
        alpha = torch.exp(m - m_safe)
        l_sum = l_sum * alpha + p.sum(-1)
        acc = acc * alpha[..., None] + p @ vt
        m = m_new
    out = acc / l_sum[..., None]
    return out.reshape(B, Hkv, Q, G, D).permute(0, 2, 1, 3, 4).reshape(B, Q, Hq, D).to(q.dtype)


def commit_tokens_ref(tokens, n, offset, active, out_tokens, n_new) -> None:
    """Append out_tokens[b, :n_new[b]] to each active row of tokens at n[b] (positions clamp to
    the last slot), advance n by what an active row kept, and every row's offset by one."""
    width = out_tokens.shape[1]
    j = torch.arange(width, device=out_tokens.device)[None, :]
    idx = (n[:, None] + j).clamp(max=tokens.shape[1] - 1)
    keep = (j < n_new.to(torch.int64)[:, None]) & active[:, None]
    tokens.scatter_(1, idx, torch.where(keep, out_tokens, tokens.gather(1, idx)))
    n += n_new.to(torch.int64) * active
    offset += 1
