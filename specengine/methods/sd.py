"""`sd`: chain speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

One round: the draft proposes γ tokens autoregressively; the target scores
[last committed, d1..dγ] in one forward; the rejection sampler accepts a prefix and adds
one corrected or bonus token; the driver rolls both caches back by setting their lengths.
γ comes from a draft-length policy (`policies.py`), `auto` by default.

Draft cache bookkeeping: after a round the draft holds the committed prefix plus
d1..d_{γ-1}, so it is 1 or 2 tokens behind the new committed length (2 when all drafts
were accepted: dγ and the bonus are unseen). The first draft step therefore feeds the
two tokens starting at its length and reads the logits of the right one: no host sync.
"""
from __future__ import annotations

import torch

from ..errors import SpecEngineError
from ..sampling import filter_logits
from .base import Method, speculative_stats
from .common import DecodeState, RoundOutput
from .policies import make_policy


def catch_up_inputs(draft, state: DecodeState, upto: torch.Tensor):
    """The draft's 2-token catch-up feed: (tokens at its length and the next one [B,2], which
    of their logits continues the chain [B] (the last unseen token: 1 or 2 are unseen))."""
    seen = draft.cache.lens.to(torch.int64)
    return state.tokens.gather(1, state.positions(seen, 2)), (upto - 1 - seen).clamp(0, 1)


def draft_catch_up(draft, state: DecodeState, upto: torch.Tensor, return_hidden: bool = False):
    """Feed the draft the tokens of state.tokens[:, :upto] it has not seen (1 or 2 per row);
    returns the logits after the last one [B,V] (and its final hidden state [B,H])."""
    tok2, which = catch_up_inputs(draft, state, upto)
    out = draft.verify(tok2, attn_len=state.attn_len, return_hidden=return_hidden)
    draft.cache.set_lens(upto)
    rows = torch.arange(state.batch, device=which.device)
    return (out[0][rows, which], out[1][rows, which]) if return_hidden else out[rows, which]


def draft_chain(draft, state: DecodeState, gamma: int, upto: torch.Tensor | None = None, policy=None):
    """Up to γ draft tokens per row [B,γ'] continuing state.tokens[:, :upto] (default: the
    committed tokens), their q [B,γ',V] (None if greedy) and the draft's confidences [B,γ'].
    A policy that wants hidden states (specdec++) sees each step's and may end the loop
    early (γ' < γ) once every row has stopped."""
    observe = policy is not None and policy.wants_hidden
    upto = state.n if upto is None else upto
    chain = None if observe else getattr(draft, "chain_graphs", lambda: None)()
    if chain is not None:  # the whole chain as one CUDA graph replay (draft_graph.py)
        out = chain.run(state, gamma, *catch_up_inputs(draft, state, upto), draft.cache.lens, upto)
        if out is not None:
            return out
    if observe:
        policy.begin_round(state.batch, state.tokens.device)
    out = draft_catch_up(draft, state, upto, return_hidden=observe)
    toks, qs, confs = [], [], []
    for j in range(gamma):
        if j:
            out = draft.decode(toks[-1], attn_len=state.attn_len, return_hidden=observe)
            draft.cache.set_lens(draft.cache.lens + 1)
        logits, hidden = out if observe else (out, None)
        tok, q, conf = state.draft_sampler(logits, state.params, state.seed, state.offset, j)
        toks.append(tok), qs.append(q), confs.append(conf)
        if observe and policy.observe(hidden, j):
            break
    q = None if state.params.greedy else torch.stack(qs, 1)
    return torch.stack(toks, 1), q, torch.stack(confs, 1)


def verify_and_commit(engine, state: DecodeState, drafts, q, num_draft, timer):
    """One target forward over [last committed, drafts], rejection sampling, commit.
    Returns (tokens [B,K+1], n_acc [B])."""
    with timer.phase("target"):
        logits = engine.target.verify(torch.cat([state.last_tokens()[:, None], drafts], 1), attn_len=state.attn_len)
    out, n_acc = state.sampler(filter_logits(logits, state.params), drafts, q, num_draft,
                               state.temperature, state.seed, state.offset)
    state.commit(out, n_acc + 1)
    return out, n_acc


class SpeculativeDecoding(Method):
    name = "sd"

    takes_threshold = True
    takes_tree = True

    def __init__(self, engine, gamma=None, policy=None, threshold=None, tree=None):
        super().__init__(engine, tree=tree)
        if self.tree is not None and (gamma is not None or policy not in (None, "fixed") or threshold is not None):
            raise SpecEngineError("sd with a tree takes its shape from the tree ('KxD:N'), not gamma/policy/threshold")
        if self.tree is not None:
            gamma, policy = self.tree.depth, "fixed"
        self.policy = make_policy(policy or engine.policy, engine.gamma if gamma is None else gamma,
                                  threshold=engine.threshold if threshold is None else threshold)
        self.gammas: list[int] = []  # γ of every round

    @property
    def max_width(self) -> int:
        if self.tree is not None:  # the verify forward, or the last draft forward over D-1 levels
            return max(self.tree.nodes + 1, (self.tree.depth - 1) * self.tree.topk, 2)
        return self.policy.gamma_max + 1

    def begin(self, generation) -> None:
        if self.tree is not None:
            return
        if self.policy.wants_hidden:  # specdec++: the acceptance head for this draft and mode
            mode = "greedy" if generation.state.params.greedy else "sampled"
            # reading a flag per draft step is free only without an asynchronous device queue
            self.policy.attach(self.engine.acceptance_head(mode), early_exit=self.engine.device.type == "cpu")
        if self.policy.needs_costs:  # gamma="auto": γ from measured step costs
            self.policy.set_costs(self.engine.step_costs(generation.state, self.max_width))

    def round(self, state: DecodeState, timer) -> RoundOutput:
        draft, gamma = self.engine.draft, self.policy.gamma
        if self.tree is not None:
            from .trees import draft_tree, verify_tree_and_commit

            with timer.phase("draft"):
                tree = draft_tree(draft, state, self.tree)
            return verify_tree_and_commit(self.engine, state, tree, self.tree, timer, draft_forwards=self.tree.depth)
        start = state.n.clone()
        with timer.phase("draft"):
            drafts, q, conf = draft_chain(draft, state, gamma, policy=self.policy)
            num_draft = self.policy.num_draft(conf)
        gamma = drafts.shape[1]  # a policy may have ended the loop early
        self.gammas.append(gamma)
        out, n_acc = verify_and_commit(self.engine, state, drafts, q, num_draft, timer)
        # the draft saw d1..d_{γ-1}: valid up to start + min(n_acc, γ-1), never past the new n - 1
        seen = start + torch.clamp(n_acc.to(torch.int64), max=gamma - 1)
        return RoundOutput(out, n_acc, num_draft, n_acc + 1, target_forwards=1, draft_forwards=gamma,
                           draft_lens=torch.minimum(seen, state.n - 1))

    def after_round(self, n_acc, num_draft) -> None:
        if self.tree is None:
            self.policy.update(n_acc, num_draft)

    def stats(self, generation) -> dict:
        return {"policy": self.policy.name, "gamma": self.policy.gamma, **self.tree_stats(),
                "gamma_mean": sum(self.gammas) / max(len(self.gammas), 1),
                **speculative_stats(generation, generation.timer.totals())}
