"""Where `ngram:auto` stands between what it knows and what an oracle knows: decode-only ratios
against `ar` at one run's measured target costs per verify width, from the target's own greedy
tokens (issue 39's copy-set goal). Host-only: no model runs.

The ladder, each rung knowing less:
- `oracle_best_occurrence`: every round proposes exactly the agreement of the best of the
  suffix's earlier occurrences (hybrid_bound.oracle_seconds over ngram_agreements);
- `oracle_lookup_occurrence`: the same from the occurrence NgramIndex.lookup() picks;
- `calibrated_match_length`: from lookup's occurrence, γ chosen as `ngram:auto` chooses it
  (expected tokens per second from a survival curve per match-length bin), but with each bin's
  true curve over the whole set given up front: the best any policy that sees only the match
  length can do (it is told the set's answers in aggregate, never the round's);
- `shipped_policy`: NgramGammaPolicy itself, replayed round by round, learning as it goes (a
  fresh one per reply, as per generate call): the cost model's view of what the engine does,
  to hold against the measured `ngram:auto` decode ratio.

    python bench/ngram_policy_bound.py bench/results/cpu_ngram.json   # adds "ngram_policy_ladder"
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

from hybrid_bound import ngram_agreements, oracle_seconds
from ngram_bound import agreement
from specengine.methods.ngram_index import NgramIndex
from specengine.methods.ngram_policy import NgramGammaPolicy, match_bin
from specengine.runtime.step_costs import StepCosts


def lookup_hits(prompt: list[int], output: list[int]):
    """At every position i of the reply: (match length, agreement with output[i:]) of the
    continuation NgramIndex.lookup() picks, or None where no suffix occurs earlier."""
    index = NgramIndex(prompt, 3, 1)
    for i in range(len(output)):
        hit = index.lookup()
        yield None if hit is None else (hit[1], agreement(index.tokens[hit[0]: hit[0] + len(output) - i], output[i:]))
        index.extend(output[i: i + 1])


def lookup_agreements(prompt: list[int], output: list[int]) -> list[int]:
    """a[i]: the agreement with output[i:] of the continuation NgramIndex.lookup() picks."""
    return [hit[1] if hit else 0 for hit in lookup_hits(prompt, output)]


def match_curves(prompts, outputs, gamma_max: int) -> dict[int, list[float]]:
    """Per match-length bin, e[γ] = expected accepted tokens of a γ-token proposal from lookup's
    occurrence, over every position of the set."""
    ge, total = defaultdict(lambda: [0] * (gamma_max + 1)), defaultdict(int)
    for prompt, output in zip(prompts, outputs):
        for hit in filter(None, lookup_hits(prompt, output)):
            b = match_bin(hit[0])
            total[b] += 1
            for k in range(1, min(hit[1], gamma_max) + 1):
                ge[b][k] += 1
    curves = {}
    for b, n in total.items():
        e = [0.0]
        for k in range(1, gamma_max + 1):
            e.append(e[-1] + ge[b][k] / n)
        curves[b] = e
    return curves


def replay_seconds(prompt: list[int], output: list[int], verify_s, choose, learn=None) -> float:
    """Round seconds of proposing from lookup's occurrence with γ = choose(match length)
    (0: a plain decode); learn(accepted, proposed) after each proposing round."""
    index, i, t = NgramIndex(prompt, 3, 1), 0, 0.0
    while i < len(output):
        hit = index.lookup()
        proposal = index.tokens[hit[0]: hit[0] + choose(hit[1])] if hit else []
        if hit and not proposal:
            choose(None)  # a declined round (the shipped policy counts those)
        a = agreement(proposal, output[i:])
        if proposal and learn is not None:
            learn(a, len(proposal))
        t += verify_s(len(proposal) + 1)
        step = min(a + 1, len(output) - i)
        index.extend(output[i: i + step])
        i += step
    return t


def calibrated_chooser(curves, verify_s, gamma_max: int):
    def choose(m):
        if m is None:
            return 0
        e = curves.get(match_bin(m), [0.0] * (gamma_max + 1))
        return max(range(gamma_max + 1), key=lambda g: (1 + e[g]) / verify_s(g + 1))
    return choose


def shipped_chooser(costs: StepCosts):
    """NgramGammaPolicy for one row: choose(m) -> γ, learn(accepted, proposed)."""
    pol = NgramGammaPolicy()
    pol.set_costs(costs)

    def choose(m):
        return 0 if m is None else pol.choose({0: m}).get(0, 0)

    def learn(accepted, proposed):
        pol.update_rows({0: accepted}, {0: proposed})
    return choose, learn


def policy_ladder(prompts, outputs, verify_s: list[float], gamma_max: int = 12) -> dict:
    """Decode-only ratios against `ar` (a width-1 forward per token) of every rung, at these costs."""
    costs = StepCosts(1, 0.0, tuple(verify_s))
    v, n = costs.verify_s, sum(len(o) for o in outputs)
    curves = match_curves(prompts, outputs, gamma_max)
    seconds = {"oracle_best_occurrence": 0.0, "oracle_lookup_occurrence": 0.0, "calibrated_match_length": 0.0,
               "shipped_policy": 0.0}
    for p, o in zip(prompts, outputs):
        seconds["oracle_best_occurrence"] += oracle_seconds(len(o), v, ngram_agreements(p, o), None, 0.0, gamma_max)
        seconds["oracle_lookup_occurrence"] += oracle_seconds(len(o), v, lookup_agreements(p, o), None, 0.0, gamma_max)
        seconds["calibrated_match_length"] += replay_seconds(p, o, v, calibrated_chooser(curves, v, gamma_max))
        seconds["shipped_policy"] += replay_seconds(p, o, v, *shipped_chooser(costs))
    return {"gamma_max": gamma_max, "decode_x_ar": {k: n * v(1) / s for k, s in seconds.items()}}


def ladder_of(rep: dict, verify_s: list[float]) -> dict:
    """policy_ladder of one run_benchmark report, with its measured `ngram:auto` decode ratio beside."""
    out = policy_ladder(rep["prompt_ids"], rep["reference_outputs"], verify_s)
    measured = {r["provider"]: r for r in rep["results"]}
    if "ngram:auto" in measured and "ar" in measured:
        out["decode_x_ar"]["measured_ngram_auto"] = \
            measured["ngram:auto"]["decode_tokens_per_s"] / measured["ar"]["decode_tokens_per_s"]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("report", help="a bench/ngram_cpu.py JSON with hybrid_bound (its measured costs)")
    args = ap.parse_args(argv)
    with open(args.report) as f:
        report = json.load(f)
    verify = report["hybrid_bound"]["copy"]["verify_s"]
    report["ngram_policy_ladder"] = {name: ladder_of(report[name], verify) for name in ("copy", "humaneval")}
    for name, ladder in report["ngram_policy_ladder"].items():
        print(name, {k: round(x, 3) for k, x in ladder["decode_x_ar"].items()})
    with open(args.report, "w") as f:
        json.dump(report, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
