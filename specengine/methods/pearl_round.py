"""PEARL's device side (pearl.py chooses the rounds): the per-row modes and pending drafts, one round
with the draft's window beside the target's verify, and a flush of the pending drafts.

Pending tokens are stored right after the committed ones in `state.tokens` (committed + pending = the
row's drafted sequence), scratch space until committed. Verification reuses the rejection sampler with
per-row `num_draft` (1 in pre-verify, γ in post-verify) and withholds its bonus token, which PEARL never
takes. Both forwards of a round depend only on what is known at its start, so they run concurrently (two
CUDA streams, joined once per round); on a CPU in turn, with the same tokens.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .context import MethodContext
from .logprobs import capture
from .sampling import filter_logits
from .state import DecodeState, RoundOutput
from .steps import draft_chain, parallel_draft, verify_and_commit


@dataclass
class PearlModes:
    """Per-call PEARL state: modes and pending drafts live on the device, stats on the host."""
    post: torch.Tensor  # [B] bool, row is in post-verify (has γ-1 pending tokens)
    pending_q: torch.Tensor | None = None  # [B,γ-1,V] q of the pending tokens (sampling only)
    any_post: bool = False  # host copy: does any active row need the γ-token target forward?
    rejections: int = 0
    trace: list = field(default_factory=list)  # (mode, verified, accepted) per round, batch 1


def overlap(side_stream, draft_fn, target_fn):
    """draft_fn on the side stream beside target_fn on the current one, joined once; in turn off CUDA."""
    if side_stream is None:
        return draft_fn(), target_fn()
    main = torch.cuda.current_stream(side_stream.device)
    side_stream.wait_stream(main)  # inputs ready; also protects memory reused across rounds
    with torch.cuda.stream(side_stream):
        d = draft_fn()
    t = target_fn()
    main.wait_stream(side_stream)
    return d, t


def flush_pending(ctx: MethodContext, modes: PearlModes, state: DecodeState, g: int, timer) -> RoundOutput:
    """The pending drafts verified (their q kept from the round that drafted them), the accepted
    ones committed with the correction or the bonus; rows without any take a plain step in the same
    forward. The draft saw all but the last pending token, so its cache stays valid up to the new
    n - 1 (at most 2 behind, as after any round); plain rounds go on from there."""
    pending = state.tokens.gather(1, state.positions(state.n, g - 1))
    num_draft = torch.where(modes.post, g - 1, 0).to(torch.int32)
    out, n_acc = verify_and_commit(ctx, state, pending, modes.pending_q, num_draft, timer)
    drop_pending(modes)
    draft_lens = torch.minimum(ctx.draft.cache.lens.to(torch.int64), state.n - 1)
    return RoundOutput(out, n_acc, num_draft, n_acc + 1, target_forwards=1, draft_lens=draft_lens)


def _proposals(modes: PearlModes, state: DecodeState, start, drafts, q, gamma: int):
    """What the round verifies: post rows [pending, e1] (γ), pre rows [d1] (1); their q where sampling."""
    post = modes.post
    pending = state.tokens.gather(1, state.positions(start, gamma - 1))
    proposal = torch.where(post[:, None], torch.cat([pending, drafts[:, :1]], 1), drafts)
    num_draft = torch.where(post, gamma, 1).to(torch.int32)
    q_all = None
    if q is not None:
        q_post = torch.cat([modes.pending_q, q[:, :1]], 1) if modes.pending_q is not None else q
        q_all = torch.where(post[:, None, None], q_post, q)
    return proposal, q_all, num_draft


def drop_pending(modes: PearlModes) -> None:
    """Every row restarts in pre-verify with nothing pending."""
    modes.post = torch.zeros_like(modes.post)
    modes.pending_q, modes.any_post = None, False


def pearl_round(ctx: MethodContext, modes: PearlModes, state: DecodeState, gamma: int, timer,
                drafter=None) -> RoundOutput:
    """One PEARL round: the draft's window beside the target's verify of what is pending (pearl.py's doc).
    drafter: ParallelSpec's, which drafts the window in one forward (policy "parallel"), else the draft's chain."""
    target, draft = ctx.target, ctx.draft
    B = state.batch
    start = state.n.clone()
    drafted_end = start + modes.post.to(torch.int64) * (gamma - 1)  # committed + pending
    width = gamma if modes.any_post else 1  # all rows in pre-verify: the target needs one token

    def run_draft():
        with timer.phase("draft"):
            if drafter is not None:  # unseen tokens per row stay <= γ (committed + pending of last round)
                return (*parallel_draft(ctx, drafter, state, gamma, drafted_end, gamma + 1), None)
            return draft_chain(ctx, state, gamma, upto=drafted_end)

    def run_target():
        with timer.phase("target"):
            return target.verify(state.tokens.gather(1, state.positions(start - 1, width)),
                                 attn_len=state.attn_len)

    # under a constraint the walk reads the pending tokens: their host copy starts before the forwards
    walk = None if state.constraints is None else \
        state.read_ahead(state.tokens.gather(1, state.positions(start, width - 1)))
    (drafts, q, _), logits = overlap(ctx.side_stream(), run_draft, run_target)

    proposal, q_all, num_draft = _proposals(modes, state, start, drafts, q, gamma)

    # the sampler wants K+1 logits rows: pad to γ+1 (pre rows read only row 0, bonus withheld)
    def padded(x):
        return torch.cat([x, x[:, -1:].expand(B, gamma + 1 - x.shape[1], x.shape[2])], 1)

    scored = logits if walk is None else state.constrain(logits, walk)  # after the pending tokens
    out, n_acc = ctx.ops.rejection_sample(padded(filter_logits(scored, state.params)), proposal, q_all, num_draft,
                                          state.temperature, state.seed, state.offset)
    if state.logprobs is not None:  # post rows' pending drafts and pre rows' d1 alike: this verify's rows
        capture(state, padded(logits), out, padded(scored))

    all_ok = n_acc.to(torch.int32) >= num_draft
    n_new = torch.where(all_ok, n_acc.to(torch.int64), n_acc.to(torch.int64) + 1)
    state.commit(out, n_new)
    # accepted rows keep drafts[1:] pending right after the committed tokens; the draft has
    # seen all but the last of them. Rejected rows restart from the correction.
    pending_slots = state.positions(state.n, gamma - 1)
    keep = all_ok & state.active
    state.tokens.scatter_(1, pending_slots,
                          torch.where(keep[:, None], drafts[:, 1:], state.tokens.gather(1, pending_slots)))
    modes.post = keep | (modes.post & ~state.active)
    if q is not None:
        modes.pending_q = q[:, 1:]
    draft_lens = torch.where(keep, draft.cache.lens.to(torch.int64), state.n - 1)
    return RoundOutput(out, n_acc, num_draft, n_new, target_forwards=1,
                       draft_forwards=1 if drafter is not None else gamma,
                       draft_lens=draft_lens)
