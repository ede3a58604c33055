"""`ar`: the target alone, one token per forward; the baseline every speedup is measured against.

Sampling goes through the same rejection sampler with zero drafts (a bonus token from p),
so `ar` and the speculative methods share one definition of the target distribution.
"""
from __future__ import annotations

import torch

from ..sampling import filter_logits
from .common import DecodeState, RoundOutput


def ar_round(target, st: DecodeState, timer) -> RoundOutput:
    B = st.batch
    with timer.phase("target"):
        logits = target.decode(st.last_tokens(), attn_len=st.attn_len)
    none = torch.zeros(B, 0, dtype=torch.int64, device=logits.device)
    zeros = torch.zeros(B, dtype=torch.int32, device=logits.device)
    out, n_acc = st.sampler(filter_logits(logits[:, None], st.params), none, None, zeros,
                            st.temperature, st.seed, st.offset)
    one = n_acc + 1
    st.commit(out, one)
    target.cache.set_lens(st.n - 1)
    return RoundOutput(out, n_acc, zeros, one, target_forwards=1)
