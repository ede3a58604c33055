"""`hybrid:auto`'s round choices replayed without the models: the method's own host-side code
(NgramDecoding.plan, see_tokens, after_round and its policies) driven by the target's greedy
reply, the draft's teacher-forced predictions and this machine's measured costs. Beside it,
`ngram:auto` and `sd:auto` replayed the same way, so that a change to the hybrid's choice can be
judged on a whole prompt set in seconds, before a benchmark run confirms it (issue 39's hybrid
goal; bench/hybrid_bound.py is the oracle above all three). Two rungs above the shipped hybrid:
the same choices told per reply whether the draft's prefill pays (at the start, or never), and
`choice_bound`, which also knows each round's outcome.

Greedy rounds are exact to replay: an n-gram round commits its proposal's agreement with the
reply plus one token; a draft chain of γ from position i commits min(γ, run[i]) + 1, run[i]
being how far the draft's argmax agrees with the reply from i on (hybrid_bound.draft_runs).
Seconds: the target's measured width costs and draft step; the draft's catch-up as its chain
reads it (`catch_up_s`); its deferred prefill at the measured prompt prefill's rate per token.

    python bench/hybrid_policy_replay.py --data bench/results/hybrid_replay_data.json \
        --out bench/results/cpu_hybrid_replay.json   # the data is collected first where the file is missing
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from types import SimpleNamespace

from hybrid_bound import draft_predictions, draft_runs, prefill_seconds
from ngram_bound import agreement
from specengine.benchmark import environment
from specengine.methods.ngram import HybridDecoding, NgramDecoding
from specengine.methods.ngram_index import NgramIndex
from specengine.methods.policies import AutoGammaPolicy
from specengine.runtime.step_costs import StepCosts


def catch_up_s(m, behind: int, costs: StepCosts) -> float:
    """Seconds the draft's chain pays for what it missed (steps.read_missed): its first forward
    widens from 2 to behind + 2 tokens, at most the method's width, and the rest is read before
    it in forwards of the width (the method's `_read_s`), each a draft step scaled by the
    target's cost curve over widths."""
    if behind <= 0:
        return 0.0
    fold = min(behind, m.max_width - 2)
    widen = costs.verify_s(fold + 2) - costs.verify_s(2)
    return m._read_s(behind - fold, costs) + costs.draft_s * widen / costs.verify_s(1)


def replay(method_cls, row: dict, costs: StepCosts, store: dict | None = None,
           primed: bool = False) -> tuple[float, dict]:
    """Seconds of one reply by `ngram:auto` (NgramDecoding) or `hybrid:auto` (HybridDecoding),
    prefills included, and its round counts. store: the engine's acceptance memory (greedy);
    primed: the draft prefilled with the prompt, as `sd` does, instead of deferred."""
    prompt, output = row["prompt"], row["output"]
    run = draft_runs(row["pred"], len(prompt), output)
    m = method_cls(gamma="auto")
    m.ctx, m.key = SimpleNamespace(acceptance={} if store is None else store), "greedy"
    m.hybrid = m.needs_draft
    m.start_rows([prompt], [row.get("max_new", 512)], row["pre_t"])
    m.policy.set_costs(dataclasses.replace(costs, draft_s=0.0))
    if m.hybrid:
        m.draft_policy.recall(m.ctx.acceptance, m.key)
        m.draft_policy.set_costs(costs)
    d_rate = row["pre_d"] / len(prompt)  # the draft's prefill seconds per token
    t, i, kinds = row["pre_t"], 0, {"ngram": 0, "draft": 0, "plain": 0}
    if primed:
        t, m.primed = t + row["pre_d"], [True]
    while i < len(output):
        m.kind, found = m.plan([0])
        kinds[m.kind] += 1
        if m.kind == "draft":
            if not m.primed[0]:
                t += d_rate * (m.n_host[0] - 1)
                m.primed[0], m.gap[0] = True, 1
            g = m.draft_policy.gamma
            t += catch_up_s(m, m.gap[0] - 2, costs) + g * costs.draft_s + costs.verify_s(g + 1)
            a, d = min(g, run[i]), g
        elif m.kind == "ngram":
            toks = found[0][0]
            t += costs.verify_s(len(toks) + 1)
            a, d = agreement(toks, output[i:]), len(toks)
        else:
            t += costs.verify_s(1)
            a, d = 0, 0
        new = output[i: i + a + 1]
        m.see_tokens([new])
        m.after_round([a], [d])
        i += len(new)
    return t, kinds


def replay_sd(row: dict, costs: StepCosts, store: dict | None = None) -> float:
    """Seconds of one reply by `sd:auto` (AutoGammaPolicy's γ per round), prefills included."""
    prompt, output = row["prompt"], row["output"]
    run, pol, store = draft_runs(row["pred"], len(prompt), output), AutoGammaPolicy(), {} if store is None else store
    pol.recall(store, "greedy")
    pol.set_costs(costs)
    t, i = row["pre_t"] + row["pre_d"], 0
    while i < len(output):
        g = pol.gamma
        a = min(g, run[i])
        t += g * costs.draft_s + costs.verify_s(g + 1)
        pol.update([a], [g])
        pol.remember(store, "greedy")
        i += a + 1
    return t


def choice_bound(row: dict, costs: StepCosts) -> float:
    """Seconds of one reply by a hybrid that knows each round's outcome but proposes as the
    shipped policies do: every round, the n-gram proposal NgramGammaPolicy gives, the draft chain
    of AutoGammaPolicy's γ or a plain decode, whichever commits faster (the n-gram's tokens charged
    the draft's later reading); the draft prefilled at the start, or never where that is faster."""
    prompt, output = row["prompt"], row["output"]
    run = draft_runs(row["pred"], len(prompt), output)
    m = HybridDecoding(gamma="auto")
    m.index = [NgramIndex(prompt, *m.sizes)]
    m.policy.set_costs(dataclasses.replace(costs, draft_s=0.0))
    m.draft_policy.set_costs(costs)
    per_token = m._read_s(m.max_width, costs) / m.max_width
    t, i, gap = row["pre_t"] + row["pre_d"], 0, 1
    while i < len(output):
        hit = m.index[0].lookup()
        gammas = m.policy.choose({0: hit[1]}) if hit else {}
        toks = m.index[0].tokens[hit[0]: hit[0] + gammas[0]] if gammas else []
        a_ng, s_ng = agreement(toks, output[i:]), costs.verify_s(len(toks) + 1)
        g = m.draft_policy.gamma
        a_d = min(g, run[i])
        s_d = catch_up_s(m, gap - 2, costs) + g * costs.draft_s + costs.verify_s(g + 1)
        if g and (a_d + 1) / s_d > (a_ng + 1) / (s_ng + per_token * (a_ng + 1)):
            t, a, gap = t + s_d, a_d, 2
            m.draft_policy.update([a], [g])
        else:
            t, a, gap = t + s_ng, a_ng, gap + a_ng + 1
            if toks:
                m.policy.update_rows({0: a}, {0: len(toks)})
        m.index[0].extend(output[i: i + a + 1])
        i += a + 1
    return min(t, replay(NgramDecoding, row, costs)[0])


def replay_set(rows: list[dict], costs: StepCosts, shared: bool = True) -> dict:
    """Tokens/s of ar, ngram, sd and hybrid over one prompt set, and the hybrid's round kinds.
    In the benchmark's order: per prompt, every provider on one engine, `sd` before `hybrid`;
    shared: they share the engine's acceptance memory (else each call starts from the prior)."""
    n = sum(len(r["output"]) for r in rows)
    seconds = {"ar": sum(r["pre_t"] + len(r["output"]) * costs.verify_s(1) for r in rows),
               "ngram": sum(replay(NgramDecoding, r, costs)[0] for r in rows), "sd": 0.0, "hybrid": 0.0,
               "hybrid_told_when_to_prefill": 0.0, "hybrid_choice_bound": sum(choice_bound(r, costs) for r in rows)}
    kinds, store = [], {}
    for r in rows:
        seconds["sd"] += replay_sd(r, costs, store if shared else None)
        s, k = replay(HybridDecoding, r, costs, store if shared else None)
        seconds["hybrid"] += s
        kinds.append(k)
        # the same choices, told per reply whether the draft's prefill pays: at the start, or never
        seconds["hybrid_told_when_to_prefill"] += min(replay(HybridDecoding, r, costs, dict(store), primed=True)[0],
                                                      replay(NgramDecoding, r, costs)[0])
    return {"tokens_per_s": {k: n / s for k, s in seconds.items()}, "hybrid_rounds": kinds}


def collect(eng, report: dict, names=("copy", "humaneval")) -> dict:
    """What a replay needs, per prompt of both sets of a bench/ngram_cpu.py report: the prompt,
    the reference reply, the draft's predictions, both prefill times; and the measured costs."""
    costs = eng.measured_step_costs[1]
    sets = {}
    for name in names:
        rep = report[name]
        sets[name] = [{"prompt": p, "output": o, "pred": draft_predictions(eng, p + o),
                       "pre_t": prefill_seconds(eng.target, eng.max_seq_len, p),
                       "pre_d": prefill_seconds(eng.draft, eng.max_seq_len, p)}
                      for p, o in zip(rep["prompt_ids"], rep["reference_outputs"])]
    return {"draft_s": costs.draft_s, "verify_s": list(costs.target_s), "sets": sets}


def collect_prompts(eng, prompts: list, name: str) -> dict:
    """Replay data for prompts of our own: `ar`'s whole replies (up to 512 tokens, stopping at
    EOS), then what `collect` reads."""
    ids = [eng.encode(p)[0][0] for p in prompts]
    outputs = [eng.generate(i, max_new_tokens=512, method="ar").token_ids for i in ids]
    return collect(eng, {name: {"prompt_ids": ids, "reference_outputs": outputs}}, names=(name,))


def replay_all(data: dict, shared: bool = True) -> dict:
    costs = StepCosts(1, data["draft_s"], tuple(data["verify_s"]))
    out = {name: replay_set(rows, costs, shared) for name, rows in data["sets"].items()}
    mixed = {k: sum(out[s]["tokens_per_s"][k] for s in data["sets"])
             for k in ("ngram", "sd", "hybrid", "hybrid_told_when_to_prefill", "hybrid_choice_bound")}
    best = max(mixed["ngram"], mixed["sd"])
    out["hybrid_vs_best_of_mixed_set"] = mixed["hybrid"] / best
    out["told_when_to_prefill_vs_best_of_mixed_set"] = mixed["hybrid_told_when_to_prefill"] / best
    out["choice_bound_vs_best_of_mixed_set"] = mixed["hybrid_choice_bound"] / best
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="replay data (JSON); collected first if it does not exist")
    ap.add_argument("--report", default="bench/results/cpu_ngram.json", help="whose prompts and replies to collect")
    ap.add_argument("--out", help="write the replay's figures here (JSON)")
    ap.add_argument("--tuning", action="store_true",
                    help="collect from bench/hybrid_tuning_prompts.py instead of the report's prompts")
    args = ap.parse_args(argv)
    try:
        with open(args.data) as f:
            data = json.load(f)
    except FileNotFoundError:
        from specengine import Engine
        from specengine.models.fetch import DEFAULT_DRAFT, DEFAULT_TARGET
        eng = Engine.from_pretrained(DEFAULT_TARGET, draft=DEFAULT_DRAFT, max_seq_len=2048)
        eng.generate("def f(x):", method="hybrid", gamma="auto", max_new_tokens=4)  # measures the step costs
        if args.tuning:
            from hybrid_tuning_prompts import TUNING_PROMPTS
            data = collect_prompts(eng, TUNING_PROMPTS, "tuning")
        else:
            with open(args.report) as f:
                data = collect(eng, json.load(f))
        with open(args.data, "w") as f:
            json.dump(data, f)
    out = replay_all(data)
    for name in data["sets"]:
        print(name, {k: round(v, 1) for k, v in out[name]["tokens_per_s"].items()}, out[name]["hybrid_rounds"])
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"benchmark": "hybrid_policy_replay", "command": " ".join(["python"] + sys.argv),
                       "environment": environment(), "data": args.data, "data_note": data.get("note"), **out},
                      f, indent=2)
    print("hybrid vs best of (ngram, sd), mixed set:", round(out["hybrid_vs_best_of_mixed_set"], 3),
          "| told when to prefill:", round(out["told_when_to_prefill_vs_best_of_mixed_set"], 3),
          "| knowing each round's outcome:", round(out["choice_bound_vs_best_of_mixed_set"], 3))
    return 0


if __name__ == "__main__":
    sys.exit(main())
