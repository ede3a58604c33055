"""Verification attention in Triton: Q new tokens per row against a static KV cache.

Query i of row b sees every cached position < cache_lens[b] and the new positions
cache_lens[b] + j allowed by the chain (j <= i) or by tree_mask[b, i, j]. One program
takes one (row, KV head) and packs the G query heads that share it with the Q queries
into its M rows (GQA: K/V are read once for the group), with an online softmax over KV
tiles. When rows x KV heads cannot fill the GPU the sequence is split across programs
(flash-decoding) and a second small kernel merges the partial softmaxes.
`verify_attention_ref` below is the spec and the CPU path; `verify_attention_tiled` is the
batch-invariant reference (fixed tiles), which `verify_attention_fixed` matches on a GPU;
`row_attention.verify_attention_rows` is the batch-invariant CPU path (compiled, one query row at a time).

Contract (docs/design.md, "Kernel contracts"):
  verify_attention(q[B,Q,Hq,D], k_cache[B,S,Hkv,D], v_cache, cache_lens[B] int32,
                   tree_mask=None | [B|1,Q,Q] bool, sm_scale=None, window=None | [B,Q] int) -> [B,Q,Hq,D]
window (a sliding-window layer, Gemma 3): query i of row b sees no position < window[b, i].
"""
from __future__ import annotations

import math
import os
import warnings

import torch
import torch.nn.functional as F

from .jit import needs_triton, tl, triton

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
_LOG2E = 1.4426950408889634
INVARIANT_TILE = 256  # cache positions per tile of the batch-invariant attention (both paths)


def verify_attention_ref(q, k_cache, v_cache, cache_lens, tree_mask=None, sm_scale=None, window=None):
    """Q new tokens per row attend to the cache prefix and (chain or tree) to each other.

    The new tokens' K/V must already be written at cache_lens[b] + j. Only the first
    `k_cache.shape[1]` positions are read, so callers may pass a prefix view.
    window: None, or int [B, Q]: each query's first visible position (a sliding-window layer:
    its position - window + 1; a tree node's position is its depth's).
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
    if window is not None:
        mask = mask & (s[None, None, :] >= window.to(torch.long)[:, :, None])
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k_cache.transpose(1, 2), v_cache.transpose(1, 2),
        attn_mask=mask[:, None], scale=sm_scale, enable_gqa=Hq != k_cache.shape[2],
    )
    return out.transpose(1, 2)


def verify_attention_tiled(q, k_cache, v_cache, cache_lens, tree_mask=None, sm_scale=None, window=None,
                           tile=INVARIANT_TILE):
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
    lo = None if window is None else window.to(torch.long)[:, qi][:, None, :, None]  # [B,1,QG,1]
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
        if lo is not None:
            visible = visible & (rel + lens >= lo)
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


# (BLOCK_M, BLOCK_N, num_warps) that compile without spilling registers for sm_80 and sm_90 at
# head_dim 128, in every variant (chain/tree, split or not), for 16-bit and for fp32 inputs
# (fp32 runs exact ieee dots on CUDA cores, which hold far more in registers). Found by
# sweeping the compile check; `make compile-check` re-verifies every pair this leaves.
SPILL_FREE = {
    "half": {(16, 16, 4), (16, 32, 8), (16, 64, 8), (64, 16, 8)},
    "fp32": {(16, 16, 8)},
}


def block_m_for(rows: int, dtype: torch.dtype) -> int:
    """Packed query rows per program: the smallest BLOCK_M with a spill-free config that holds
    `rows`, else the largest (16 or 64 for 16-bit inputs, 16 for fp32; see SPILL_FREE). Only
    these, so the autotuner's prune always keeps a config (a BLOCK_M of 32 had none: every
    bf16 step of 17-32 packed rows failed on the first GPU run)."""
    sizes = sorted({m for m, _, _ in SPILL_FREE["fp32" if dtype == torch.float32 else "half"]})
    return next((m for m in sizes if m >= rows), sizes[-1])


def _configs():
    if _INTERPRET:  # one small config: the interpreter runs every program in numpy
        return [triton.Config({"BLOCK_N": 16}, num_warps=4)]
    return [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=s)
            for n in (16, 32, 64) for w in (4, 8) for s in (2, 3)]


def spill_free(kind: str, block_m: int, block_n: int, num_warps: int) -> bool:
    return (block_m, block_n, num_warps) in SPILL_FREE[kind]


def _prune(configs, named_args, **kwargs):
    if _INTERPRET:
        return configs
    kind = "fp32" if named_args["q_ptr"].dtype == torch.float32 else "half"
    block_m = kwargs.get("BLOCK_M", named_args.get("BLOCK_M"))
    return [c for c in configs if spill_free(kind, block_m, c.kwargs["BLOCK_N"], c.num_warps)]


# Keyed on what changes the best config: head dim, GQA packing, tree or chain, split or not,
# fixed splits (batch-invariant mode) or not, and the length read (S_LOG2: its power-of-two
# bucket; each graph bucket has one, tuned in the warm-up runs before its capture); Triton
# adds the dtypes. Configs that would spill for this dtype and BLOCK_M are pruned first.
@triton.autotune(configs=_configs(), key=["D", "BLOCK_M", "HAS_TREE", "SPLIT", "FIXED", "S_LOG2"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _verify_attention_kernel(
    q_ptr, k_ptr, v_ptr, lens_ptr, mask_ptr, win_ptr, out_ptr, m_part, l_part, acc_part,
    qk_scale,
    s_qb, s_qq, s_qh, s_kb, s_ks, s_kh, s_vb, s_vs, s_vh, s_ob, s_oq, s_oh, s_mb, s_mi, s_mj,
    NQ, G, HKV, NSPLIT, MPAD, CHUNK, FIXED, S_LOG2,  # FIXED, S_LOG2: autotune key only
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_TREE: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr, HAS_WINDOW: tl.constexpr,
):
    """One (query block, batch row x KV head, split) program: online softmax over its key range.

    Why long: a Triton program is one function; its loads, masked online-softmax loop and
    split/unsplit stores share registers that helper calls would not make clearer."""
    pid_m, pid_bh, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b = pid_bh // HKV
    kvh = pid_bh % HKV
    # 64-bit row bases (b * batch stride can pass 2**31 elements), 32-bit offsets within a row
    b64 = b.to(tl.int64)
    k_base = k_ptr + b64 * s_kb + kvh * s_kh
    v_base = v_ptr + b64 * s_vb + kvh * s_vh
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # packed (query i, head in group g)
    qi = rows // G
    head = kvh * G + rows % G
    row_ok = qi < NQ
    d = tl.arange(0, D)
    q = tl.load(q_ptr + b64 * s_qb + (qi[:, None] * s_qq + head[:, None] * s_qh + d[None, :]),
                mask=row_ok[:, None], other=0.0)
    cached = tl.load(lens_ptr + b).to(tl.int32)
    if HAS_WINDOW:  # each query's first visible position (a sliding-window layer)
        lo = tl.load(win_ptr + b64 * NQ + qi, mask=row_ok, other=0)
    total = cached + NQ  # this row's keys: its cache, then the new tokens
    if CHUNK > 0:  # fixed splits from position 0 (batch-invariant mode)
        chunk = CHUNK
    else:  # the row's real length, read here on the device, split evenly across NSPLIT programs
        chunk = tl.cdiv(tl.cdiv(total, NSPLIT), BLOCK_N) * BLOCK_N
    start = pid_s * chunk
    end = tl.minimum(start + chunk, total)
    if HAS_WINDOW:  # tiles wholly before every query's window are not read (a window costs its length)
        start = tl.maximum(start, tl.min(tl.where(row_ok, lo, total), 0) // BLOCK_N * BLOCK_N)

    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    for n0 in range(start, end, BLOCK_N):
        s = n0 + tl.arange(0, BLOCK_N)
        s_ok = s < end
        # K tile loaded [BLOCK_N, D], contiguous along D (vector loads), transposed in registers
        k = tl.trans(tl.load(k_base + (s[:, None] * s_ks + d[None, :]), mask=s_ok[:, None], other=0.0))
        if IEEE:
            qk = tl.dot(q, k, input_precision="ieee")
        else:
            qk = tl.dot(q, k)
        qk = qk * qk_scale  # log2 domain
        j = s[None, :] - cached  # < 0: cached prefix; >= 0: new token j
        if HAS_TREE:
            tm = tl.load(mask_ptr + b64 * s_mb + (qi[:, None] * s_mi + j * s_mj),
                         mask=row_ok[:, None] & (j >= 0) & s_ok[None, :], other=0)
            visible = (j < 0) | (tm != 0)
        else:
            visible = j <= qi[:, None]
        if HAS_WINDOW:
            visible = visible & (s[None, :] >= lo[:, None])
        qk = tl.where(visible & s_ok[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(qk - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_base + (s[:, None] * s_vs + d[None, :]), mask=s_ok[:, None], other=0.0)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if SPLIT:
        part = (pid_bh * NSPLIT + pid_s) * MPAD + rows  # real query rows only: the merge reads no others
        tl.store(m_part + part, m_i, mask=row_ok)
        tl.store(l_part + part, l_i, mask=row_ok)
        tl.store(acc_part + part[:, None] * D + d[None, :], acc, mask=row_ok[:, None])
    else:
        out = acc / l_i[:, None]
        tl.store(out_ptr + b * s_ob + qi[:, None] * s_oq + head[:, None] * s_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])


@triton.jit
def _merge_splits_kernel(
    m_part, l_part, acc_part, out_ptr, s_ob, s_oq, s_oh, G, HKV, NSPLIT, MPAD,
    D: tl.constexpr, NS_P: tl.constexpr,
):
    """One real packed query row per program (grid: Q*G rows x B*Hkv), combining its splits'
    partials (max, sum, acc) NS_P at a time, in split order; padded rows are never read or
    stored. Empty splits (m = -inf) weigh exactly 0, so extra empty splits change no bit."""
    row, pid_bh = tl.program_id(0), tl.program_id(1)
    b = pid_bh // HKV
    kvh = pid_bh % HKV
    qi = row // G
    head = kvh * G + row % G
    d = tl.arange(0, D)
    m_run = tl.max(tl.full((NS_P,), float("-inf"), tl.float32), 0)
    l_run = tl.sum(tl.zeros((NS_P,), tl.float32), 0)
    acc = tl.zeros((D,), tl.float32)
    for s0 in range(0, NSPLIT, NS_P):
        sp = s0 + tl.arange(0, NS_P)
        ok = sp < NSPLIT
        part = (pid_bh * NSPLIT + sp) * MPAD + row
        m = tl.load(m_part + part, mask=ok, other=float("-inf"))
        m_new = tl.maximum(m_run, tl.max(m, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_safe)
        w = tl.exp2(m - m_safe)
        l_run = l_run * alpha + tl.sum(w * tl.load(l_part + part, mask=ok, other=0.0), 0)
        acc = acc * alpha + tl.sum(w[:, None] * tl.load(acc_part + part[:, None] * D + d[None, :],
                                                        mask=ok[:, None], other=0.0), 0)
        m_run = m_new
    tl.store(out_ptr + b * s_ob + qi * s_oq + head * s_oh + d, (acc / l_run).to(out_ptr.dtype.element_ty))


MAX_SPLITS = 32  # splits of the length-proportional path
MERGE_BLOCK = 16  # splits the merge combines per step
MIN_SPLIT = 64  # positions: fewer per program cost more in launch and merge than they save


def _num_splits(programs: int, length: int, device: torch.device) -> int:
    """KV splits for ~2 waves of programs over the GPU's SMs. A host bound from the shapes
    only (the graph-safe grid); each program splits its row's real length, read on the
    device, so every split works even when the row is far shorter than the buffer read."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(triton.cdiv(2 * sms, programs), triton.cdiv(length, MIN_SPLIT), MAX_SPLITS))


INTERPRETER_BF16_NOTE = (
    "Triton's interpreter (TRITON_INTERPRET=1) computes tl.dot on bfloat16 inputs wrongly "
    "(a 16x16 product is off by ~1e10); verify_attention upcasts bf16 q/k/v to float32 under the "
    "interpreter and casts the result back. Compiled kernels on a GPU are not affected.")


def _interpreter_bf16(q, k_cache, v_cache):
    """The one place the interpreter's bf16 `tl.dot` limit is handled: True when this call
    must compute through fp32 (interpreter, bf16 inputs); warns once per process."""
    if not (_INTERPRET and q.dtype == k_cache.dtype == v_cache.dtype == torch.bfloat16):
        return False
    warnings.warn(INTERPRETER_BF16_NOTE, RuntimeWarning, stacklevel=3)
    return True


@needs_triton
def verify_attention(q, k_cache, v_cache, cache_lens, tree_mask=None, sm_scale=None, window=None,
                     num_splits=None, fixed_split: int | None = None):
    """Triton version of `verify_attention_ref` (same contract).

    q [B,Q,Hq,D]; k_cache / v_cache [B,S,Hkv,D] (a view of the shared buffer is fine: only
    the last dim must be contiguous); cache_lens [B] int32 with cache_lens[b] + Q <= S;
    tree_mask None (chain) or bool [B|1,Q,Q]; window None or int [B,Q] (first visible positions).
    Returns [B,Q,Hq,D] in q's dtype.
    fixed_split: split the sequence at multiples of this many positions from 0 and always
    merge (one autotune key, so one BLOCK_N): a query's reduction order then depends neither
    on S nor on the GPU's size. Splits past a query's keys are empty and merge as exact zeros.

    Why long: the contract's checks (each names the bad argument) come before the launch.
    """
    if _interpreter_bf16(q, k_cache, v_cache):
        return verify_attention(q.float(), k_cache.float(), v_cache.float(), cache_lens, tree_mask, sm_scale,
                                window, num_splits, fixed_split).to(q.dtype)
    B, Q, Hq, D = q.shape
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv})")
    if D < 16 or D & (D - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {D}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q/k/v dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache / v_cache must be contiguous in head_dim")
    G = Hq // Hkv
    BLOCK_M = block_m_for(Q * G, q.dtype)
    n_m = triton.cdiv(Q * G, BLOCK_M)
    if fixed_split:
        splits, chunk = triton.cdiv(S, fixed_split), fixed_split
    else:  # chunk 0: each program splits its row's real length (read on the device)
        splits, chunk = num_splits or _num_splits(B * Hkv * n_m, S, q.device), 0
    split = splits > 1 or fixed_split is not None
    out = torch.empty_like(q)
    scale = (sm_scale if sm_scale is not None else 1.0 / math.sqrt(D)) * _LOG2E
    if tree_mask is not None:
        tm = tree_mask.to(torch.int8)
        if tm.dim() != 3 or tm.shape[1:] != (Q, Q) or tm.shape[0] not in (1, B):
            raise ValueError(f"tree_mask must be [B or 1, {Q}, {Q}], got {tuple(tree_mask.shape)}")
        mask_strides = (0 if tm.shape[0] == 1 else tm.stride(0), tm.stride(1), tm.stride(2))
    else:
        tm, mask_strides = q, (0, 0, 0)  # never read
    mpad = n_m * BLOCK_M
    if split:
        m_part = torch.empty(B * Hkv, splits, mpad, dtype=torch.float32, device=q.device)
        l_part = torch.empty_like(m_part)
        acc_part = torch.empty(B * Hkv, splits, mpad, D, dtype=torch.float32, device=q.device)
    else:
        m_part = l_part = acc_part = out  # never read
    lens = cache_lens.to(torch.int32)
    win = lens if window is None else window.to(torch.int32).contiguous()  # never read without a window
    _verify_attention_kernel[(n_m, B * Hkv, splits)](
        q, k_cache, v_cache, lens, tm, win, out, m_part, l_part, acc_part, scale,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), out.stride(2),
        *mask_strides, Q, G, Hkv, splits, mpad, chunk, int(fixed_split is not None), max(S, 1).bit_length(),
        D=D, BLOCK_M=BLOCK_M, HAS_TREE=tree_mask is not None, SPLIT=split,
        IEEE=q.dtype == torch.float32, HAS_WINDOW=window is not None,
    )
    if split:
        _merge_splits_kernel[(Q * G, B * Hkv)](
            m_part, l_part, acc_part, out, out.stride(0), out.stride(1), out.stride(2),
            G, Hkv, splits, mpad, D=D, NS_P=MERGE_BLOCK, num_warps=4,
        )
    return out


@needs_triton
def verify_attention_fixed(q, k_cache, v_cache, cache_lens, tree_mask=None, sm_scale=None, window=None):
    """`verify_attention` with fixed 256-position splits: batch-invariant mode's GPU kernel
    (`verify_attention_tiled` is its torch counterpart)."""
    return verify_attention(q, k_cache, v_cache, cache_lens, tree_mask, sm_scale, window, fixed_split=INVARIANT_TILE)
