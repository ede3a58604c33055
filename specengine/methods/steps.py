"""Round steps shared by the methods: the draft's catch-up, a chain draft, a parallel draft,
a tree draft, and chain / tree verify-and-commit. Methods import these, never each other
(docs/design.md, "Methods"). Each step takes the generation's `MethodContext` (runners and
samplers) and its `DecodeState`, and stays on the device.

Chain drafts (`draft_chain`): after a round the draft holds the committed prefix plus some
of the round's drafts, so it is 1 or 2 tokens behind the new committed length (2 when all
drafts were accepted: the last draft and the bonus are unseen). The first draft step feeds
the two tokens starting at its length and reads the logits of the right one: no host sync.

Parallel drafts (`parallel_draft`, ParallelSpec's drafter): the draft reads its unseen
committed tokens (1 .. k+1 of them) followed by MASK_1 .. MASK_{k-1}; the last real token's
logits propose d1 and MASK_i's propose d_{i+1}. Rows have different numbers of unseen
tokens, so the forward is a tree over k+1 real slots and k-1 masks: a real slot sees the
real slots before it; a mask sees the row's valid real slots and the masks before it.
Positions follow from the tree (a node's depth), so MASK_1 sits at the next token's position.

Tree drafts (`tree="KxD:N"`, methods/token_tree.py): draft a token tree, verify it in one
target forward, accept a root path losslessly, compact its K/V. Tree drafting keeps K nodes
per depth (a beam over cumulative draft log-probability, the EAGLE-2 rule): depth 1 is the
draft's top-K after the root; depth d+1 is the best K of the K×K children of depth d's
nodes; finally the N most probable nodes are kept (a child never scores above its parent,
so the kept set is closed under ancestors).
  - autoregressive draft: depth d+1's candidates come from one draft forward over every
    node drafted so far as a tree (widths K, 2K, ..., (D−1)K). Re-feeding the earlier
    levels keeps the attention contract (a tree over the new tokens only); node j's draft
    K/V lands at root_slot + j, so the accepted path is compacted in the draft cache too.
  - parallel drafter: one draft forward gives every depth's distribution at once (the
    last real token, then MASK_1..), so depth d+1's candidates are the same top-K under
    every node; the draft cache keeps the committed tokens only, nothing to compact.
Candidates are the draft's top-K (not samples), which is what lets `tree_accept` be
lossless without the draft's q.
"""
from __future__ import annotations

import torch

from .context import MethodContext
from .logprobs import capture
from .sampling import SamplingParams, filter_logits
from .state import DecodeState, RoundOutput, buffer_positions
from .token_tree import TokenTree, TreeShape, ancestor_mask, tree_accept


def graphed(runner):
    """The runner's `graphed(name, fn, *args)`: a round's pure device function (tree masks,
    tree acceptance, the drafter's layout) replayed from a CUDA graph where the runner has
    graphs; a direct call for runners without one (another device's wrapper, test stand-ins)."""
    return getattr(runner, "graphed", lambda name, fn, *args: fn(*args))


def catch_up_feed(tokens: torch.Tensor, seen: torch.Tensor, upto: torch.Tensor, width: int = 2):
    """The draft's catch-up feed, from the token buffer [B,S], the draft's length [B] and the
    length to reach [B]: (the `width` tokens from its length on [B,width] (clamped inside the
    buffer), which of their logits continues the chain [B] (the last unseen token: 1..width are
    unseen; usually 1 or 2)). Pure tensor ops: the whole-chain graph runs it inside its replay."""
    seen = seen.to(torch.int64)
    return tokens.gather(1, buffer_positions(seen, width, tokens.shape[1])), (upto - 1 - seen).clamp(0, width - 1)


def draft_catch_up(draft, state: DecodeState, upto: torch.Tensor, return_hidden: bool = False, width: int = 2):
    """Feed the draft the tokens of state.tokens[:, :upto] it has not seen (1..width per row, in
    one forward of `width`); returns the logits after the last one [B,V] (and its final hidden
    state [B,H]). Positions it writes past a row's upto - 1 are scratch."""
    tok2, which = catch_up_feed(state.tokens, draft.cache.lens, upto, width)
    out = draft.verify(tok2, attn_len=state.attn_len, return_hidden=return_hidden)
    draft.cache.set_lens(upto)
    rows = torch.arange(state.batch, device=which.device)
    return (out[0][rows, which], out[1][rows, which]) if return_hidden else out[rows, which]


def draft_resync(draft, state: DecodeState, behind: int, width: int | None = None) -> None:
    """After rounds the draft sat out (sd's γ = 0, hybrid's n-gram rounds) it is up to behind+2
    tokens behind; forwards over behind+1 of its unseen tokens bring it to n-1, so the next
    chain starts 1 behind as usual: one forward, or forwards of at most `width` tokens per row
    (the method's KV headroom). Positions it writes past a row's n-1 are scratch: the lengths
    set afterwards drop them."""
    left = behind + 1
    step = width or left
    last = left - step * ((left - 1) // step)  # the last forward's width, 1..step
    draft_read(draft, state, left - last, step)  # all but the last forward, each row at most to n-1
    tokens = state.tokens.gather(1, state.positions(draft.cache.lens.to(torch.int64), last))
    draft.verify(tokens, attn_len=state.attn_len)
    draft.cache.set_lens(state.n - 1)


def prepare_chains(ctx: MethodContext, gammas) -> int:
    """Capture the draft's whole-chain graphs of greedy calls for every γ in `gammas` now
    (Engine.warmup: no call then captures one mid-round); 0 where it has none (graphs off)."""
    chain = getattr(ctx.draft, "chain_graphs", lambda: None)() if ctx.draft is not None else None
    if chain is None:
        return 0
    with torch.inference_mode():  # as a call runs them: the buffers are inference tensors
        return chain.prepare(ctx.sample_draft, catch_up_feed, gammas, SamplingParams())


def read_missed(draft, state: DecodeState, behind: int, width: int | None = None) -> int:
    """Before a chain, a draft up to behind + 2 tokens short of n: reads all but what the chain's
    first forward can take (at most `width` tokens a row: the KV headroom; None: no limit) and
    returns that forward's width. With whole-chain CUDA graphs (2 tokens) draft_resync reads it
    all first."""
    if behind <= 0:
        return 2
    if getattr(draft, "chain_graphs", lambda: None)() is not None:
        draft_resync(draft, state, behind, width)
        return 2
    fold = behind if width is None else max(min(behind, width - 2), 0)
    draft_read(draft, state, behind - fold, width or behind)
    return fold + 2


def draft_read(draft, state: DecodeState, count: int, width: int) -> None:
    """Feed the draft `count` of its unseen tokens per row, in forwards of at most `width`; a row
    never moves past n - 1 (positions written beyond are scratch)."""
    while count > 0:
        w = min(count, width)
        seen = draft.cache.lens.to(torch.int64)
        draft.verify(state.tokens.gather(1, state.positions(seen, w)), attn_len=state.attn_len)
        draft.cache.set_lens(torch.minimum(seen + w, state.n - 1))
        count -= w


class PlainStep:
    """One target decode step and commit, no drafts: `ar`'s round, and a speculative method's
    round when its costs say speculation would lose (γ = 0). Sampling goes through the same
    rejection sampler with zero drafts (a bonus token from p)."""

    def __init__(self):
        self._none = None

    def _no_drafts(self, B: int, device):
        """([B,0] draft tokens, [B] zero draft counts), made once per batch size (nothing writes
        them): two launches fewer per token."""
        cached = self._none
        if cached is None or cached[1].shape[0] != B or cached[1].device != device:
            self._none = (torch.zeros(B, 0, dtype=torch.int64, device=device),
                          torch.zeros(B, dtype=torch.int32, device=device))
        return self._none

    def __call__(self, ctx: MethodContext, state: DecodeState, timer) -> RoundOutput:
        with timer.phase("target"):
            logits = ctx.target.decode(state.last_tokens(), attn_len=state.attn_len)
        no_drafts, zeros = self._no_drafts(state.batch, logits.device)
        scored = state.constrain(logits[:, None])
        out, n_acc = ctx.ops.rejection_sample(filter_logits(scored, state.params), no_drafts, None, zeros,
                                              state.temperature, state.seed, state.offset)
        capture(state, logits[:, None], out, scored)
        one = n_acc + 1
        state.commit(out, one)
        return RoundOutput(out, n_acc, zeros, one, target_forwards=1)


def draft_chain(ctx: MethodContext, state: DecodeState, gamma: int, upto: torch.Tensor | None = None, policy=None,
                feed: int = 2):
    """Up to γ draft tokens per row [B,γ'] continuing state.tokens[:, :upto] (default: the
    committed tokens), their q [B,γ',V] (None if greedy) and the draft's confidences [B,γ'].
    A policy that wants hidden states (specdec++) sees each step's and may end the loop
    early (γ' < γ) once every row has stopped. feed: the first step's width (every row at most
    that many tokens short of upto; more than 2 after rounds the draft sat out, eagerly)."""
    draft, observe = ctx.draft, policy is not None and policy.wants_hidden
    upto = state.n if upto is None else upto
    plan = None if ctx.replay is None else ctx.replay.chain(state, upto, gamma)  # a benchmark's replay only
    chain = None if observe or feed != 2 else getattr(draft, "chain_graphs", lambda: None)()
    if chain is not None:  # the whole chain as one CUDA graph replay (runtime/chain_graphs.py)
        out = chain.run(state, ctx.sample_draft, catch_up_feed, gamma, draft.cache.lens, upto)
        if out is not None:
            return out if plan is None else (plan.tokens, out[1], plan.conf)
    if observe:
        policy.begin_round(state.batch, state.tokens.device)
    out = draft_catch_up(draft, state, upto, return_hidden=observe, width=feed)
    toks, qs, confs = [], [], []
    for j in range(gamma):
        if j:
            out = draft.decode(toks[-1], attn_len=state.attn_len, return_hidden=observe)
            draft.cache.set_lens(draft.cache.lens + 1)
        logits, hidden = out if observe else (out, None)
        tok, q, conf = ctx.sample_draft(logits, state.params, state.seed, state.offset, j)
        if plan is not None:  # the real draft's token, confidence and head output (replay.py)
            tok, conf = plan.tokens[:, j], plan.conf[:, j]
            ctx.replay.head.now[: state.batch].copy_(plan.head[:, j])
        toks.append(tok), qs.append(q), confs.append(conf)
        if observe and policy.observe(hidden, j, run=graphed(draft)):
            break
    q = None if state.params.greedy else torch.stack(qs, 1)
    return torch.stack(toks, 1), q, torch.stack(confs, 1)


def chain_round(ctx: MethodContext, state: DecodeState, policy, timer, behind: int = 0,
                width: int | None = None) -> RoundOutput:
    """One round of the draft model's chain (`sd`'s, and `hybrid`'s draft rounds): the draft
    reads what it missed (`behind` > 0: up to behind + 2 short), drafts policy.gamma tokens (a
    policy may stop early or cut rows short), the target verifies and commits. What it missed
    goes into the chain's first forward, which reads every row's unseen tokens at once (at most
    `width`, the method's KV headroom: the rest first, in forwards of `width`); with whole-chain
    CUDA graphs, which take the usual 2, draft_resync reads it first. The draft saw
    d1..d_{γ-1}: its cache is valid up to start + min(n_acc, γ-1), never past the new n - 1."""
    start = state.n.clone()
    with timer.phase("draft"):
        feed = read_missed(ctx.draft, state, behind, width)
        drafts, q, conf = draft_chain(ctx, state, policy.gamma, policy=policy, feed=feed)
        num_draft = policy.num_draft(conf)
    gamma = drafts.shape[1]  # a policy may have ended the loop early
    out, n_acc = verify_and_commit(ctx, state, drafts, q, num_draft, timer)
    seen = start + torch.clamp(n_acc.to(torch.int64), max=gamma - 1)
    return RoundOutput(out, n_acc, num_draft, n_acc + 1, target_forwards=1, draft_forwards=gamma,
                       draft_lens=torch.minimum(seen, state.n - 1))


def verify_and_commit(ctx: MethodContext, state: DecodeState, drafts, q, num_draft, timer):
    """One target forward over [last committed, drafts], rejection sampling, commit.
    Returns (tokens [B,K+1], n_acc [B])."""
    walk = state.read_ahead(drafts)  # under a constraint: the drafts' host copy, read while the verify runs
    with timer.phase("target"):
        logits = ctx.target.verify(torch.cat([state.last_tokens()[:, None], drafts], 1), attn_len=state.attn_len)
    scored = state.constrain(logits, walk)
    out, n_acc = ctx.ops.rejection_sample(filter_logits(scored, state.params), drafts, q, num_draft,
                                          state.temperature, state.seed, state.offset)
    capture(state, logits, out, scored)
    state.commit(out, n_acc + 1)
    return out, n_acc


def to_device(rows: list[list[int]], device) -> torch.Tensor:
    """Equal-length host lists as one int64 tensor on the device: one copy, without blocking."""
    host = torch.tensor(rows, dtype=torch.int64)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


def verify_proposals(ctx: MethodContext, state: DecodeState, proposals: list[list[int]], timer) -> RoundOutput:
    """One target forward over host-known drafts per row (n-gram matches, a grammar's forced tokens;
    rows may have none), padded to the widest, one copy to the device; deterministic proposals (no q)."""
    width = max(len(t) for t in proposals)
    both = to_device([t + [0] * (width - len(t)) + [len(t)] for t in proposals], state.tokens.device)
    drafts, num_draft = both[:, :width], both[:, width].to(torch.int32)
    out, n_acc = verify_and_commit(ctx, state, drafts, None, num_draft, timer)
    return RoundOutput(out, n_acc, num_draft, n_acc + 1, target_forwards=1)


def grammar_drafts(state: DecodeState, live, limit: int) -> dict:
    """{row: tokens of the text its output constraint forces next} (structured/rows.py), for the live
    rows that have any, when grammar drafting is on: drafts accepted unless the model spells that
    text with other tokens."""
    return {} if state.constraints is None else state.constraints.forced_rows(live, limit)


def drafter_layout(unseen: torch.Tensor, k: int, real_width: int | None = None):
    """(mask_index [B,T], tree_mask [B,T,T]) for `real_width` real slots (default k+1) then
    k-1 masks, T = real_width + k - 1."""
    W = k + 1 if real_width is None else real_width
    B, T = unseen.shape[0], W + k - 1
    dev = unseen.device
    j = torch.arange(T, device=dev)
    mask_index = torch.where(j >= W, j - W + 1, 0).expand(B, T)
    causal = j[None, :] <= j[:, None]  # [T,T]
    is_mask = (j >= W)
    real_ok = j[None, :] < unseen[:, None]  # [B,T] valid real slots (as keys)
    # real query rows: causal over the real slots; mask query rows: valid real slots + earlier masks
    real_rows = causal & ~is_mask[None, :]
    mask_rows = (real_ok[:, None, :] & ~is_mask[None, None, :]) | (causal & is_mask[None, :])[None]
    tree = torch.where(is_mask[None, :, None], mask_rows, real_rows[None])
    return mask_index, tree


def parallel_logits(draft, drafter, state: DecodeState, k: int, upto: torch.Tensor, real_width: int):
    """Logits [B,k,V] of the k proposals continuing state.tokens[:, :upto], from ONE draft
    forward over the row's unseen tokens (1..real_width) then the masks; afterwards the
    draft cache holds exactly tokens[:, :upto]."""
    seen = draft.cache.lens.to(torch.int64)
    unseen = (upto - seen).clamp(1, real_width)
    real = state.tokens.gather(1, state.positions(seen, real_width))
    tokens = torch.cat([real, torch.zeros_like(real[:, : k - 1])], 1)
    mask_index, tree = graphed(draft)("drafter_layout", drafter_layout, unseen, k, real_width)
    logits = draft.drafter_forward(drafter, tokens, mask_index, tree, attn_len=state.attn_len)
    draft.cache.set_lens(upto)
    masks = real_width + torch.arange(k - 1, device=logits.device)[None, :].expand(state.batch, k - 1)
    at = torch.cat([(unseen - 1)[:, None], masks], 1)  # d1 from the last real slot, d2.. from the masks
    return logits.gather(1, at[..., None].expand(-1, -1, logits.shape[-1]))


def parallel_draft(ctx: MethodContext, drafter, state: DecodeState, k: int, upto: torch.Tensor, real_width: int):
    """k draft tokens per row [B,k] continuing state.tokens[:, :upto] in ONE draft forward,
    and their q [B,k,V] (None if greedy)."""
    logits = parallel_logits(ctx.draft, drafter, state, k, upto, real_width)
    toks, qs = [], []
    for i in range(k):
        tok, q, _ = ctx.sample_draft(logits[:, i].contiguous(), state.params, state.seed, state.offset, i)
        toks.append(tok), qs.append(q)
    toks = torch.stack(toks, 1) if ctx.replay is None else ctx.replay.parallel(state, upto, k)
    return toks, None if state.params.greedy else torch.stack(qs, 1)


class _Beam:
    """Nodes drafted so far, K per depth, as lists of [B,K] columns (root first)."""

    def __init__(self, root: torch.Tensor, K: int):
        B = root.shape[0]
        self.K = K
        self.tokens, self.parent = [root[:, None]], [torch.full((B, 1), -1, dtype=torch.int64, device=root.device)]
        self.score, self.depth = [torch.zeros(B, 1, device=root.device)], [torch.zeros_like(self.parent[0])]

    @property
    def size(self) -> int:
        return sum(t.shape[1] for t in self.tokens)

    def grow(self, logq: torch.Tensor) -> None:
        """Add the next depth from the draft's log-probs after each frontier node [B,F,V]."""
        B, F, _ = logq.shape
        first = self.size - F  # index of the first frontier node
        cand, tok = logq.float().topk(self.K, -1)  # [B,F,K]
        total = (self.score[-1][:, :, None] + cand).reshape(B, F * self.K)
        best, flat = total.topk(min(self.K, F * self.K), -1)
        self.tokens.append(tok.reshape(B, F * self.K).gather(1, flat))
        self.parent.append(first + flat // self.K)
        self.score.append(best)
        self.depth.append(self.depth[-1][:, :1] + 1 + torch.zeros_like(flat))

    def all(self):
        cat = lambda xs: torch.cat(xs, 1)  # noqa: E731
        return cat(self.tokens), cat(self.parent), cat(self.score), cat(self.depth)

    def tree(self, budget: int, draft_depth: int) -> tuple[TokenTree, torch.Tensor]:
        """The `budget` most probable nodes (ties: shallower first), re-indexed depth-major,
        and their scores (cumulative draft log-probability, 0 at the root) [B,N+1]."""
        tokens, parent, score, depth = self.all()
        B, n = tokens.shape
        if budget >= n - 1:
            return TokenTree(tokens, parent, depth, torch.arange(n, device=tokens.device).expand(B, n),
                             draft_depth), score
        order = torch.sort(-score[:, 1:], dim=1, stable=True).indices[:, :budget] + 1
        kept = torch.cat([torch.zeros_like(order[:, :1]), torch.sort(order, 1).values], 1)  # [B,N+1] old ids
        new_id = torch.zeros(B, n, dtype=torch.int64, device=tokens.device)
        new_id.scatter_(1, kept, torch.arange(budget + 1, device=tokens.device).expand(B, budget + 1))
        old_parent = parent.gather(1, kept)
        new_parent = torch.where(old_parent >= 0, new_id.gather(1, old_parent.clamp(min=0)), -1)
        return TokenTree(tokens.gather(1, kept), new_parent, depth.gather(1, kept), kept, draft_depth), \
            score.gather(1, kept)


def draft_tree(ctx: MethodContext, state: DecodeState, shape: TreeShape, return_scores: bool = False):
    """A tree from the autoregressive draft: D−1 draft forwards after the catch-up (and the
    kept nodes' scores [B,N+1] when asked)."""
    draft = ctx.draft
    logits = draft_catch_up(draft, state, state.n)  # the draft now holds the root at slot n-1
    beam = _Beam(state.last_tokens(), shape.topk)
    beam.grow(torch.log_softmax(logits.float(), -1)[:, None])
    for _ in range(shape.depth - 1):
        tokens, parent, _, _ = beam.all()
        mask = graphed(draft)("ancestor_mask", ancestor_mask, parent)
        out = draft.verify(tokens[:, 1:], tree_mask=mask[:, 1:, 1:], attn_len=state.attn_len)
        F = beam.tokens[-1].shape[1]
        beam.grow(torch.log_softmax(out[:, -F:].float(), -1))
    tree, scores = beam.tree(shape.nodes, draft_depth=shape.depth)
    if ctx.replay is not None:  # the tree the real draft built here (a benchmark's replay)
        tree = ctx.replay.tree(state, "sd", shape, shape.depth)
    return (tree, scores) if return_scores else tree


def positional_tree(root: torch.Tensor, logq: torch.Tensor, shape: TreeShape) -> TokenTree:
    """A tree from per-depth draft log-probs [B,D,V] that do not depend on the parent (the
    parallel drafter's one forward): depth d+1's candidates are position d's top-K."""
    beam = _Beam(root, shape.topk)
    for d in range(shape.depth):
        F = beam.tokens[-1].shape[1]
        beam.grow(logq[:, d: d + 1].expand(-1, F, -1))
    return beam.tree(shape.nodes, draft_depth=0)[0]  # the draft keeps committed tokens only


def _accept(logits, tokens, parent, depth, temperature, seed, offset, max_depth: int, max_children: int):
    """tree_accept over the tree's tensors (what a graph can take as inputs)."""
    return tree_accept(logits, TokenTree(tokens, parent, depth), temperature, seed, offset, max_depth, max_children)


def verify_tree_and_commit(ctx: MethodContext, state: DecodeState, tree: TokenTree, shape: TreeShape, timer,
                           draft_forwards: int) -> RoundOutput:
    """One target forward over the tree, lossless acceptance, K/V compaction, commit."""
    start, on_device = state.n.clone(), graphed(ctx.target)
    walk = state.read_ahead(tree.tokens, tree.parent)  # under a constraint: read while the verify runs
    with timer.phase("target"):
        mask = on_device("ancestor_mask", ancestor_mask, tree.parent)
        logits = ctx.target.verify(tree.tokens, tree_mask=mask, attn_len=state.attn_len)
    scored = logits if state.constraints is None else state.constraints.mask_tree(logits, *walk)
    out, n_acc, path = on_device("tree_accept", _accept, filter_logits(scored, state.params), tree.tokens,
                                 tree.parent, tree.depth, state.temperature, state.seed, state.offset, shape.depth,
                                 shape.topk)
    if state.logprobs is not None:  # out token j came from the logits after node path[j - 1] (the root first)
        rows = torch.cat([torch.zeros_like(path[:, :1]), path.clamp(min=0)], 1)
        along = rows[..., None].expand(-1, -1, logits.shape[-1])
        capture(state, logits.gather(1, along), out, scored.gather(1, along))
    root_slot = start - 1
    ctx.target.cache.compact_path(root_slot, path, n_acc)
    draft_lens = start  # the parallel drafter's cache holds the committed tokens only
    if tree.draft_depth:  # the draft wrote the nodes shallower than draft_depth at root_slot + source
        fed = n_acc.to(torch.int64).clamp(max=tree.draft_depth - 1)
        ctx.draft.cache.compact_path(root_slot, tree.source.gather(1, path.clamp(min=0)), fed)
        draft_lens = start + fed
    state.commit(out, n_acc + 1)
    num_draft = torch.full_like(n_acc, shape.depth)  # per-depth acceptance: alpha_d = P(depth d | d-1)
    return RoundOutput(out, n_acc, num_draft, n_acc + 1, target_forwards=1, draft_forwards=draft_forwards,
                       draft_lens=draft_lens)
