"""Speculative rejection sampling: the torch reference (the spec and the CPU path) and its
Triton kernels, one launch for a large batch, four short ones for a small one.

Contract (docs/design.md, "Kernel contracts"):
  rejection_sample(target_logits[B,K+1,V], draft_tokens[B,K], draft_probs[B,K,V] | None,
                   num_draft[B], temperature[B], seed[B], offset[B] | []) -> (tokens[B,K+1], n_acc[B])
Lossless w.r.t. softmax(target_logits / T); the random numbers are the counter-based hash
(`rng.py`, `jit.py` in Triton): no generator state, graph-safe, the same draws on both paths.

One kernel (large batches): a program takes BLOCK_B rows (one row for large vocabularies).
Per row it walks the draft positions in order, each over vocab tiles: an online max / sum /
argmax of the target logits (never materializing p), then the accept test for the draft
token. At the first rejection (or at num_draft, for the bonus) one more pass samples from
norm(max(p - q, 0)) (or p) by the exponential race argmax(r / E).

Split vocabulary (small batches on a GPU): the one-kernel path gives a program whole rows,
so at B = 1 one program sweeps (K+2) x V logits while the rest of the GPU idles. Here four
short launches share the work, two-pass reductions in between:

  1. stats    grid (B*(K+1), splits): max / sum / first argmax of each vocab chunk
  2. accept   grid (B / BLOCK_B): combine the chunks per position, run the accept tests in
              order, pick the end position (first rejection, or the bonus)
  3. race     grid (B, splits): the exponential race over each chunk at the end position
  4. finalize grid (B / BLOCK_B): combine the races (max; first index on ties), write tokens

Chunks are in vocabulary order, so "first index among the chunk maxima" is the first index
overall: the tokens are those of the one-kernel path and of the torch reference on the same
random numbers. No host sync, fixed shapes: graph-capturable.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from .jit import _accept, _end_draft, _race, _row_params, _row_stats, _write_tokens, needs_triton, stream_key, tl, \
    triton
from .rng import STREAM_ACCEPT, STREAM_SAMPLE, categorical_from_counter, counter_uniform, row_offsets, \
    tempered_softmax

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def rejection_sample_greedy(target_logits, draft_tokens, num_draft):
    """`rejection_sample_ref` when every row is greedy: accept x_i iff it is argmax p_i, then argmax
    p at the first mismatch (or the bonus). No softmax and no random numbers over the vocabulary,
    which cost a CPU decode step ~5 ms at a 152k vocabulary."""
    B, K1, V = target_logits.shape
    K = K1 - 1
    argmax = target_logits.argmax(-1)  # [B,K+1]
    pos = torch.arange(K, device=target_logits.device)
    ok = (draft_tokens.clamp(0, V - 1) == argmax[:, :K]) & (pos[None, :] < num_draft.to(torch.long)[:, None])
    n_acc = torch.cumprod(ok.long(), dim=1).sum(1) if K > 0 else torch.zeros(B, dtype=torch.long,
                                                                                device=target_logits.device)
    out = torch.where(pos[None, :] < n_acc[:, None], draft_tokens, torch.full_like(draft_tokens, -1))
    out = torch.cat([out, torch.full((B, 1), -1, dtype=out.dtype, device=out.device)], dim=1)
    out.scatter_(1, n_acc[:, None], argmax.gather(1, n_acc[:, None]).to(out.dtype))
    return out, n_acc.to(torch.int32)


def rejection_sample_ref(target_logits, draft_tokens, draft_probs, num_draft, temperature, seed, offset):
    """Speculative rejection sampling for a batch; lossless w.r.t. softmax(target_logits / T).

    Accept draft x_i with prob min(1, p_i(x_i)/q_i(x_i)); at the first rejection sample from
    norm(max(p_i - q_i, 0)); if all num_draft[b] are accepted sample the bonus from p_{num_draft}.
    Temperature 0: accept iff x_i == argmax p_i and the correction is argmax p_i. On a CPU (where
    reading the temperatures costs no device sync) an all-greedy batch takes
    `rejection_sample_greedy`, the same tokens without the sampling half.
    """
    if temperature.device.type == "cpu" and not torch.compiler.is_compiling() and bool((temperature <= 0).all()):
        return rejection_sample_greedy(target_logits, draft_tokens, num_draft)
    return rejection_sample_any(target_logits, draft_tokens, draft_probs, num_draft, temperature, seed, offset)


def rejection_sample_any(target_logits, draft_tokens, draft_probs, num_draft, temperature, seed, offset):
    """`rejection_sample_ref` for any mix of greedy and sampled rows (every device)."""
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


# ---------------------------------------------------------------- one kernel (large batches)
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



# ---------------------------------------------------------------- split vocabulary (small batches)
_BIG = tl.constexpr(2**62)  # larger than any vocabulary index


@triton.jit
def _split_stats_kernel(logits_ptr, num_draft_ptr, temp_ptr, m_part, s_part, a_part, s_lb, s_lk, K1, V, NSPLIT,
                        CHUNK, BLOCK_V: tl.constexpr):
    rc = tl.program_id(0).to(tl.int64)  # b * (K+1) + position
    sp = tl.program_id(1)
    b = rc // K1
    i = (rc % K1).to(tl.int32)
    one = tl.zeros((1,), tl.int64)
    nd = tl.load(num_draft_ptr + b + one).to(tl.int32)
    temp = tl.load(temp_ptr + b + one).to(tl.float32)
    t_eff = tl.where(temp <= 0, 1.0, temp)
    v0 = sp * CHUNK
    live = i <= nd  # positions past the bonus are never read
    m, s, arg = _row_stats(logits_ptr + b * s_lb + i * s_lk + one, v0, tl.minimum(v0 + CHUNK, V), t_eff, live,
                           BLOCK_V)
    at = rc * NSPLIT + sp + one
    tl.store(m_part + at, m)
    tl.store(s_part + at, s)
    tl.store(a_part + at, arg)


@triton.jit
def _combine_stats(m_part, s_part, a_part, rc, live, t_eff, NSPLIT, NS_P: tl.constexpr):
    """Per row: (max m, sum(exp((l - m) / T)), first argmax) over the chunks of row-position rc."""
    j = tl.arange(0, NS_P)[None, :]
    ok = live[:, None] & (j < NSPLIT)
    at = rc[:, None] * NSPLIT + j
    mj = tl.load(m_part + at, mask=ok, other=float("-inf"))
    m = tl.max(mj, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(tl.load(s_part + at, mask=ok, other=0.0) * tl.exp((mj - m_safe[:, None]) / t_eff[:, None]), 1)
    arg = tl.min(tl.where(ok & (mj == m[:, None]), tl.load(a_part + at, mask=ok, other=0), _BIG), 1)
    return m, s, tl.where(arg == _BIG, 0, arg)


@triton.jit
def _split_accept_kernel(
    logits_ptr, drafts_ptr, q_ptr, num_draft_ptr, temp_ptr, seed_ptr, offset_ptr, n_acc_ptr,
    m_part, s_part, a_part, end_ptr, end_arg_ptr,
    B, s_lb, s_lk, s_db, s_dk, s_qb, s_qk, K, V, NSPLIT, KEY_ACCEPT,
    HAS_Q: tl.constexpr, BLOCK_B: tl.constexpr, NS_P: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    row_ok = rows < B
    nd, greedy, t_eff, seed, offset = _row_params(rows, row_ok, num_draft_ptr, temp_ptr, seed_ptr, offset_ptr)
    logits_rows = logits_ptr + rows * s_lb
    n_acc = tl.zeros((BLOCK_B,), tl.int32)
    done = rows < 0
    for i in range(0, K):
        live = row_ok & (i < nd) & (done == 0)
        m, s, arg = _combine_stats(m_part, s_part, a_part, rows * (K + 1) + i, live, t_eff, NSPLIT, NS_P)
        ok = _accept(logits_rows, drafts_ptr, q_ptr, rows, row_ok, i, live, m, s, arg, greedy, t_eff, seed, offset,
                     s_lk, s_db, s_dk, s_qb, s_qk, V, KEY_ACCEPT, HAS_Q)
        n_acc += ok.to(tl.int32)
        done = done | (live & (ok == 0))
    # the end position's statistics, whether it is a rejection or the bonus
    m, s, arg = _combine_stats(m_part, s_part, a_part, rows * (K + 1) + n_acc, row_ok, t_eff, NSPLIT, NS_P)
    tl.store(n_acc_ptr + rows, n_acc, mask=row_ok)
    tl.store(end_ptr + rows * 3 + 0, done.to(tl.float32), mask=row_ok)
    tl.store(end_ptr + rows * 3 + 1, m, mask=row_ok)
    tl.store(end_ptr + rows * 3 + 2, s, mask=row_ok)
    tl.store(end_arg_ptr + rows, arg, mask=row_ok)


@triton.jit
def _split_race_kernel(
    logits_ptr, drafts_ptr, q_ptr, num_draft_ptr, temp_ptr, seed_ptr, offset_ptr, n_acc_ptr, end_ptr,
    br_part, ir_part, bp_part, ip_part,
    s_lb, s_lk, s_db, s_dk, s_qb, s_qk, K, V, NSPLIT, CHUNK, KEY_SAMPLE,
    HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) + tl.zeros((1,), tl.int64)
    sp = tl.program_id(1)
    row_ok = rows >= 0
    _, greedy, t_eff, seed, offset = _row_params(rows, row_ok, num_draft_ptr, temp_ptr, seed_ptr, offset_ptr)
    n_acc = tl.load(n_acc_ptr + rows)
    done = tl.load(end_ptr + rows * 3 + 0) != 0
    sampling = greedy == 0
    m_end = tl.where(sampling, tl.load(end_ptr + rows * 3 + 1), 0.0)
    s_end = tl.where(sampling, tl.load(end_ptr + rows * 3 + 2), 1.0)
    j_q, x_end = _end_draft(drafts_ptr, rows, row_ok, n_acc, s_db, s_dk, K)
    v0 = sp * CHUNK
    best_r, idx_r, best_p, idx_p = _race(logits_ptr + rows * s_lb + n_acc * s_lk, rows, v0, tl.minimum(v0 + CHUNK, V),
                                         sampling, done, n_acc, j_q, x_end, m_end, s_end, t_eff, seed, offset,
                                         q_ptr, s_qb, s_qk, KEY_SAMPLE, HAS_Q, BLOCK_V)
    at = rows * NSPLIT + sp
    tl.store(br_part + at, best_r)
    tl.store(ir_part + at, idx_r)
    tl.store(bp_part + at, best_p)
    tl.store(ip_part + at, idx_p)


@triton.jit
def _first_max(best_part, idx_part, rows, row_ok, NSPLIT, NS_P: tl.constexpr):
    j = tl.arange(0, NS_P)[None, :]
    ok = row_ok[:, None] & (j < NSPLIT)
    at = rows[:, None] * NSPLIT + j
    bj = tl.load(best_part + at, mask=ok, other=-2.0)
    best = tl.max(bj, 1)
    idx = tl.min(tl.where(ok & (bj == best[:, None]), tl.load(idx_part + at, mask=ok, other=0), _BIG), 1)
    return best, idx


@triton.jit
def _split_finalize_kernel(
    drafts_ptr, temp_ptr, n_acc_ptr, end_arg_ptr, br_part, ir_part, bp_part, ip_part, out_ptr,
    B, s_db, s_dk, s_ob, K, NSPLIT, BLOCK_B: tl.constexpr, NS_P: tl.constexpr, BLOCK_K: tl.constexpr,
):
    rows = (tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)).to(tl.int64)
    row_ok = rows < B
    greedy = tl.load(temp_ptr + rows, mask=row_ok, other=0.0) <= 0
    n_acc = tl.load(n_acc_ptr + rows, mask=row_ok, other=0)
    arg_end = tl.load(end_arg_ptr + rows, mask=row_ok, other=0)
    best_r, idx_r = _first_max(br_part, ir_part, rows, row_ok, NSPLIT, NS_P)
    _, idx_p = _first_max(bp_part, ip_part, rows, row_ok, NSPLIT, NS_P)
    sampled = tl.where(best_r > 0, idx_r, idx_p)  # an all-zero residual falls back to p
    _write_tokens(out_ptr, drafts_ptr, rows, row_ok, n_acc, tl.where(greedy, arg_end, sampled),
                  s_db, s_dk, s_ob, K, BLOCK_K)


def _launch_split(logits, drafts, q, num_draft, temperature, seed, offset, out, n_acc, keys,
                           splits: int, block_v: int):
    """Launch the four kernels; arguments already validated and laid out by `rejection_sample`."""
    B, K1, V = logits.shape
    K = K1 - 1
    dev = logits.device
    chunk = triton.cdiv(triton.cdiv(V, splits), block_v) * block_v
    splits = triton.cdiv(V, chunk)
    ns_p = triton.next_power_of_2(splits)
    block_b = max(1, min(triton.next_power_of_2(B), max(1, 256 // ns_p), 16))  # <= 256 partials per tile
    m_part = torch.empty(B * K1, splits, dtype=torch.float32, device=dev)
    s_part = torch.empty_like(m_part)
    a_part = torch.empty(B * K1, splits, dtype=torch.int64, device=dev)
    end = torch.empty(B, 3, dtype=torch.float32, device=dev)  # done, max, sum at the end position
    end_arg = torch.empty(B, dtype=torch.int64, device=dev)  # and its first argmax
    br, bp = (torch.empty(B, splits, dtype=torch.float32, device=dev) for _ in range(2))  # race maxima
    ir, ip = (torch.empty(B, splits, dtype=torch.int64, device=dev) for _ in range(2))  # and their indices
    has_q = q is not None and K > 0
    q_arg = q if q is not None else logits
    s_dk = drafts.stride(1) if K else 1
    warps = 8 if block_v >= 2048 else 4
    _split_stats_kernel[(B * K1, splits)](logits, num_draft, temperature, m_part, s_part, a_part,
                                          logits.stride(0), logits.stride(1), K1, V, splits, chunk,
                                          BLOCK_V=block_v, num_warps=warps)
    _split_accept_kernel[(triton.cdiv(B, block_b),)](
        logits, drafts, q_arg, num_draft, temperature, seed, offset, n_acc, m_part, s_part, a_part, end, end_arg,
        B, logits.stride(0), logits.stride(1), drafts.stride(0), s_dk, q_arg.stride(0), q_arg.stride(1),
        K, V, splits, keys[0], HAS_Q=has_q, BLOCK_B=block_b, NS_P=ns_p)
    _split_race_kernel[(B, splits)](
        logits, drafts, q_arg, num_draft, temperature, seed, offset, n_acc, end, br, ir, bp, ip,
        logits.stride(0), logits.stride(1), drafts.stride(0), s_dk, q_arg.stride(0), q_arg.stride(1),
        K, V, splits, chunk, keys[1], HAS_Q=has_q, BLOCK_V=block_v, num_warps=warps)
    _split_finalize_kernel[(triton.cdiv(B, block_b),)](
        drafts, temperature, n_acc, end_arg, br, ir, bp, ip, out, B, drafts.stride(0), s_dk, out.stride(0), K, splits,
        BLOCK_B=block_b, NS_P=ns_p, BLOCK_K=triton.next_power_of_2(K1))
    return out, n_acc


# ---------------------------------------------------------------- launcher
def _num_splits(rows: int, V: int, block_v: int, device: torch.device) -> int:
    """Vocab splits per row: 1 (whole rows per program) once the batch alone fills the GPU,
    else enough programs for about two waves over the SMs."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if rows >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, rows), triton.cdiv(V, block_v)))


@needs_triton
def rejection_sample(target_logits, draft_tokens, draft_probs, num_draft, temperature, seed, offset,
                     block_v: int | None = None, block_b: int | None = None, num_splits: int | None = None):
    """Triton version of `rejection_sample_ref` (same contract, same random numbers).

    num_splits: vocab chunks per row (None: chosen from the batch size and the GPU; 1 = the
    one-kernel path; > 1 = the split path). Both give the same tokens.
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
        return _launch_split(logits, drafts, q, num_draft, temperature, seed, offset, out, n_acc, keys,
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
