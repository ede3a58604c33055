"""`sd`: chain speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

One round: the draft proposes γ tokens autoregressively; the target scores
[last committed, d1..dγ] in one forward; the rejection sampler accepts a prefix and adds
one corrected or bonus token; both caches are rolled back by setting their lengths.

Draft cache bookkeeping: after a round the draft holds the committed prefix plus
d1..d_{γ-1}, so it is 1 or 2 tokens behind the new committed length (2 when all drafts
were accepted: dγ and the bonus are unseen). The first draft step therefore feeds the
two tokens starting at its length and reads the logits of the right one: no host sync.
"""
from __future__ import annotations

import torch

from ..sampling import filter_logits, sample_draft
from .common import DecodeState, RoundOutput


def draft_catch_up(draft, st: DecodeState, upto: torch.Tensor) -> torch.Tensor:
    """Feed the draft the tokens of st.tokens[:, :upto] it has not seen (1 or 2 per row);
    returns the logits after the last one [B,V]."""
    dlen = draft.cache.lens.to(torch.int64)
    logits = draft.verify(st.tokens.gather(1, st.positions(dlen, 2)), attn_len=st.attn_len)
    which = (upto - 1 - dlen).clamp(0, 1)
    draft.cache.set_lens(upto)
    return logits[torch.arange(st.batch, device=logits.device), which]


def draft_chain(draft, st: DecodeState, gamma: int, upto: torch.Tensor | None = None):
    """γ draft tokens per row [B,γ] continuing st.tokens[:, :upto] (default: the committed
    tokens), their q [B,γ,V] (None if greedy) and the draft's confidences [B,γ]."""
    logits = draft_catch_up(draft, st, st.n if upto is None else upto)
    toks, qs, confs = [], [], []
    for j in range(gamma):
        if j:
            logits = draft.decode(toks[-1], attn_len=st.attn_len)
            draft.cache.set_lens(draft.cache.lens + 1)
        tok, q, conf = sample_draft(logits, st.params, st.seed, st.offset, j)
        toks.append(tok), qs.append(q), confs.append(conf)
    q = None if st.params.greedy else torch.stack(qs, 1)
    return torch.stack(toks, 1), q, torch.stack(confs, 1)


def sd_round(target, draft, st: DecodeState, policy, timer) -> RoundOutput:
    gamma = policy.gamma
    n0 = st.n.clone()
    with timer.phase("draft"):
        drafts, q, conf = draft_chain(draft, st, gamma)
        num_draft = policy.num_draft(conf)
    with timer.phase("target"):
        logits = target.verify(torch.cat([st.last_tokens()[:, None], drafts], 1), attn_len=st.attn_len)
    out, n_acc = st.sampler(filter_logits(logits, st.params), drafts, q, num_draft,
                            st.temperature, st.seed, st.offset)
    st.commit(out, n_acc + 1)
    target.cache.set_lens(st.n - 1)
    # the draft saw d1..d_{γ-1}: valid up to n0 + min(n_acc, γ-1), never past the new n - 1
    seen = n0 + torch.clamp(n_acc.to(torch.int64), max=gamma - 1)
    draft.cache.set_lens(torch.minimum(seen, st.n - 1))
    return RoundOutput(out, n_acc, num_draft, n_acc + 1, target_forwards=1, draft_forwards=gamma)
