"""How fast any mix of n-gram rounds, draft-model rounds and plain decodes could reply, with this
machine's measured step costs: an upper bound for `hybrid` (issue 39's hybrid goal), and for
`ngram` and `sd` under the same rules, from the target's own greedy tokens.

Greedy rounds commit their proposal's agreement with the true continuation plus one token, so an
oracle that knows each position's agreement never proposes past it. At output position i:
- plain decode: 1 token for a target forward of width 1;
- n-gram: up to a_ng[i] tokens (the best of the suffix's earlier occurrences, as
  ngram_bound.best_occurrence), g + 1 tokens for a forward of width g + 1;
- draft chain: up to a_d[i] tokens, g + 1 tokens for g draft steps and a forward of width g + 1.
  a_d comes from one teacher-forced draft forward over prompt + reply: while a chain agrees, the
  draft's context is the reply itself, so its greedy chain is that forward's argmax run.
The cheapest sequence of rounds per reply is a shortest path (`oracle_seconds`). What the bound
leaves out makes it optimistic: the draft's catch-up after rounds it sat out is free, and the
draft's prefill of the prompt is paid once per reply that uses it. Rates are tokens / (the
target's prefill + the rounds [+ the draft's prefill]), all timed here.
"""
from __future__ import annotations

import torch

from ngram_bound import agreement
from specengine.methods.ngram_index import MAX_OCCURRENCES, NgramIndex
from specengine.timing import best_seconds


def ngram_agreements(prompt: list[int], output: list[int], ngram_max: int = 3) -> list[int]:
    """a_ng[i]: the longest agreement with output[i:] of a continuation of an earlier occurrence
    of the longest matching suffix of prompt + output[:i] (0 without one)."""
    index, out = NgramIndex(prompt, ngram_max, 1), []
    for i in range(len(output)):
        _, starts = index.occurrences()
        toks = index.tokens
        out.append(max((agreement(toks[s: s + len(output) - i], output[i:]) for s in starts[-MAX_OCCURRENCES:]),
                       default=0))
        index.extend(output[i: i + 1])
    return out


def draft_runs(pred: list[int], prompt_len: int, output: list[int]) -> list[int]:
    """a_d[i]: how many of output[i:] the draft's greedy chain gets right from position i, where
    pred[j] is the draft's argmax after the first j + 1 tokens of prompt + output."""
    n, runs, run = len(output), [0] * len(output), 0
    for i in range(n - 1, -1, -1):  # the run at i continues the run at i + 1
        run = run + 1 if pred[prompt_len + i - 1] == output[i] else 0
        runs[i] = run
    return runs


def oracle_seconds(n: int, verify_s, a_ng: list[int] | None, a_d: list[int] | None, draft_s: float,
                   gamma_max: int) -> float:
    """The least round time to commit n tokens: plain decodes, n-gram rounds (a_ng; None: none)
    and draft rounds (a_d; None: none), proposals of at most gamma_max tokens."""
    best = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        t = verify_s(1) + best[i + 1]
        for agree, step in ((a_ng, 0.0), (a_d, draft_s)):
            for g in range(1, min(agree[i] if agree else 0, gamma_max) + 1):
                t = min(t, g * step + verify_s(g + 1) + best[min(n, i + g + 1)])
        best[i] = t
    return best[0]


def draft_predictions(eng, ids: list[int]) -> list[int]:
    """The draft's argmax after every prefix of ids: one teacher-forced forward in its runner."""
    runner = eng.draft
    with torch.inference_mode():
        runner.allocate(1, eng.max_seq_len)
        x = torch.tensor([ids], device=runner.device)
        logits = runner.prefill(x, torch.tensor([len(ids)], device=runner.device), attn_len=len(ids), every=True)
    return logits[0].argmax(-1).tolist()


def prefill_seconds(runner, max_seq_len: int, prompt: list[int], repeats: int = 2) -> float:
    """Best of `repeats` wall times of the runner's prefill of the prompt (a fresh cache each)."""
    x = torch.tensor([prompt], device=runner.device)
    lens = torch.tensor([len(prompt)], device=runner.device)
    with torch.inference_mode():
        return best_seconds(lambda: runner.prefill(x, lens, attn_len=len(prompt)), repeats, runner.device,
                            setup=lambda: runner.allocate(1, max_seq_len))


def hybrid_bound(eng, prompts: list[list[int]], outputs: list[list[int]], costs, gamma_max: int = 12) -> dict:
    """Oracle tokens/s of ar, ngram, sd and hybrid over one prompt set (engine: the real pair;
    costs: its measured StepCosts at batch 1, e.g. after the benchmark's hybrid runs)."""
    totals = {k: 0.0 for k in ("ar", "ngram", "sd", "hybrid")}
    tokens, per_prompt = 0, []
    for prompt, output in zip(prompts, outputs):
        n = len(output)
        a_ng = ngram_agreements(prompt, output)
        a_d = draft_runs(draft_predictions(eng, prompt + output), len(prompt), output)
        pre_t = prefill_seconds(eng.target, eng.max_seq_len, prompt)
        pre_d = prefill_seconds(eng.draft, eng.max_seq_len, prompt)
        s = {"ar": pre_t + n * costs.verify_s(1),
             "ngram": pre_t + oracle_seconds(n, costs.verify_s, a_ng, None, costs.draft_s, gamma_max),
             "sd": pre_t + pre_d + oracle_seconds(n, costs.verify_s, None, a_d, costs.draft_s, gamma_max)}
        s["hybrid"] = min(s["ngram"], pre_t + pre_d + oracle_seconds(n, costs.verify_s, a_ng, a_d, costs.draft_s,
                                                                       gamma_max))
        for k in totals:
            totals[k] += s[k]
        tokens += n
        per_prompt.append({"tokens": n, "prefill_target_s": pre_t, "prefill_draft_s": pre_d,
                           "mean_ngram_agreement": sum(a_ng) / max(n, 1), "mean_draft_run": sum(a_d) / max(n, 1),
                           **{f"{k}_s": v for k, v in s.items()}})
    return {"gamma_max": gamma_max, "draft_s": costs.draft_s, "verify_s": list(costs.target_s),
            "tokens_per_s": {k: tokens / v for k, v in totals.items()}, "per_prompt": per_prompt}
