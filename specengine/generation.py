"""The decoding driver: prefill, speculative rounds until every row is done, stats.

Exactly one host sync per round (reading what the round committed); stopping on EOS,
stop strings and `max_new_tokens` is decided on the host from that read, and finished
rows are frozen on the device so they never grow or overflow the cache.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .errors import SpecEngineError
from .graphs import padded_width
from .methods.ar import ar_round
from .methods.common import DecodeState
from .methods.pearl import gamma_for, new_state, pearl_round
from .methods.sd import sd_round
from .sampling import SamplingParams
from .timing import PhaseTimer

ATTN_BUCKET = 64  # attention reads a prefix of the cache rounded up to this many positions


def attn_bound(length: int, max_seq_len: int) -> int:
    """The cache prefix a step reads: `length` rounded up to ATTN_BUCKET, within the buffer."""
    return min(-(-length // ATTN_BUCKET) * ATTN_BUCKET, max_seq_len)


@dataclass
class RowState:
    prompt_len: int
    ids: list[int] = field(default_factory=list)  # generated ids (kept ones)
    finish_reason: str | None = None
    stop_text_end: int | None = None  # where a stop string starts in the text, if one hit


@dataclass
class Counters:
    rounds: int = 0
    target_forwards: int = 0
    draft_forwards: int = 0
    row_target_forwards: int = 0  # target forwards summed over active rows
    proposed: int = 0
    accepted: int = 0
    round_tokens: int = 0  # committed per round per active row (before truncation)
    row_rounds: int = 0
    gamma_sum: int = 0  # draft length of every round (γ may change between rounds)


class Generation:
    """One generate call over a batch of token-id prompts; iterate `rounds()` to drive it."""

    def __init__(self, engine, prompts: list[list[int]], params: SamplingParams, max_new_tokens: int,
                 method: str, policy, stop_ids: set[int], stop_strings: list[str]):
        self.engine, self.params, self.method, self.policy = engine, params, method, policy
        self.max_new = max_new_tokens
        self.stop_ids, self.stop_strings = stop_ids, stop_strings
        self.rows = [RowState(len(p)) for p in prompts]
        self.c = Counters()
        self.cost_ratio = None  # pearl: the measured c behind its window
        self.t0 = time.perf_counter()
        self.timer = PhaseTimer(engine.device)
        self.st = self._prefill(prompts)
        self.st.attn_len = attn_bound(max(r.prompt_len for r in self.rows) + 1, engine.max_seq_len)
        if method == "pearl":
            self.policy = self._pearl_state(policy)
        elif getattr(policy, "needs_costs", False):  # gamma="auto": γ from measured step costs
            policy.set_costs(engine.step_costs(self.st, policy.gamma_max + 1))
        self.prefill_s = time.perf_counter() - self.t0

    # ------------------------------------------------------------------ set-up
    def _models(self):
        return [self.engine.target] + ([self.engine.draft] if self.method != "ar" else [])

    def _prefill(self, prompts) -> DecodeState:
        eng, B, S = self.engine, len(prompts), self.engine.max_seq_len
        dev = eng.device
        tokens = torch.zeros(B, S, dtype=torch.int64)
        for b, p in enumerate(prompts):
            tokens[b, : len(p)] = torch.tensor(p)
        tokens = tokens.to(dev)
        lens = torch.tensor([len(p) for p in prompts], dtype=torch.int64, device=dev)
        longest = max(len(p) for p in prompts)
        for model in self._models():  # every cache holds the prompt but its last token
            model.setup_cache(B, S)
            if longest > 1:
                model.prefill(tokens[:, : longest - 1], lens - 1, attn_len=longest - 1)
        temp = torch.full((B,), float(self.params.temperature), device=dev)
        return DecodeState(
            tokens=tokens, n=lens.clone(), active=torch.ones(B, dtype=torch.bool, device=dev),
            params=self.params, temperature=temp,
            seed=torch.full((B,), self.params.seed, dtype=torch.int64, device=dev),
            offset=torch.zeros((), dtype=torch.int64, device=dev), sampler=eng.sampler,
        )

    def _pearl_state(self, gamma):
        """γ given by the user, or round(1/c) from c measured once per engine and batch size."""
        self.cost_ratio = self.engine.step_costs(self.st, 1).cost_ratio
        return new_state(len(self.rows), gamma if gamma is not None else gamma_for(self.cost_ratio),
                         self.st.tokens.device)

    # ------------------------------------------------------------------ rounds
    def _round(self):
        if self.method == "ar":
            return ar_round(self.engine.target, self.st, self.timer)
        if self.method == "pearl":
            with self.timer.phase("round"):
                return pearl_round(self.engine.target, self.engine.draft, self.st, self.policy, self.timer,
                                   self.engine.side_stream())
        return sd_round(self.engine.target, self.engine.draft, self.st, self.policy, self.timer)

    def rounds(self):
        """Run rounds until every row is done; yields the ids each row kept this round."""
        headroom = 2 * padded_width(getattr(self.policy, "gamma_max", 0) + 1)
        while any(r.finish_reason is None for r in self.rows):
            longest = max(r.prompt_len + len(r.ids) for r in self.rows)
            self.st.attn_len = attn_bound(longest + headroom, self.engine.max_seq_len)
            out = self._round()
            B, K1 = out.tokens.shape
            host = torch.cat([out.tokens.flatten(), out.n_acc.to(torch.int64), out.num_draft.to(torch.int64),
                              out.n_committed.to(torch.int64)]).tolist()  # the round's one sync
            toks = host[: B * K1]
            n_acc, num_draft, n_new = (host[B * K1 + i * B: B * K1 + (i + 1) * B] for i in range(3))
            yield self._book(out, [toks[b * K1: b * K1 + n_new[b]] for b in range(B)], n_acc, num_draft)

    def _book(self, out, committed, n_acc, num_draft) -> list[list[int]]:
        c = self.c
        c.rounds += 1
        c.gamma_sum += getattr(self.policy, "gamma", 0)
        c.target_forwards += out.target_forwards
        c.draft_forwards += out.draft_forwards
        was_active = [r.finish_reason is None for r in self.rows]
        kept_all = []
        for b, row in enumerate(self.rows):
            if not was_active[b]:
                kept_all.append([])
                continue
            c.row_target_forwards += out.target_forwards
            c.proposed += num_draft[b]
            c.accepted += n_acc[b]
            c.round_tokens += n_acc[b] + 1
            c.row_rounds += 1
            kept = self._keep(row, committed[b])
            row.ids.extend(kept)
            kept_all.append(kept)
        if self.method != "ar":
            act = [b for b in range(len(self.rows)) if was_active[b]]
            self.policy.update([n_acc[b] for b in act], [num_draft[b] for b in act])
        now_active = [r.finish_reason is None for r in self.rows]
        if now_active != was_active:
            self.st.active.copy_(torch.tensor(now_active))
        return kept_all

    def _keep(self, row: RowState, new: list[int]) -> list[int]:
        """Truncate a row's new tokens at EOS / max_new_tokens / a stop string."""
        kept = []
        for t in new:
            kept.append(t)
            if t in self.stop_ids:
                row.finish_reason = "eos"
                break
            if len(row.ids) + len(kept) >= self.max_new:
                row.finish_reason = "length"
                break
        if self.stop_strings:
            text = self.engine.decode(row.ids + kept)
            hits = [i for i in (text.find(s) for s in self.stop_strings) if i >= 0]
            if hits:
                row.finish_reason, row.stop_text_end = "stop", min(hits)
        return kept

    # ------------------------------------------------------------------ results
    def stats(self) -> dict:
        wall = time.perf_counter() - self.t0
        c = self.c
        new_tokens = sum(len(r.ids) for r in self.rows)
        s = {
            "method": self.method,
            "batch": len(self.rows),
            "new_tokens": new_tokens,
            "wall_time_s": wall,
            "prefill_s": self.prefill_s,
            "tokens_per_s": new_tokens / wall if wall > 0 else 0.0,
            "target_forwards": c.target_forwards,
            "tokens_per_target_forward": new_tokens / max(c.row_target_forwards, 1),
        }
        if self.method != "ar":
            times = self.timer.totals()
            per_draft = times.get("draft", 0.0) / max(c.draft_forwards, 1)
            per_target = times.get("target", 0.0) / max(c.target_forwards, 1)
            s.update({
                "policy": self.policy.name,
                "gamma": self.policy.gamma,
                "gamma_mean": c.gamma_sum / max(c.rounds, 1),
                "draft_forwards": c.draft_forwards,
                "proposed_drafts": c.proposed,
                "accepted_drafts": c.accepted,
                "acceptance_rate": c.accepted / max(c.proposed, 1),
                "mean_accepted_tokens": c.round_tokens / max(c.row_rounds, 1),
                "draft_cost_ratio": per_draft / per_target if per_target > 0 else None,
            })
        if self.method == "pearl":  # MAT: mean run length between rejections (PEARL's definition)
            runs = self.policy.rejections + sum(1 for r in self.rows if r.ids)
            rounds = max(c.rounds, 1)
            s.update({
                "mean_accepted_tokens": new_tokens / max(runs, 1),
                "measured_cost_ratio": self.cost_ratio,
                "round_draft_s": times.get("draft", 0.0) / rounds,
                "round_target_s": times.get("target", 0.0) / rounds,
                "round_wall_s": times.get("round", 0.0) / rounds,
                "concurrent": self.engine.device.type == "cuda",
            })
        return s


def check_capacity(prompts: list[list[int]], max_new_tokens: int, max_seq_len: int, headroom: int) -> None:
    longest = max(len(p) for p in prompts)
    if longest >= max_seq_len:
        raise SpecEngineError(f"prompt has {longest} tokens but the cache holds max_seq_len={max_seq_len}")
    need = longest + max_new_tokens + headroom
    if need > max_seq_len:
        raise SpecEngineError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) + speculation headroom "
            f"({headroom}) = {need} exceeds max_seq_len={max_seq_len}; raise max_seq_len or lower max_new_tokens")
