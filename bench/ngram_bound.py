"""How much any n-gram chain drafter could commit on a prompt set: an upper bound on its tokens
per target forward (τ), from the target's own greedy tokens (issue 39's "why the copy-set goal
is not met").

Replaying `ar`'s tokens round by round, each round proposes up to `gamma` tokens that followed
an earlier occurrence of the history's longest recent suffix (the engine's NgramIndex), and
commits the proposal's agreement with the true continuation plus one token:
- `most_recent`: the occurrence `ngram:10` proposes from (transformers' rule but the most
  recent occurrence);
- `best_occurrence`: the one of those occurrences that turns out to agree longest: what a
  drafter choosing among them could reach if it knew the answer.
Every round proposes (its verify is taken as free), so the ratio against `ar` these allow in
decoding is τ itself, and with prefill `1 / (prefill + (1 - prefill) / τ)` of `ar`'s time.
"""
from __future__ import annotations

from specengine.methods.ngram_index import MAX_OCCURRENCES, NgramIndex


def agreement(proposal: list[int], truth: list[int]) -> int:
    n = 0
    while n < min(len(proposal), len(truth)) and proposal[n] == truth[n]:
        n += 1
    return n


def replay_tau(prompt: list[int], output: list[int], gamma: int, choose: str, ngram_max: int = 3) -> tuple[int, int]:
    """(tokens committed, rounds) of replaying `output` after `prompt` with one rule."""
    index, i, rounds = NgramIndex(prompt, ngram_max, 1), 0, 0
    while i < len(output):
        _, starts = index.occurrences()
        truth, toks = output[i:], index.tokens
        if not starts:
            accepted = 0
        elif choose == "most_recent":
            accepted = agreement(toks[starts[-1]: starts[-1] + gamma], truth)
        else:
            accepted = max(agreement(toks[s: s + gamma], truth) for s in starts[-MAX_OCCURRENCES:])
        step = min(accepted + 1, len(output) - i)
        index.extend(output[i: i + step])
        i, rounds = i + step, rounds + 1
    return len(output), rounds


def copy_bound(prompts: list[list[int]], outputs: list[list[int]], gamma: int = 16,
               prefill_fraction: float | None = None) -> dict:
    """τ per rule over the whole set (tokens / rounds) and per prompt; with `ar`'s prefill share
    of its wall time, the whole-call ratio against `ar` each τ would allow with free verifies."""
    out = {"gamma": gamma, "per_prompt": []}
    for rule in ("most_recent", "best_occurrence"):
        runs = [replay_tau(p, o, gamma, rule) for p, o in zip(prompts, outputs)]
        out[f"tau_{rule}"] = sum(t for t, _ in runs) / max(sum(r for _, r in runs), 1)
        out["per_prompt"].append({rule: [t / max(r, 1) for t, r in runs]})
        if prefill_fraction is not None:
            out[f"ratio_bound_{rule}"] = 1 / (prefill_fraction + (1 - prefill_fraction) / out[f"tau_{rule}"])
    if prefill_fraction is not None:
        out["ar_prefill_fraction"] = prefill_fraction
    return out
