"""Fused speculative rejection sampling: one launch for the whole batch.

A program takes BLOCK_B rows (one row for large vocabularies). Per row it walks the draft
positions in order, each over vocab tiles: an online
max / sum / argmax of the target logits (never materializing p), then the
accept test for the draft token. At the first rejection (or at num_draft, for the bonus)
one more pass samples from norm(max(p - q, 0)) (or p) by the exponential race
argmax(r / E), with E from the counter-based hash: the same numbers as the torch
reference (`reference.rejection_sample_ref`, the spec), no generator state, graph-safe.
Small batches on a GPU split each row's vocabulary across programs instead
(`rejection_sampling_split.py`); the jit helpers both share are in `sampler_jit.py`.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .rejection_sampling_split import rejection_sample_split
from .rng import STREAM_ACCEPT, STREAM_SAMPLE, row_offsets
from .rng_triton import stream_key
from .sampler_jit import _accept, _end_draft, _race, _row_params, _row_stats, _write_tokens

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _rejection_sample_kernel(
    logits_ptr, drafts_ptr, q_ptr, num_draft_ptr, temp_ptr, seed_ptr, offset_ptr, out_ptr, n_acc_ptr,
    B, s_lb, s_lk, s_db, s_dk, s_qb, s_qk, s_ob,
    K, V, KEY_ACCEPT, KEY_SAMPLE,
    HAS_Q: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Whole rows per program (the large-batch path)."""
    rows = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    row_ok = rows < B
    nd, greedy, t_eff, seed, offset = _row_params(rows, row_ok, num_draft_ptr, temp_ptr, seed_ptr, offset_ptr)
    logits_rows = logits_ptr + rows * s_lb

    n_acc = tl.zeros((BLOCK_B,), tl.int32)
    done = rows < 0  # all False
    m_end = tl.full((BLOCK_B,), float("-inf"), tl.float32)
    s_end = tl.zeros((BLOCK_B,), tl.float32)
    arg_end = tl.zeros((BLOCK_B,), tl.int64)
    # ---- accept / reject the draft positions in order; rows stop reading after a rejection
    for i in range(0, K):
        live = row_ok & (i < nd) & (done == 0)
        m, s, arg = _row_stats(logits_rows + i * s_lk, 0, V, t_eff, live, BLOCK_V)
        ok = _accept(logits_rows, drafts_ptr, q_ptr, rows, row_ok, i, live, m, s, arg, greedy, t_eff, seed, offset,
                     s_lk, s_db, s_dk, s_qb, s_qk, V, KEY_ACCEPT, HAS_Q)
        rejected_here = live & (ok == 0)
        n_acc += ok.to(tl.int32)
        m_end = tl.where(rejected_here, m, m_end)
        s_end = tl.where(rejected_here, s, s_end)
        arg_end = tl.where(rejected_here, arg, arg_end)
        done = done | rejected_here

    # ---- rows that accepted all num_draft still need the bonus position's statistics
    end_rows = logits_rows + n_acc * s_lk
    m_b, s_b, arg_b = _row_stats(end_rows, 0, V, t_eff, row_ok & (done == 0), BLOCK_V)
    m_end = tl.where(done, m_end, m_b)
    s_end = tl.where(done, s_end, s_b)
    arg_end = tl.where(done, arg_end, arg_b)

    # ---- sample the corrected / bonus token: argmax(r / E), E ~ Exp(1); greedy rows skip it
    j_q, x_end = _end_draft(drafts_ptr, rows, row_ok, n_acc, s_db, s_dk, K)
    sampling = row_ok & (greedy == 0)
    m_end = tl.where(sampling, m_end, 0.0)  # rows that do not sample: keep the math finite
    s_end = tl.where(sampling, s_end, 1.0)
    best_r, idx_r, best_p, idx_p = _race(end_rows, rows, 0, V, sampling, done, n_acc, j_q, x_end, m_end, s_end,
                                         t_eff, seed, offset, q_ptr, s_qb, s_qk, KEY_SAMPLE, HAS_Q, BLOCK_V)
    sampled = tl.where(best_r > 0, idx_r, idx_p)  # an all-zero residual falls back to p
    _write_tokens(out_ptr, drafts_ptr, rows, row_ok, n_acc, tl.where(greedy, arg_end, sampled),
                  s_db, s_dk, s_ob, K, BLOCK_K)
    tl.store(n_acc_ptr + rows, n_acc, mask=row_ok)


def _num_splits(rows: int, V: int, block_v: int, device: torch.device) -> int:
    """Vocab splits per row: 1 (whole rows per program) once the batch alone fills the GPU,
    else enough programs for about two waves over the SMs."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if rows >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, rows), triton.cdiv(V, block_v)))


def rejection_sample(target_logits, draft_tokens, draft_probs, num_draft, temperature, seed, offset,
                     block_v: int | None = None, block_b: int | None = None, num_splits: int | None = None):
    """Triton version of `reference.rejection_sample_ref` (same contract, same random numbers).

    num_splits: vocab chunks per row (None: chosen from the batch size and the GPU; 1 = the
    one-kernel path; > 1 = `rejection_sampling_split`). Both give the same tokens.
    """
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
    num_draft, temperature = num_draft.to(torch.int32), temperature.to(torch.float32)
    seed, offset = seed.to(torch.int64), row_offsets(offset, B).contiguous()
    keys = stream_key(STREAM_ACCEPT), stream_key(STREAM_SAMPLE)
    # Large vocabularies: one row per program, wide vocab tiles. Tiny vocabularies (and the
    # interpreter, which runs programs one by one): many rows per program, in tiles of at
    # most 512 elements on a GPU (larger multi-row tiles spill: the int64 hash is heavy).
    tile = 8192 if _INTERPRET else 2048  # elements per vocab tile of one row
    row_tile = 8192 if _INTERPRET else 512  # elements per [BLOCK_B, BLOCK_V] tile, BLOCK_B > 1
    if block_v is None:
        block_v = min(triton.next_power_of_2(V), tile)
    splits = num_splits or _num_splits(B, V, block_v, logits.device)
    if splits > 1:
        return rejection_sample_split(logits, drafts, q, num_draft, temperature, seed, offset, out, n_acc, keys,
                                      splits, block_v)
    if block_b is None:
        block_b = max(1, min(triton.next_power_of_2(B), row_tile // block_v, 1024))
    q_arg = q if q is not None else logits  # never read when HAS_Q is False
    _rejection_sample_kernel[(triton.cdiv(B, block_b),)](
        logits, drafts, q_arg, num_draft, temperature, seed, offset, out, n_acc,
        B, logits.stride(0), logits.stride(1), drafts.stride(0), drafts.stride(1) if K else 1,
        q_arg.stride(0), q_arg.stride(1), out.stride(0),
        K, V, *keys,
        HAS_Q=q is not None and K > 0, BLOCK_B=block_b, BLOCK_V=block_v, BLOCK_K=triton.next_power_of_2(K1),
        num_warps=8 if block_v >= 2048 else 4,
    )
    return out, n_acc
