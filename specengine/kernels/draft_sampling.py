"""Draft-token sampling: the torch reference (the spec and the CPU path) and a fused kernel,
one launch per draft token, graph-capturable.

Contract: draft_sample(logits[B,V] already filtered (top-k / top-p), temperature (0 = greedy),
seed[B], offset[B], pos) -> (token[B] int64, q[B,V] fp32 or None when greedy, q(token)[B]).

The kernel: one program per row sweeps the row's vocabulary twice: first an online max / sum / first
argmax of the logits l, then (sampling only) it writes q = exp((l - max) / T) / sum and draws the
token by the exponential race argmax(q / E) with E from the counter-based hash on the draft
stream, exactly the numbers of `draft_sample_ref`.
Greedy rows take the argmax; their confidence q(token) is 1 / sum. The top-k / top-p filter,
when set, runs before this kernel (it sets the dropped logits to -inf, which get q = 0).
"""
from __future__ import annotations

import os

import torch

from .jit import _row_stats, counter_uniform, needs_triton, stream_key, tl, triton
from .rng import STREAM_DRAFT, categorical_from_counter, row_offsets, tempered_softmax

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def draft_sample_ref(logits: torch.Tensor, temperature: float, seed, offset, pos: int):
    """One draft token per row of already-filtered logits [B,V]: the argmax when greedy (its
    confidence is its softmax probability), else a draw from q = softmax(logits / T) by the
    exponential race on the draft stream at position `pos` of the round."""
    if temperature == 0:
        conf, tok = torch.softmax(logits.float(), dim=-1).max(dim=-1)
        return tok, None, conf
    q = tempered_softmax(logits, temperature)
    pos_t = torch.full((logits.shape[0],), pos, dtype=torch.int64, device=logits.device)
    tok = categorical_from_counter(q, seed, offset, pos_t, STREAM_DRAFT)
    return tok, q, q.gather(-1, tok[:, None]).squeeze(-1)


@triton.jit
def _draft_sample_kernel(
    logits_ptr, s_lb, seed_ptr, offset_ptr, tok_ptr, q_ptr, s_qb, conf_ptr,
    temperature, pos, V, KEY, GREEDY: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * s_lb + tl.zeros((1,), tl.int64)  # a [1] row block for _row_stats
    t = tl.full((1,), 1.0 if GREEDY else temperature, tl.float32)
    m, s, arg = _row_stats(base, 0, V, t, row + tl.zeros((1,), tl.int64) >= 0, BLOCK_V)
    if GREEDY:
        tl.store(tok_ptr + row + tl.arange(0, 1), arg)
        tl.store(conf_ptr + row + tl.arange(0, 1), 1.0 / s)
    else:
        seed = tl.load(seed_ptr + row).to(tl.int64)
        offset = tl.load(offset_ptr + row).to(tl.int64)
        best = tl.full((1,), -1.0, tl.float32)
        idx = tl.zeros((1,), tl.int64)
        q_tok = tl.zeros((1,), tl.float32)
        for v0 in range(0, V, BLOCK_V):
            offs = v0 + tl.arange(0, BLOCK_V)
            inb = offs < V
            x = tl.load(logits_ptr + row * s_lb + offs, mask=inb, other=float("-inf")).to(tl.float32)
            q = tl.exp((x - m) / temperature) / s
            tl.store(q_ptr + row * s_qb + offs, q, mask=inb)
            u = counter_uniform(seed, offset, tl.zeros((BLOCK_V,), tl.int64) + pos, offs.to(tl.int64), KEY)
            race = tl.where(inb, q / -tl.log(u), -1.0)
            tmax = tl.max(race, 0)
            targ = tl.argmax(race, 0).to(tl.int64) + v0
            tq = tl.sum(tl.where(offs == targ, q, 0.0), 0)
            better = tmax > best
            idx = tl.where(better, targ, idx)
            q_tok = tl.where(better, tq, q_tok)
            best = tl.where(better, tmax, best)
        tl.store(tok_ptr + row + tl.arange(0, 1), idx)
        tl.store(conf_ptr + row + tl.arange(0, 1), q_tok)


@needs_triton
def draft_sample(logits: torch.Tensor, temperature: float, seed: torch.Tensor, offset: torch.Tensor, pos: int):
    """Triton version of `draft_sample_ref` (same contract, same random numbers).

    Returns (token [B] int64, q [B,V] fp32 or None when greedy, q(token) [B] fp32).
    """
    B, V = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    greedy = temperature == 0
    tok = torch.empty(B, dtype=torch.int64, device=logits.device)
    conf = torch.empty(B, dtype=torch.float32, device=logits.device)
    q = None if greedy else torch.empty(B, V, dtype=torch.float32, device=logits.device)
    block_v = min(triton.next_power_of_2(V), 8192 if _INTERPRET else 4096)
    q_arg = conf if q is None else q  # never written when greedy
    _draft_sample_kernel[(B,)](
        logits, logits.stride(0), seed.to(torch.int64), row_offsets(offset, B).contiguous(), tok, q_arg,
        q_arg.stride(0) if q is not None else 0, conf, float(temperature) if not greedy else 1.0, pos, V,
        stream_key(STREAM_DRAFT), GREEDY=greedy, BLOCK_V=block_v, num_warps=8 if block_v >= 2048 else 4,
    )
    return tok, q, conf

