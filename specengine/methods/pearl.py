"""`pearl`: parallel speculative decoding with adaptive draft length (PEARL, arXiv 2408.11850).

Each row is in one of two modes, kept on the device:
- pre-verify (start, and after any rejection): the draft drafts d1..dγ while the target
  runs on the last committed token, which gives p for d1; only d1 is verified. Reject:
  commit the correction, stay. Accept: commit d1, keep d2..dγ pending, go to post-verify.
- post-verify: the target verifies [last committed, pending] in one forward while the
  draft continues with e1..eγ after the last pending token; its outputs cover the pending
  tokens and e1. All accepted: commit them and e1, keep e2..eγ pending, stay. Else commit
  up to the rejection + the correction, drop e*, go back to pre-verify.
The draft length thus adapts by itself: long accepted runs keep extending a block.

Both forwards of a round depend only on what is known at its start, so they are issued
concurrently (two CUDA streams, joined once per round); on a CPU they run one after the
other and produce the same tokens. Pending tokens are stored right after the committed
ones in `st.tokens` (a row's "virtual" sequence), which is scratch space until committed.
Verification reuses the rejection sampler with per-row `num_draft` (1 in pre-verify, γ
in post-verify) and withholds its bonus token, which PEARL never takes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import SpecEngineError
from ..sampling import filter_logits
from .common import DecodeState, RoundOutput
from .sd import draft_chain


@dataclass
class PearlState:
    """Per-call PEARL state: modes and pending drafts live on the device, stats on the host."""
    gamma: int
    post: torch.Tensor  # [B] bool, row is in post-verify (has γ-1 pending tokens)
    pending_q: torch.Tensor | None = None  # [B,γ-1,V] q of the pending tokens (sampling only)
    any_post: bool = False  # host copy: does any active row need the γ-token target forward?
    rejections: int = 0
    trace: list = field(default_factory=list)  # (mode, verified, accepted) per round, batch 1
    name: str = "pearl"

    @property
    def gamma_max(self) -> int:
        return self.gamma

    def update(self, n_acc: list[int], num_draft: list[int]) -> None:
        """Host bookkeeping after the round's sync (the modes themselves moved on the device)."""
        full = [a >= d for a, d in zip(n_acc, num_draft)]
        self.rejections += sum(not f for f in full)
        self.any_post = any(full)
        if len(n_acc) == 1:  # num_draft is γ in post-verify, 1 in pre-verify
            self.trace.append(("post" if num_draft[0] > 1 else "pre", num_draft[0], n_acc[0]))


def measure_cost_ratio(target, draft, st: DecodeState, repeats: int = 3) -> float:
    """c = draft step time / target step time, timed on one-token steps at the current state.

    The steps rewrite the K/V of the last committed token at its own position: harmless.
    """
    import time

    def step_time(model):
        sync = torch.cuda.synchronize if st.tokens.is_cuda else (lambda: None)
        model.decode(st.last_tokens(), attn_len=st.attn_len)  # warm-up
        sync()
        t = time.perf_counter()
        for _ in range(repeats):
            model.decode(st.last_tokens(), attn_len=st.attn_len)
        sync()
        return (time.perf_counter() - t) / repeats

    return step_time(draft) / step_time(target)


GAMMA_MAX = 16  # the longest window round(1/c) may choose (also the capacity headroom)


def gamma_for(cost_ratio: float, gamma_max: int = GAMMA_MAX) -> int:
    """PEARL's window: γ = round(1 / c), so the draft's γ steps take as long as one target step."""
    return max(1, min(gamma_max, round(1.0 / max(cost_ratio, 1e-6))))


def new_state(batch: int, gamma: int, device) -> PearlState:
    if not isinstance(gamma, int) or gamma < 1:
        raise SpecEngineError(f"pearl window gamma must be an integer >= 1, got {gamma!r}")
    return PearlState(gamma, torch.zeros(batch, dtype=torch.bool, device=device))


def overlap(device: torch.device, side_stream, draft_fn, target_fn):
    """Run draft_fn and target_fn concurrently on CUDA (side stream + current), joined once."""
    if device.type != "cuda":
        return draft_fn(), target_fn()
    main = torch.cuda.current_stream(device)
    side_stream.wait_stream(main)  # inputs ready; also protects memory reused across rounds
    with torch.cuda.stream(side_stream):
        d = draft_fn()
    t = target_fn()
    main.wait_stream(side_stream)
    return d, t


def pearl_round(target, draft, st: DecodeState, ps: PearlState, timer, side_stream=None) -> RoundOutput:
    gamma, B, dev = ps.gamma, st.batch, st.tokens.device
    n0, post = st.n.clone(), ps.post
    virt = n0 + post.to(torch.int64) * (gamma - 1)  # committed + pending
    width = gamma if ps.any_post else 1  # all rows in pre-verify: the target needs one token

    def run_draft():
        with timer.phase("draft"):
            return draft_chain(draft, st, gamma, upto=virt)

    def run_target():
        with timer.phase("target"):
            return target.verify(st.tokens.gather(1, st.positions(n0 - 1, width)), attn_len=st.attn_len)

    (drafts, q, _), logits = overlap(dev, side_stream, run_draft, run_target)

    # proposals: post rows verify [pending, e1] (γ), pre rows verify [d1] (1)
    pending = st.tokens.gather(1, st.positions(n0, gamma - 1))
    proposal = torch.where(post[:, None], torch.cat([pending, drafts[:, :1]], 1), drafts)
    num_draft = torch.where(post, gamma, 1).to(torch.int32)
    q_all = None
    if q is not None:
        q_post = torch.cat([ps.pending_q, q[:, :1]], 1) if ps.pending_q is not None else q
        q_all = torch.where(post[:, None, None], q_post, q)
    # the sampler wants K+1 logits rows: pad to γ+1 (pre rows read only row 0, bonus withheld)
    logits = filter_logits(logits, st.params)
    pad = logits[:, -1:].expand(B, gamma + 1 - logits.shape[1], logits.shape[2])
    out, n_acc = st.sampler(torch.cat([logits, pad], 1), proposal, q_all, num_draft,
                            st.temperature, st.seed, st.offset)

    all_ok = n_acc.to(torch.int32) >= num_draft
    n_new = torch.where(all_ok, n_acc.to(torch.int64), n_acc.to(torch.int64) + 1)
    st.commit(out, n_new)
    target.cache.set_lens(st.n - 1)
    # accepted rows keep drafts[1:] pending right after the committed tokens; the draft has
    # seen all but the last of them. Rejected rows restart from the correction.
    spare = st.positions(st.n, gamma - 1)
    keep = all_ok & st.active
    st.tokens.scatter_(1, spare, torch.where(keep[:, None], drafts[:, 1:], st.tokens.gather(1, spare)))
    draft.cache.set_lens(torch.where(keep, draft.cache.lens.to(torch.int64), st.n - 1))
    ps.post = keep | (ps.post & ~st.active)
    if q is not None:
        ps.pending_q = q[:, 1:]
    return RoundOutput(out, n_acc, num_draft, n_new, target_forwards=1, draft_forwards=gamma)
