"""Commit: append each active row's accepted tokens to the token buffer, advance its
committed count and move every row to its next round's random numbers. The torch reference
`commit_tokens_ref` (the spec and the CPU path) is eleven small kernels on a GPU, each an
eager launch between the round's graph replays; the Triton kernel is one launch, a program
per row.

Contract: in place on tokens [B,S] int64, n [B] int64, offset [B] int64; reads active [B]
bool, out_tokens [B,W] int64 and n_new [B] (any int). Row b stores out_tokens[b, :n_new[b]]
at tokens[b, n[b] + j] when active (positions clamp to the last slot; the capacity check
keeps an active row's n + n_new within S), then n[b] += n_new[b] if active, offset[b] += 1.
"""
from __future__ import annotations

import torch

from .jit import needs_triton, tl, triton


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


@triton.jit
def _commit_tokens_kernel(tok_ptr, n_ptr, offset_ptr, active_ptr, out_ptr, new_ptr, S, W, s_tok, s_out,
                          BLOCK_W: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    n = tl.load(n_ptr + row)
    live = tl.load(active_ptr + row).to(tl.int64)
    n_new = tl.load(new_ptr + row).to(tl.int64) * live
    j = tl.arange(0, BLOCK_W)
    keep = (j < W) & (j < n_new)
    toks = tl.load(out_ptr + row * s_out + j, mask=keep, other=0)
    tl.store(tok_ptr + row * s_tok + tl.minimum(n + j, S - 1), toks, mask=keep)
    tl.store(n_ptr + row, n + n_new)
    tl.store(offset_ptr + row, tl.load(offset_ptr + row) + 1)


@needs_triton
def commit_tokens(tokens, n, offset, active, out_tokens, n_new) -> None:
    """The contract above, in one launch."""
    B, W = out_tokens.shape
    for name, t, dtype in (("n", n, torch.int64), ("offset", offset, torch.int64), ("active", active, torch.bool)):
        if t.shape != (B,) or t.dtype != dtype or (B > 1 and t.stride(0) != 1):
            raise ValueError(f"commit_tokens: {name} must be a unit-stride [{B}] {dtype} tensor (it is updated "
                             f"in place), got {tuple(t.shape)} {t.dtype} stride {t.stride()}")
    if tokens.shape[0] != B or tokens.dtype != torch.int64 or tokens.stride(1) != 1:
        raise ValueError(f"commit_tokens: tokens must be [{B}, S] int64 with unit column stride, got "
                         f"{tuple(tokens.shape)} {tokens.dtype} stride {tokens.stride()}")
    if out_tokens.stride(1) != 1:
        out_tokens = out_tokens.contiguous()
    n_new = n_new.contiguous()
    _commit_tokens_kernel[(B,)](tokens, n, offset, active, out_tokens.to(torch.int64), n_new, tokens.shape[1], W,
                                tokens.stride(0), out_tokens.stride(0), BLOCK_W=triton.next_power_of_2(max(W, 2)),
                                num_warps=1)
