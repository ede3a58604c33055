"""Fused speculative rejection sampling: one launch for the whole batch (one program per row).

Per row the program walks the draft positions in order, each over vocab tiles: an online
max / sum / argmax of the tempered target logits (never materializing p), then the
accept test for the draft token. At the first rejection (or at num_draft, for the bonus)
one more pass samples from norm(max(p - q, 0)) (or p) by the exponential race
argmax(r / E), with E from the counter-based hash: the same numbers as the torch
reference (`reference.rejection_sample_ref`, the spec), no generator state, graph-safe.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from ._rng import counter_uniform, stream_key
from .reference import STREAM_ACCEPT, STREAM_SAMPLE

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _tile_stats(row_ptr, V, t_eff, LIVE, BLOCK_V: tl.constexpr):
    """max, sum(exp(x - max)) and first argmax of x = logits / T over a vocab row."""
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), tl.float32)
    best = tl.full((), float("-inf"), tl.float32)
    arg = tl.zeros((), tl.int64)
    for v0 in range(0, tl.where(LIVE, V, 0), BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32) / t_eff
        tmax = tl.max(x, 0)
        targ = tl.argmax(x, 0).to(tl.int64) + v0
        better = tmax > best
        arg = tl.where(better, targ, arg)
        best = tl.where(better, tmax, best)
        m_new = tl.maximum(m, tmax)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe), 0)
        m = m_new
    return m, s, arg


@triton.jit
def _rejection_sample_kernel(
    logits_ptr, drafts_ptr, q_ptr, num_draft_ptr, temp_ptr, seed_ptr, offset_ptr, out_ptr, n_acc_ptr,
    s_lb, s_lk, s_db, s_dk, s_qb, s_qk, s_ob,
    K, V, KEY_ACCEPT, KEY_SAMPLE,
    HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    b = tl.program_id(0)
    row = b.to(tl.int64)
    logits_row = logits_ptr + row * s_lb
    nd = tl.load(num_draft_ptr + b).to(tl.int32)
    temp = tl.load(temp_ptr + b).to(tl.float32)
    greedy = temp <= 0
    t_eff = tl.where(greedy, 1.0, temp)
    seed = tl.load(seed_ptr + b).to(tl.int64)
    offset = tl.load(offset_ptr).to(tl.int64)

    n_acc = tl.zeros((), tl.int32)
    done = nd < 0  # False, as a tensor
    m_end = tl.full((), float("-inf"), tl.float32)
    s_end = tl.zeros((), tl.float32)
    arg_end = tl.zeros((), tl.int64)
    # ---- accept / reject draft positions in order; stop reading logits after a rejection
    for i in range(0, K):
        live = (i < nd) & (done == 0)
        m, s, arg = _tile_stats(logits_row + i * s_lk, V, t_eff, live, BLOCK_V)
        x = tl.load(drafts_ptr + row * s_db + i * s_dk)
        x = tl.minimum(tl.maximum(x, 0), V - 1)
        p_x = tl.exp(tl.load(logits_row + i * s_lk + x).to(tl.float32) / t_eff - m) / s
        if HAS_Q:
            q_x = tl.load(q_ptr + row * s_qb + i * s_qk + x).to(tl.float32)
        else:
            q_x = 1.0
        u = counter_uniform(seed, offset, row, tl.full((), i, tl.int64), tl.zeros((), tl.int64), KEY_ACCEPT)
        ok = live & tl.where(greedy, x == arg, u * q_x < p_x)
        rejected_here = live & (ok == 0)
        n_acc += ok.to(tl.int32)
        m_end = tl.where(rejected_here, m, m_end)
        s_end = tl.where(rejected_here, s, s_end)
        arg_end = tl.where(rejected_here, arg, arg_end)
        done = done | rejected_here

    # ---- the bonus position (all num_draft accepted) still needs its statistics
    end_row = logits_row + n_acc * s_lk
    m_b, s_b, arg_b = _tile_stats(end_row, V, t_eff, done == 0, BLOCK_V)
    m_end = tl.where(done, m_end, m_b)
    s_end = tl.where(done, s_end, s_b)
    arg_end = tl.where(done, arg_end, arg_b)

    # ---- sample the corrected / bonus token: argmax(r / E), E ~ Exp(1)
    j_q = tl.minimum(n_acc, K - 1)
    x_end = tl.load(drafts_ptr + row * s_db + j_q * s_dk, mask=j_q >= 0, other=-1)
    best_r = tl.full((), -1.0, tl.float32)
    idx_r = tl.zeros((), tl.int64)
    best_p = tl.full((), -1.0, tl.float32)
    idx_p = tl.zeros((), tl.int64)
    for v0 in range(0, tl.where(greedy, 0, V), BLOCK_V):
        offs = v0 + tl.arange(0, BLOCK_V)
        inb = offs < V
        x = tl.load(end_row + offs, mask=inb, other=float("-inf")).to(tl.float32) / t_eff
        p = tl.exp(x - m_end) / s_end
        if HAS_Q:
            qv = tl.load(q_ptr + row * s_qb + j_q * s_qk + offs, mask=inb, other=0.0).to(tl.float32)
        else:
            qv = (offs == x_end).to(tl.float32)
        r = tl.where(done, tl.maximum(p - qv, 0.0), p)
        u = counter_uniform(seed, offset, row, n_acc.to(tl.int64), offs.to(tl.int64), KEY_SAMPLE)
        e = -tl.log(u)
        sr = tl.where(inb, r / e, -1.0)
        sp = tl.where(inb, p / e, -1.0)
        tr, ar = tl.max(sr, 0), tl.argmax(sr, 0).to(tl.int64) + v0
        tp, ap = tl.max(sp, 0), tl.argmax(sp, 0).to(tl.int64) + v0
        idx_r = tl.where(tr > best_r, ar, idx_r)
        best_r = tl.maximum(tr, best_r)
        idx_p = tl.where(tp > best_p, ap, idx_p)
        best_p = tl.maximum(tp, best_p)
    sampled = tl.where(best_r > 0, idx_r, idx_p)  # an all-zero residual falls back to p
    final = tl.where(greedy, arg_end, sampled)

    # ---- accepted drafts, then the final token, then -1
    k = tl.arange(0, BLOCK_K)
    d = tl.load(drafts_ptr + row * s_db + k * s_dk, mask=k < K, other=-1)
    out = tl.where(k < n_acc, d, tl.where(k == n_acc, final, -1))
    tl.store(out_ptr + row * s_ob + k, out, mask=k < K + 1)
    tl.store(n_acc_ptr + b, n_acc)


def rejection_sample(target_logits, draft_tokens, draft_probs, num_draft, temperature, seed, offset,
                     block_v: int | None = None):
    """Triton version of `reference.rejection_sample_ref` (same contract, same random numbers)."""
    B, K1, V = target_logits.shape
    K = K1 - 1
    if draft_tokens.shape != (B, K):
        raise ValueError(f"draft_tokens must be [B={B}, K={K}], got {tuple(draft_tokens.shape)}")
    if draft_probs is not None and draft_probs.shape != (B, K, V):
        raise ValueError(f"draft_probs must be [B, K, V]={B, K, V}, got {tuple(draft_probs.shape)}")
    logits = target_logits if target_logits.stride(-1) == 1 else target_logits.contiguous()
    drafts = draft_tokens.to(torch.int64)
    q = draft_probs if draft_probs is None or draft_probs.stride(-1) == 1 else draft_probs.contiguous()
    out = torch.empty(B, K1, dtype=torch.int64, device=logits.device)
    n_acc = torch.empty(B, dtype=torch.int32, device=logits.device)
    if block_v is None:
        block_v = 256 if _INTERPRET else 2048
    q_arg = q if q is not None else logits  # never read when HAS_Q is False
    _rejection_sample_kernel[(B,)](
        logits, drafts, q_arg, num_draft.to(torch.int32), temperature.to(torch.float32),
        seed.to(torch.int64), offset.to(torch.int64), out, n_acc,
        logits.stride(0), logits.stride(1), drafts.stride(0), drafts.stride(1) if K else 1,
        q_arg.stride(0), q_arg.stride(1), out.stride(0),
        K, V, stream_key(STREAM_ACCEPT), stream_key(STREAM_SAMPLE),
        HAS_Q=q is not None and K > 0, BLOCK_V=block_v, BLOCK_K=triton.next_power_of_2(K1),
        num_warps=8 if block_v >= 2048 else 4,
    )
    return out, n_acc
