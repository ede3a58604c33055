"""N-gram drafting (method "ngram"): the matcher against a plain-Python reference, and the
method token-exact with `ar` (chains, trees, γ auto, ragged batches, EOS and stop strings)."""
import dataclasses
import random
from types import SimpleNamespace

import pytest
import torch

from specengine import Engine
from specengine.methods.context import MethodContext
from specengine.methods.hybrid import HybridDecoding
from specengine.methods.ngram_index import MATCH_CAP, MAX_OCCURRENCES, NgramIndex
from specengine.methods.ngram_policy import PROBE_EVERY, NgramGammaPolicy, match_bin
from specengine.errors import SpecEngineError
from specengine.row_state import RowState
from specengine.runtime.step_costs import StepCosts


def reference_propose(tokens, gamma, nmax, nmin):
    """The longest suffix (nmax..nmin) that occurs earlier; the γ tokens after its latest earlier occurrence."""
    L = len(tokens)
    for n in range(nmax, nmin - 1, -1):
        if L < n:
            continue
        suffix = tokens[L - n:]
        for start in range(L - n - 1, -1, -1):  # latest earlier occurrence first (may overlap the suffix)
            if tokens[start:start + n] == suffix:
                return tokens[start + n: start + n + gamma]
    return []


def sequences():
    rng = random.Random(0)
    for vocab, length in ((2, 40), (3, 60), (5, 80), (50, 60)):
        yield [rng.randrange(vocab) for _ in range(length)]
    yield [7] * 30  # one repeated token: every match overlaps its suffix
    yield [1, 2, 3] * 10 + [4]  # a period, then a token never seen


@pytest.mark.parametrize("nmax,nmin", [(3, 1), (2, 2), (5, 2), (1, 1)])
@pytest.mark.parametrize("gamma", [1, 4, 10])
def test_chain_proposals_equal_the_reference_at_every_length(nmax, nmin, gamma):
    for seq in sequences():
        index = NgramIndex(seq[:3], nmax, nmin)
        for L in range(3, len(seq) + 1):
            if L > 3:
                index.extend(seq[L - 1:L])  # grown token by token, as rounds commit
            assert index.propose(gamma) == reference_propose(seq[:L], gamma, nmax, nmin), (seq[:L], gamma)
        assert NgramIndex(seq, nmax, nmin).propose(gamma) == index.propose(gamma)  # built at once: the same


def reference_lookup(tokens, nmax, nmin):
    """Occurrences of the longest repeated suffix; the one preceded by the longest agreement with
    the history's end (capped), the latest on a tie: (its continuation start, that length)."""
    L = len(tokens)
    for n in range(nmax, nmin - 1, -1):
        if L < n:
            continue
        starts = [s + n for s in range(L - n) if tokens[s:s + n] == tokens[L - n:]][-MAX_OCCURRENCES:]
        if not starts:
            continue
        def agree(s):
            m = 0
            while m < MATCH_CAP and m < s and tokens[s - 1 - m] == tokens[L - 1 - m]:
                m += 1
            return m
        return max(((s, agree(s)) for s in reversed(starts)), key=lambda c: c[1])  # max keeps the first: latest
    return None


@pytest.mark.parametrize("nmax,nmin", [(3, 1), (2, 2), (1, 1)])
def test_lookup_equals_the_reference_at_every_length(nmax, nmin):
    seqs = list(sequences()) + [[1, 2, 3, 4, 9, 1, 2, 3, 4, 8, 5, 2, 3, 4, 7, 1, 2, 3, 4]]  # the older, longer match wins
    for seq in seqs:
        index = NgramIndex(seq[:1], nmax, nmin)
        for L in range(2, len(seq) + 1):
            index.extend(seq[L - 1:L])
            assert index.lookup() == reference_lookup(seq[:L], nmax, nmin), seq[:L]
    last = NgramIndex(seqs[-1], 3, 1)  # "2 3 4" at 1, 6 and 11: preceded by "1" at 1 and 6, by "5" at 11
    assert last.lookup() == (9, 4) and last.propose(1) == [7]  # the longer agreement (latest of a tie), not the latest


def test_matches_run_to_the_end_of_the_history():
    index = NgramIndex([5, 6, 7, 5, 6], ngram_max=2)
    assert index.propose(10) == [7, 5, 6]  # "5 6" occurred at 0: its continuation runs to the end
    assert NgramIndex([1, 2, 3], ngram_max=3).propose(4) == []  # nothing repeats


def tree_paths(tokens, parents):
    paths = []
    for i in range(len(tokens)):
        path, j = [], i + 1
        while j:
            path.insert(0, tokens[j - 1])
            j = parents[j - 1]
        paths.append(tuple(path))
    return paths


@pytest.mark.parametrize("topk,depth,budget", [(1, 4, 4), (2, 3, 5), (3, 4, 12), (8, 6, 48)])
def test_tree_nodes_are_continuations_closed_and_ranked(topk, depth, budget):
    for seq in sequences():
        for L in range(4, len(seq) + 1, 5):
            hist = seq[:L]
            tokens, parents = NgramIndex(hist, 3, 1).propose_tree(topk, depth, budget)
            n, starts = NgramIndex(hist, 3, 1).occurrences()
            conts = [tuple(hist[s:s + depth]) for s in starts[-MAX_OCCURRENCES:]]
            prefixes = {c[:d] for c in conts for d in range(1, len(c) + 1)}
            paths = tree_paths(tokens, parents)
            assert len(tokens) <= budget and len(set(paths)) == len(paths)
            assert all(p < i + 1 for i, p in enumerate(parents))  # a parent precedes its child
            assert set(paths) <= prefixes  # every node continues an earlier occurrence
            for node in range(len(tokens) + 1):
                assert parents.count(node) <= topk
            if not conts:
                assert tokens == []
            elif budget >= len(prefixes) and topk >= 8:  # room for everything: every continuation
                assert set(paths) == prefixes
            if conts:  # the most frequent first token is always kept
                firsts = [c[0] for c in conts]
                best = max(firsts.count(t) for t in set(firsts))
                assert any(len(p) == 1 and firsts.count(p[0]) == best for p in paths)


def test_bad_sizes_are_refused():
    with pytest.raises(SpecEngineError, match="ngram_min .* must not exceed"):
        NgramIndex([1], ngram_max=2, ngram_min=3)
    with pytest.raises(SpecEngineError, match="ngram_max must be an integer >= 1"):
        NgramIndex([1], ngram_max=0)


# ------------------------------------------------------------------ the method on tiny models
PROMPTS = ["def add(a, b):\n    return a + b\n\ndef add(a, b):\n", "x = [1, 2, 3, 1, 2", "q"]


@pytest.fixture(scope="module")
def eng(tiny_pair, tokenizer):
    return Engine(tiny_pair[0], tokenizer, max_seq_len=256)


@pytest.fixture(scope="module")
def ar_out(eng):
    return eng.generate(PROMPTS, max_new_tokens=48, method="ar", ignore_eos=True)


CALLS = {
    "gamma1": dict(gamma=1),
    "gamma4": dict(gamma=4),
    "gamma10": dict(gamma=10),
    "bigram-only": dict(gamma=5),  # with ngram_min = 2 (below)
    "auto": dict(gamma="auto"),
    "tree": dict(tree="3x4:8"),
    "tree-wide": dict(tree="4x6:20"),
    "tree-auto": dict(tree="auto"),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_greedy_equals_ar_batched_with_ragged_rows(eng, ar_out, tiny_pair, tokenizer, name):
    e = Engine(tiny_pair[0], tokenizer, max_seq_len=256, ngram_min=2) if name == "bigram-only" else eng
    out = e.generate(PROMPTS, max_new_tokens=48, method="ngram", ignore_eos=True, **CALLS[name])
    assert [r.token_ids for r in out] == [r.token_ids for r in ar_out]
    stats = out[0].stats
    assert stats["accepted_drafts"] > 0 and stats["matched_rounds"] > 0  # the copy path ran
    assert stats["target_forwards"] < 48  # and saved forwards
    for prompt, a in zip(PROMPTS, ar_out):  # each row alone: the same tokens
        assert e.generate(prompt, max_new_tokens=48, method="ngram", ignore_eos=True,
                          **CALLS[name]).token_ids == a.token_ids


def test_a_round_without_a_match_is_a_plain_decode(eng):
    r = eng.generate("q", max_new_tokens=1, method="ngram", gamma=4, ignore_eos=True)
    assert r.stats["plain_rounds"] == r.stats["rounds"] == 1 and r.stats["proposed_drafts"] == 0


@pytest.mark.parametrize("call", [dict(gamma=6), dict(tree="3x4:8")], ids=["chain", "tree"])
def test_eos_and_stop_strings_inside_accepted_spans(eng, ar_out, tokenizer, call):
    """EOS (or a stop string) that arrives inside an accepted span ends the row right there, as in ar."""
    ids = ar_out[0].token_ids
    cut = next(i for i in range(8, len(ids)) if ids[i] not in ids[:i] or i == len(ids) - 1)
    eos_eng = Engine(eng.target.model, tokenizer, max_seq_len=256)
    eos_eng.eos_ids = {ids[cut]}
    want = eos_eng.generate(PROMPTS[0], max_new_tokens=48, method="ar").token_ids
    got = eos_eng.generate(PROMPTS[0], max_new_tokens=48, method="ngram", **call)
    assert got.token_ids == want and got.finish_reason == "eos"
    stop = tokenizer.decode(ar_out[0].token_ids[20:23])
    a = eng.generate(PROMPTS[0], max_new_tokens=48, method="ar", stop=stop, ignore_eos=True)
    n = eng.generate(PROMPTS[0], max_new_tokens=48, method="ngram", stop=stop, ignore_eos=True, **call)
    assert n.text == a.text and n.finish_reason == a.finish_reason == "stop"


def test_engine_with_draft_ngram_and_options_are_checked(tiny_dir, tokenizer):
    e = Engine.from_pretrained(str(tiny_dir), draft="ngram", max_seq_len=128, dtype="float32")
    assert e.draft is None and e.method == "ngram"
    assert e.generate("def f(x):", max_new_tokens=4).stats["method"] == "ngram"
    with pytest.raises(SpecEngineError, match="draft-length policy 'confidence' applies to sd"):
        e.generate("x", max_new_tokens=2, policy="confidence")
    with pytest.raises(SpecEngineError, match="takes its shape from the tree"):
        e.generate("x", max_new_tokens=2, gamma=3, tree="2x2")
    with pytest.raises(SpecEngineError, match="ngram_min"):
        Engine.from_pretrained(str(tiny_dir), draft="ngram", ngram_min=4, ngram_max=2)


@pytest.mark.parametrize("gamma", [3, "auto"])
def test_hybrid_with_a_draft_model_equals_ar(tiny_pair, tokenizer, ar_out, gamma):
    """With a draft model, rows without a match get the draft's chains, matched rounds the n-gram
    proposals; the draft reads what it missed before drafting again. Both kinds must run."""
    e = Engine(tiny_pair[0], tokenizer, tiny_pair[2], max_seq_len=256)
    # γ auto under costs where the draft pays (the tiny models' own make it choose plain decoding)
    e.step_costs = lambda state, width, draft=True: StepCosts(state.batch, draft_s=0.05, target_s=(1.0,) * width)
    out = e.generate(PROMPTS, max_new_tokens=48, method="hybrid", gamma=gamma, ignore_eos=True)
    assert [r.token_ids for r in out] == [r.token_ids for r in ar_out]
    single = [e.generate(p, max_new_tokens=48, method="hybrid", gamma=gamma, ignore_eos=True) for p in PROMPTS]
    assert [r.token_ids for r in single] == [r.token_ids for r in ar_out]
    stats = [out[0].stats] + [r.stats for r in single]
    assert all(s["hybrid"] for s in stats)
    assert sum(s["draft_rounds"] for s in stats) > 0 and sum(s["matched_rounds"] for s in stats) > 0


def test_hybrid_auto_prefills_the_draft_only_when_it_drafts(tiny_pair, tokenizer, ar_out):
    """γ auto defers the draft's prefill to its first chain: a reply the draft never drafts leaves
    its cache empty; one it does draft reads the row's text once, and the draft's K/V of the prompt
    then equal those an `sd` call's prefill writes."""
    e = Engine(tiny_pair[0], tokenizer, tiny_pair[2], max_seq_len=256)
    e.step_costs = lambda state, width, draft=True: StepCosts(state.batch, draft_s=50.0, target_s=(1.0,) * width)
    r = e.generate(PROMPTS[0], max_new_tokens=24, method="hybrid", gamma="auto", ignore_eos=True)
    assert r.token_ids == ar_out[0].token_ids[:24]
    assert r.stats["draft_rounds"] == r.stats["draft_forwards"] == r.stats["draft_prefills_deferred"] == 0
    assert e.draft.cache.lens.tolist() == [0]  # nothing was prefilled into it
    prompt = tokenizer.encode(PROMPTS[1])
    e.generate(PROMPTS[1], max_new_tokens=1, method="sd", gamma=2, ignore_eos=True)
    want = e.draft.cache.kv[:, :, 0, : len(prompt) - 1].clone()  # the driver's prefill of the prompt
    e.step_costs = lambda state, width, draft=True: StepCosts(state.batch, draft_s=0.05, target_s=(1.0,) * width)
    primes, prefill = [], e.draft.prefill

    def spy(tokens, lens, **kw):  # what each row's deferred prefill read, against the target's length then
        for row, length in enumerate(lens.tolist()):
            primes.append((row, tokens[row, :length].tolist(), length, int(e.target.cache.lens[row])))
        return prefill(tokens, lens, **kw)
    e.draft.prefill = spy
    out = e.generate(PROMPTS, max_new_tokens=48, method="hybrid", gamma="auto", ignore_eos=True)
    e.draft.prefill = prefill
    assert [o.token_ids for o in out] == [a.token_ids for a in ar_out]
    assert out[0].stats["draft_rounds"] > 0 and out[0].stats["draft_prefills_deferred"] == len(PROMPTS)
    assert sorted(row for row, *_ in primes) == list(range(len(PROMPTS)))
    for row, read, length, target_len in primes:  # the row's text but its last token, as a prefill leaves it
        text = tokenizer.encode(PROMPTS[row]) + ar_out[row].token_ids
        assert read == text[:length] and length == target_len and length >= len(tokenizer.encode(PROMPTS[row])) - 1
    got = e.draft.cache.kv[:, :, 1, : len(prompt) - 1]
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    fixed = e.generate(PROMPTS[0], max_new_tokens=8, method="hybrid", gamma=3, ignore_eos=True)
    assert fixed.stats["draft_prefills_deferred"] == 0  # a fixed γ drafts wherever a row has no match


def test_hybrid_costs_the_deferred_prefill_and_reads_the_row_once():
    """A row whose text the draft has not read costs its prefill: the draft's own prefill rate
    where the step costs timed it; else the target's measured prefill rate scaled by the
    draft/target step ratio, at most the forwards of the method's width."""
    cost = lambda w: 1.0 + 0.1 * (w - 1)  # noqa: E731
    m, _ = hybrid_at(0.5, 0.9, 0.1, cost)
    c = m.draft_policy.costs
    m.prefill_token_s = 0.02
    W = m.max_width
    chunks = lambda k: 0.1 * ((k // W) * cost(W) + (cost(k % W) if k % W else 0.0)) / cost(1)  # noqa: E731
    for n in (2, 40, 400):
        assert m._prime_s([n], c) == pytest.approx(min((n - 1) * 0.02 * 0.1, chunks(n - 1)))
    # rows: every row's tokens at the prefill rate, or forwards over the batch as wide as the longest
    assert m._prime_s([40, 400, 3], c) == pytest.approx(min(440 * 0.02 * 0.1, chunks(399)))
    assert m._prime_s([], c) == 0.0
    m.prefill_token_s = 5.0  # a prefill slower than reading in chunks: the chunks bound it
    assert m._prime_s([400], c) == pytest.approx(chunks(399))
    m.prefill_token_s = None  # no prefill timed (the serving core's rows): the chunks
    assert m._prime_s([40], c) == pytest.approx(chunks(39))
    timed = dataclasses.replace(c, draft_prefill_s=0.003)  # the draft's own prefill rate, where timed
    assert m._prime_s([40, 400, 3], timed) == pytest.approx(440 * 0.003)
    # once read in, the row is as after a prefill: the draft holds all but its last token
    # (a generate call's rows, none read yet: one batched prefill; the serving core's: row by row)
    calls = []
    draft = SimpleNamespace(prefill_row=lambda *a: calls.append(("row",) + a),
                            prefill=lambda tokens, lens, **kw: calls.append(("all", tokens, lens)))
    m.ctx = MethodContext(target=None, draft=draft, device=None)
    m.gap, m.n_host, m.primed = [40], [12], [False]
    state = SimpleNamespace(tokens=torch.arange(20)[None], n=torch.tensor([12]), batch=1)
    m._prime(state, [0])
    assert m.primed == [True] and m.gap == [1] and m.primes == 1
    assert [(k, t.tolist(), n.tolist()) for k, t, n in calls] == [("all", [list(range(11))], [11])]
    m._prime(state, [0])
    assert len(calls) == 1  # once
    calls.clear()
    m.primed, m.gap, m.n_host = [True, False, False], [2, 9, 9], [30, 12, 5]
    state = SimpleNamespace(tokens=torch.arange(60).view(3, 20), n=torch.tensor([30, 12, 5]), batch=3)
    m._prime(state, [0, 1])  # row 2 finished: left as it is
    assert [(k, r, t.tolist(), n) for k, r, t, n in calls] == [("row", 1, [list(range(20, 31))], 11)]
    assert m.primed == [True, True, False] and m.gap == [2, 1, 9]


def test_ngram_leaves_a_loaded_draft_out_and_hybrid_needs_one(tiny_pair, tokenizer, eng):
    e = Engine(tiny_pair[0], tokenizer, tiny_pair[2], max_seq_len=256)
    for gamma in (4, "auto"):  # auto times the target alone: the draft's cache holds nothing
        r = e.generate(PROMPTS[0], max_new_tokens=16, method="ngram", gamma=gamma, ignore_eos=True)
        assert not r.stats["hybrid"] and r.stats["draft_forwards"] == 0
    with pytest.raises(SpecEngineError, match="method 'hybrid' needs a draft model"):
        eng.generate("x", max_new_tokens=2, method="hybrid")
    with pytest.raises(SpecEngineError, match="tree drafting applies to"):
        e.generate("x", max_new_tokens=2, method="hybrid", tree="2x2")


def flat(width_cost):
    return StepCosts(1, 0.0, tuple(width_cost(w) for w in range(1, 20)))


def test_gamma_per_match_length_follows_what_each_length_accepted():
    """Long matches accepted everything, one-token matches nothing: the policy learns them apart,
    proposes γ max behind a long match and nothing behind a short one (probing it now and then)."""
    pol = NgramGammaPolicy(gamma_max=8)
    pol.set_costs(flat(lambda w: 1.0 + 0.1 * (w - 1)))  # a wider verify costs a little more
    for _ in range(20):
        got = pol.choose({0: 12, 1: 1})
        pol.update_rows({0: got[0], 1: 0}, got | {1: got.get(1, 0)})
    assert match_bin(12) != match_bin(1)
    assert pol.choose({0: 12})[0] == 8
    declined = [0 not in pol.choose({0: 1}) for _ in range(2 * PROBE_EVERY)]
    assert sum(declined) == 2 * PROBE_EVERY - 2  # declined, but probed once every PROBE_EVERY rows
    pol.set_costs(flat(lambda w: float(w)))  # a verify of w costs w decodes: only a certainty would pay
    assert pol.choose({0: 12}) == {}


def test_match_length_curves_carry_to_the_engine_next_call_and_stay_bounded(eng, monkeypatch, tmp_path):
    """γ auto's per-match-length counts continue from the engine's earlier calls of the method in
    greedy mode (a server's tenth request does not relearn at the prior); a sampled call recalls
    none (its seed repeats its tokens), another method starts from the priors; warmup forgets; past
    MEMORY tries the counts are halved. (An empty machine table here: what it files and a new
    engine reads back is tests/runtime/test_step_costs.py's.)"""
    from helpers.cache import fresh_cache
    from specengine.methods import ngram_policy

    fresh_cache(monkeypatch, tmp_path)
    eng.__dict__.pop("_clocks", None)  # read the (empty) table again; the module's earlier calls filed theirs

    starts, recall = [], NgramGammaPolicy.recall

    def spy(self, store, key, filed=None):
        recall(self, store, key, filed)
        starts.append((key, sum(self.seen[b][1] for b in range(len(self.seen)))))
    NgramGammaPolicy.recall = spy
    try:
        eng.warmup()
        starts.clear()  # warmup's own calls
        for method, sampled in (("ngram", False), ("ngram", False), ("ngram", True), ("suffix", False)):
            eng.generate(PROMPTS[0], max_new_tokens=24, method=method, gamma="auto", ignore_eos=True,
                         **(dict(temperature=0.8, seed=1) if sampled else {}))
    finally:
        NgramGammaPolicy.recall = recall
    assert [k for k, _ in starts] == ["ngram:greedy:by_match"] * 2 + ["suffix:greedy:by_match"]  # sampled: none
    assert starts[0][1] == 0 and starts[1][1] > 0  # the second call continues the first's counts
    assert starts[2][1] == 0  # another method: the priors
    eng.warmup()
    assert not eng._acceptance
    pol = NgramGammaPolicy(gamma_max=4)
    pol.set_costs(flat(lambda w: 1.0))
    for _ in range(3 * ngram_policy.MEMORY):
        pol.choose({0: 12})
        pol.update_rows({0: 4}, {0: 4})
    assert pol.seen[match_bin(12)][1] <= ngram_policy.MEMORY  # bounded: recent rounds weigh more
    assert pol.kept[match_bin(12)][1] == pol.seen[match_bin(12)][1]


def test_gamma_weighs_the_cost_of_width():
    pol = NgramGammaPolicy(gamma_max=10)
    for k in range(1, 11):  # acceptance 0.7 at every position, learned
        pol.seen[0][k], pol.kept[0][k] = 100.0, 70.0
    pol.set_costs(flat(lambda w: 1.0))
    assert pol.best(0) == 10  # free width: propose all
    pol.set_costs(flat(lambda w: 1.0 + 0.5 * (w - 1)))
    e = pol.expected(0)
    want = max(range(11), key=lambda g: (1 + e[g]) / (1.0 + 0.5 * g))
    assert pol.best(0) == want and 0 < want < 10
    pol.set_costs(flat(lambda w: float(w) ** 2))
    assert pol.best(0) == 0


def test_the_chains_yield_is_shrunk_toward_the_model_until_rounds_outweigh_it():
    """A few early chains must not settle a call (their yield stops the draft, and rounds not run
    never correct it); many do: the factor moves from 1 toward committed / expected as rounds add up."""
    from specengine.methods.round_clock import MIN_ROUNDS, TokenYield

    y = TokenYield()
    for _ in range(MIN_ROUNDS - 1):
        y.book(3.0, 1.0)
    assert y.factor() == 1.0
    y.book(3.0, 1.0)
    assert y.factor() == pytest.approx((3.0 + 9.0) / (9.0 + 9.0))  # 3 rounds at 1/3, 3 pseudo-rounds at 1
    for _ in range(300):
        y.book(3.0, 1.0)
    assert 1 / 3 < y.factor() < 0.34


def test_the_chains_yield_never_scales_the_model_up():
    """Chains that commit more than the model expected at the α of their time (α climbing from its
    prior through full accepts) leave the factor at 1: α corrects that lag itself, and scaled again a
    chain's forecast exceeds the γ + 1 tokens it can commit at most."""
    from specengine.methods.round_clock import MIN_ROUNDS, TokenYield

    y = TokenYield()
    for _ in range(2 * MIN_ROUNDS):
        y.book(3.0, 5.0)
    assert y.factor() == 1.0
    for _ in range(20):
        y.book(3.0, 1.0)
    assert y.factor() < 1.0  # a chain that then commits less is still scaled down


def test_hybrids_forecast_never_exceeds_what_a_chain_can_commit():
    """Greedy, measured costs, a reply's chains accepted in full from a low α on: each chain is
    forecast at most γ + 1 tokens (the forecast behind `stats["prediction_error"]`)."""
    from specengine.methods.context import MethodContext

    m, _ = hybrid_at(0.6, 0.5, 0.1, lambda w: 1.0 + 0.1 * (w - 1))
    m.ctx = MethodContext(target=None, draft=None, device=None)
    m.hybrid, dp = True, m.draft_policy
    dp.calibrate = True
    dp.set_costs(dataclasses.replace(dp.costs, measured=True))
    dp.accepted, dp.rejected = 2.0, 2.0  # α 0.5, the weight of a fresh policy: full accepts move it
    for _ in range(12):
        g, before = dp.gamma, dp.clock.forecast[0]
        assert g >= 1
        m.kind, m.primed_now = "draft", False
        m.after_round([g], [g])  # every draft accepted
        assert dp.clock.forecast[0] - before <= g + 1 + 1e-9


def test_hybrid_weighs_its_draft_chains_by_the_tokens_they_committed():
    """Greedy, measured costs: a chain's expected tokens are scaled by what the call's chains
    committed against the acceptance model's expectation at the α it held then (TokenYield), so
    chains that commit less than the geometric model promises lose a round they win on paper. The
    yield is the call's own: the next call starts from none (the model's expectation)."""
    from specengine.methods.context import MethodContext
    from specengine.methods.policies import expected_tokens

    cost = lambda w: 1.0 + 0.1 * (w - 1)  # noqa: E731
    m, gammas = hybrid_at(0.6, 0.9, 0.1, cost)
    m.ctx = MethodContext(target=None, draft=None, device=None)
    m.hybrid, dp = True, m.draft_policy
    dp.calibrate = True
    dp.set_costs(dataclasses.replace(dp.costs, measured=True))
    assert m._draft_wins({0: ([1], None)}, gammas, [0]) and m.chain_yield.factor() == 1.0
    booked = []
    for _ in range(3):  # chains that commit 1 token of γ + 1 (each first draft rejected)
        g, alpha = dp.gamma, dp.alpha
        booked.append(expected_tokens(alpha, g))
        m.kind, m.primed_now = "draft", False
        m.after_round([0], [g])
    # 1 token a chain, against the model's, shrunk by 3 rounds' worth of its expectation
    assert m.chain_yield.factor() == pytest.approx((3 + sum(booked)) / (2 * sum(booked)))
    # the forecast books each chain as the choice expected it: the model's tokens at the yield then
    f, g, alpha, before = m.chain_yield.factor(), dp.gamma, dp.alpha, dp.clock.forecast[0]
    m.kind, m.primed_now = "draft", False
    m.after_round([0], [g])
    assert dp.clock.forecast[0] - before == pytest.approx(expected_tokens(alpha, g) * f) and f < 0.9
    dp.accepted, dp.rejected = 90.0, 10.0  # α back at 0.9: on paper the chain still wins ...
    dp.set_costs(dp.costs)
    assert not m._draft_wins({0: ([1], None)}, m.policy.choose({0: 1}), [0])  # ... measured, it does not
    assert not any("yield" in k for k in m.ctx.acceptance)  # nothing carried: the yield is the call's text's


def test_hybrids_forecast_holds_the_draft_prefill_it_decided_to_pay(monkeypatch):
    """The round that primes the draft (its deferred prefill) is forecast at the chain's seconds plus
    the prefill's, as the plan priced it when it chose to pay it (`stats["prediction_error"]`: on the
    real pair the forecast left it out and over-predicted by 28-34% on HumanEval/0, 11-14% with it);
    a later chain at its own seconds only."""
    from contextlib import nullcontext

    from specengine.methods import hybrid as hybrid_module

    cost = lambda w: 1.0 + 0.1 * (w - 1)  # noqa: E731
    m, _ = hybrid_at(0.6, 0.9, 0.1, cost)
    dp = m.draft_policy
    dp.set_costs(dataclasses.replace(dp.costs, draft_prefill_s=0.002))  # 2 ms a token of the draft's prefill
    m.primed, m.n_host, m.gap, m.primes = [False], [100], [2], 0

    def prime(state, live):  # HybridDecoding._prime's bookkeeping: an unread row is read once
        if not m.primed[0]:
            m.primed[0], m.primes = True, m.primes + 1
    monkeypatch.setattr(m, "_prime", prime)
    monkeypatch.setattr(hybrid_module, "chain_round", lambda ctx, state, pol, timer, behind, width: pol.update([1], [pol.gamma]))
    timer = SimpleNamespace(phase=lambda name: nullcontext())
    g = dp.gamma
    chain_s = g * 0.1 + cost(g + 1)
    state = SimpleNamespace(tokens=torch.zeros(1, 1, dtype=torch.long))  # on the CPU
    m._draft_round(state, [0], timer)
    assert m.primed_now and dp.clock.forecast[1] == pytest.approx(chain_s + 99 * 0.002)
    g = dp.gamma
    m._draft_round(state, [0], timer)
    assert not m.primed_now and dp.clock.forecast[1] == pytest.approx(chain_s + 99 * 0.002 + g * 0.1 + cost(g + 1))


def test_hybrid_reads_past_a_chain_factor_an_earlier_call_filed():
    """An earlier call filed the chains' factor at 2.5 (a noisy hour): at that factor the draft's γ is 0, a
    probe's γ short, and the n-gram rounds beat both on paper, so the draft never read the prompt and nothing
    re-timed the factor (10 calls in a row on the real pair). The unread chain is chosen as its read is priced,
    at the plain rounds' factor (draft_prime.chain_factor, reading_gamma): it wins the round, and the draft reads."""
    cost = lambda w: 1.0 + 0.1 * (w - 1)  # noqa: E731
    m, gammas = hybrid_at(0.5, 0.9, 0.1, cost)
    dp = m.draft_policy
    dp.calibrate = True
    dp.clock.seed({"plain": 1.0, "spec": 2.5})
    dp.set_costs(dataclasses.replace(dp.costs, measured=True, draft_prefill_s=1e-4))
    assert dp.gamma == 0  # the filed factor's choice
    m.primed, m.n_host, m.start, m.limit = [False], [100], [90], [190]
    m.call = SimpleNamespace(rows=[SimpleNamespace(stops=[], stop_ids=[])], state=SimpleNamespace(constraints=None))
    m.key, m.prefill_token_s = "greedy", None
    assert m._draft_wins({0: ([1], None)}, gammas, [0]) and dp.gamma >= 2
    # read, the chains' own factor decides again: at 2.5 the n-gram round wins
    m.primed = [True]
    dp.set_costs(dp.costs)
    assert not m._draft_wins({0: ([1], None)}, gammas, [0])


def hybrid_at(ngram_q: float, alpha: float, draft_s: float, width_cost, gap: int = 2):
    """A hybrid whose n-gram bin 0 accepted ngram_q at every position and whose draft alpha,
    under the given costs; returns it and its choice of γ for a row with a 1-token match."""
    m = HybridDecoding(gamma="auto")
    costs = StepCosts(1, draft_s, tuple(width_cost(w) for w in range(1, 20)))
    m.policy.set_costs(dataclasses.replace(costs, draft_s=0.0))
    for k in range(1, m.policy.gamma_max + 1):
        m.policy.seen[0][k], m.policy.kept[0][k] = 100.0, 100.0 * ngram_q
    m.draft_policy.accepted, m.draft_policy.rejected = 100.0 * alpha, 100.0 * (1 - alpha)
    m.draft_policy.set_costs(costs)
    m.gap, m.primed, m.n_host = [gap], [True], [100]  # the draft read the row's text (100 tokens) but the last
    return m, m.policy.choose({0: 1})


def best_rate(q: float, gmax: int, per_token_cost, cost) -> float:
    """An independent reference: the best tokens/s over γ of a geometric acceptance q."""
    return max(sum(q ** j for j in range(g + 1)) / (g * per_token_cost + cost(g + 1)) for g in range(gmax + 1))


@pytest.mark.parametrize("q,alpha,draft_s,slope", [(0.95, 0.5, 0.3, 0.1), (0.3, 0.9, 0.1, 0.1),
                                                   (0.6, 0.9, 0.1, 0.3), (0.8, 0.8, 0.5, 0.05),
                                                   (0.2, 0.2, 0.3, 0.5)])
def test_hybrid_gives_the_round_to_the_faster_expected_drafter(q, alpha, draft_s, slope):
    """γ auto: the round goes to whichever of the n-gram proposal and the draft's chain the costs
    and the learned acceptances expect to commit more tokens per second."""
    cost = lambda w: 1.0 + slope * (w - 1)  # noqa: E731
    m, gammas = hybrid_at(q, alpha, draft_s, cost)
    ngram = best_rate(q, 12, 0.0, cost)
    draft = max(best_rate(alpha, 8, draft_s, cost), 1.0)  # γ 0: a plain decode
    if not gammas:  # the n-gram bin itself declines: the draft's chain against a plain decode
        assert ngram <= 1.0 and m._draft_wins({}, gammas, [0]) == (draft > 1.0)
        return
    assert abs(ngram - draft) > 0.02  # each case has a clear winner
    assert m._draft_wins({0: ([1], None)}, gammas, [0]) == (draft > ngram)


def test_hybrid_explores_an_untried_bin_and_charges_ngram_rounds_the_draft_reading():
    """While the draft is in use, an n-gram round is charged what the draft will pay to read the
    tokens it commits: one forward of the method's width W costs a draft step scaled by the
    target's width curve, so each token draft_s * cost(W) / cost(1) / W. Some close call between
    an n-gram bin and the draft must flip on that charge, and every call must follow it."""
    cost = lambda w: 1.0 + 0.1 * (w - 1)  # noqa: E731
    m, gammas = hybrid_at(0.3, 0.9, 0.1, cost)
    assert m._draft_wins({0: ([1], None)}, gammas, [0])
    m.policy.seen[0][1] = 0.0  # bin 0 untried: its n-gram round comes first
    assert not m._draft_wins({0: ([1], None)}, gammas, [0])
    W, flipped = None, 0
    for q in [i / 40 for i in range(1, 40)]:
        m, gammas = hybrid_at(q, 0.8, 0.2, cost)
        if not gammas:
            continue
        W, g = m.max_width, gammas[0]
        tokens = 1 + sum(q ** j for j in range(1, g + 1))  # the bin's curve: q at every position
        gd = m.draft_policy.gamma
        draft = sum(0.8 ** j for j in range(gd + 1)) / (gd * 0.2 + cost(gd + 1))
        taxed = tokens / (cost(g + 1) + tokens * 0.2 * cost(W) / cost(1) / W)
        assert m._draft_wins({0: ([1] * g, None)}, gammas, [0]) == (draft > taxed), q
        flipped += taxed < draft < tokens / cost(g + 1)
    assert W is not None and flipped  # the charge decided at least one round


@pytest.mark.parametrize("plain_factor", [1.0, 1.5])
def test_hybrid_prefills_the_draft_once_the_projected_saving_pays_for_it(plain_factor):
    """Draft prefill deferred (γ auto): each round adds what the draft's chain would have saved;
    the prefill waits until that saving, projected over what the reply may still write
    (PRIME_HORIZON times what it has written, at most its limit), exceeds PRIME_MARGIN times the
    prefill (paid for good, on a projection from another text's α), also while
    the engine has not learned the draft's acceptance (an unconditional first try paid the prefill
    on replies where drafting then lost: a first call at 0.77-0.88x the next on Zen 5). Until
    chains are timed, a chain is priced no cheaper than the plain rounds measure (their factor
    here 1.5): on the AVX2 EPYC chains priced at the bare model primed where drafting then lost."""
    from specengine.methods.draft_prime import PRIME_HORIZON
    from specengine.methods.hybrid import PRIME_MARGIN

    cost = lambda w: 1.0 + 0.1 * (w - 1)  # noqa: E731
    m, _ = hybrid_at(0.5, 0.9, 0.1, cost)
    m.ctx = MethodContext(target=None, draft=None, device=None)
    m.prefill_token_s, m.primed, m.start, m.n_host, m.limit = 0.2, [False], [3000], [3000], [3000 + 512]
    assert not m.draft_policy.learned  # α is hybrid_at's; never learned from a chain: no first try
    m.draft_policy.clock.seed({"plain": plain_factor})  # plain rounds timed, no chain yet
    gd = m.draft_policy.gamma
    chain_per_token = (gd * 0.1 + cost(gd + 1)) / sum(0.9 ** j for j in range(gd + 1))
    saving = cost(1) - plain_factor * chain_per_token  # per plain round
    assert saving > 0
    prime = m._prime_s  # checked against the prefill rate above

    def first_round(limit, known=False):
        row = RowState(3000, limit, [], set() if known else {2})  # known: ignore_eos, no stop string
        m.call = SimpleNamespace(rows=[row], state=SimpleNamespace(constraints=None))
        m.saved, m.n_host, m.limit = 0.0, [3000], [3000 + limit]
        for k in range(1, limit):
            if m._draft_wins({}, {}, [0]):
                return k
            m.n_host = [3000 + k]  # the plain round committed one token
        return None

    def want(limit, known=False):
        for k in range(1, limit):
            out = k - 1
            ahead = limit - out if known else min(PRIME_HORIZON * max(out, 1), limit - out)
            if k * saving * ahead / max(out, 1) > PRIME_MARGIN * prime([3000 + out], m.draft_policy.costs):
                return k
        return None

    assert first_round(512) == want(512) and 10 < want(512) < 512
    assert first_round(60) == want(60) is None  # a reply near its limit: too little ahead to pay it back
    # a reply nothing can end before its limit: the prime pays in the first round that can pay it back
    assert first_round(512, known=True) == want(512, known=True) == 1
    known = {n: first_round(n, known=True) for n in (40, 200, 300)}
    assert known == {n: want(n, known=True) for n in known} and known[40] is None and known[300] == 1
    assert known[200] is not None and first_round(200) is None  # projected from what it wrote: never primed


def test_the_draft_acceptance_carries_to_the_engine_next_call(tiny_pair, tokenizer):
    """γ auto starts from the draft acceptance the engine's last call learned for the decoding
    mode (sd and hybrid alike), at the prior's weight; a fresh engine starts from the prior."""
    from specengine.methods.policies import AutoGammaPolicy

    pol = AutoGammaPolicy()
    weight = pol.accepted + pol.rejected
    pol.recall({"greedy": 0.93}, "greedy")
    assert pol.alpha == pytest.approx(0.93) and pol.accepted + pol.rejected == pytest.approx(weight)
    pol.recall({}, "greedy")
    assert pol.alpha == pytest.approx(0.93)  # nothing remembered: unchanged
    e = Engine(tiny_pair[0], tokenizer, tiny_pair[2], max_seq_len=256)
    e.step_costs = lambda state, width, draft=True: StepCosts(state.batch, draft_s=0.05, target_s=(1.0,) * width)
    starts = []
    recall = AutoGammaPolicy.recall

    def spy(self, store, key):
        recall(self, store, key)
        starts.append((key, self.alpha))
    AutoGammaPolicy.recall = spy
    try:
        e.generate(PROMPTS[0], max_new_tokens=24, method="sd", gamma="auto", ignore_eos=True)
        learned = e._acceptance["greedy"]
        e.generate(PROMPTS[1], max_new_tokens=24, method="hybrid", gamma="auto", ignore_eos=True)
        e.generate(PROMPTS[1], max_new_tokens=8, method="sd", gamma="auto", temperature=0.8, seed=1)
    finally:
        AutoGammaPolicy.recall = recall
    assert starts[0] == ("greedy", pytest.approx(AutoGammaPolicy().alpha))  # a fresh engine: the prior
    assert starts[1] == ("greedy", pytest.approx(learned)) and learned != pytest.approx(AutoGammaPolicy().alpha)
    assert len(starts) == 2  # a sampled call recalls nothing: its seed must give the same tokens


def test_gamma_by_match_weighs_what_its_rounds_measured():
    """The rounds' measured corrections (round_clock.py) scale the model's seconds of each kind:
    n-gram rounds measured 20x slower than their verify widths say lose to plain steps, and the
    choice goes back with the corrections."""
    pol = NgramGammaPolicy(gamma_max=10)
    for k in range(1, 11):  # acceptance 0.7 at every position, learned
        pol.seen[0][k], pol.kept[0][k] = 100.0, 70.0
    pol.set_costs(flat(lambda w: 1.0))
    assert pol.best(0) == 10
    pol.scale = {"plain": 1.0, "spec": 20.0}
    assert pol.best(0) == 0 and pol.seconds(1) == 1.0 and pol.seconds(4) == 20.0
    pol.scale = {"plain": 2.0, "spec": 2.0}
    assert pol.best(0) == 10


def test_ngram_auto_reports_the_plans_prediction_and_keeps_its_corrections(eng):
    """γ by match books every n-gram and plain round (the tokens its bins expected, the verify's
    seconds) against the measured time, so a call reports its prediction error, and the engine
    keeps the corrections for its next call (and the machine's table)."""
    out = eng.generate(PROMPTS[0], max_new_tokens=32, method="ngram", gamma="auto", ignore_eos=True)
    s = out.stats
    assert s["predicted_tokens_per_s"] > 0 and s["decode_tokens_per_s"] > 0
    assert s["prediction_error"] == pytest.approx(s["predicted_tokens_per_s"] / s["decode_tokens_per_s"] - 1)
    assert "ngram:greedy:round_clock" in eng._acceptance and "round_cost_factors" in s


def test_hybrid_weighs_its_draft_chains_by_what_they_measured():
    """Greedy, measured costs: the hybrid's draft chains are booked against their times like sd's,
    so chains measured 2x slower than the model lose the round to an n-gram proposal they beat
    on paper (the draft's own γ still drafts). The chain's policy never runs plain rounds itself:
    after four timed chains it holds γ at 0 to time plain decoding, and the plain rounds the n-gram
    side times release it."""
    from specengine.methods.context import MethodContext

    cost = lambda w: 1.0 + 0.1 * (w - 1)  # noqa: E731
    for slow, wins in [(1.3, True), (2.0, False)]:
        m, gammas = hybrid_at(0.6, 0.9, 0.1, cost)
        m.ctx, m.calibrate, m.clock_key = MethodContext(target=None, draft=None, device=None), True, "h:round_clock"
        m.hybrid = True  # begin()'s: the engine has a draft
        dp = m.draft_policy
        dp.calibrate = True
        dp.set_costs(dataclasses.replace(dp.costs, measured=True))
        m._calibrates = lambda: False  # the chains' token yield is the next test's: times decide here
        assert m._draft_wins({0: ([1], None)}, gammas, [0])
        for _ in range(4):  # chains, each timed `slow` times what the model says
            g = dp.gamma
            m.kind, m.primed_now = "draft", False
            m.after_round([g], [g])
            m.timed(slow * (g * 0.1 + cost(g + 1)))
        assert dp.gamma == 0 and not m._draft_wins({0: ([1], None)}, gammas, [0])
        for _ in range(3):  # plain rounds, on the n-gram side, timed as predicted
            m.kind, m._booked = "plain", ("plain", 1.0, cost(1))
            m.after_round([0], [0])
            m.timed(cost(1))
        assert dp.gamma >= 1 and dp.clock.factors() == {"plain": 1.0, "spec": pytest.approx(slow)}
        assert m._draft_wins({0: ([1], None)}, m.policy.choose({0: 1}), [0]) == wins, slow


def test_a_text_that_rejects_what_the_carried_curves_expect_stops_their_proposals_within_the_call():
    """Curves carried from earlier calls (hundreds of tries on code, where a one-token match's next
    token was accepted 3 times in 8) barely move under one call's proposals; on prose nearly every one
    was rejected (MT-bench, AVX2 copy: 1 in 21, `ngram` 0.935x `ar`). The call's text factor stops
    them after a few (probes still run); the next call starts from the curves again; a text that
    accepts what the curves expect keeps proposing."""
    key, seen, kept = "ngram:greedy:by_match", [[0.0] * 13 for _ in range(8)], [[0.0] * 13 for _ in range(8)]
    seen[0][1], kept[0][1] = 256.0, 96.0  # bin of one-token matches: 0.375, break-even below at 0.25
    costs = flat(lambda w: 1.0 + 0.25 * (w - 1))

    def call(store, accepts) -> int:
        pol = NgramGammaPolicy()
        pol.recall(store, key)
        pol.set_costs(costs)
        proposals = 0
        for i in range(40):
            got = pol.choose({0: 1})
            if got:
                proposals += 1
                pol.update_rows({0: min(got[0], accepts(i))}, got)
        return proposals

    store = {key: (seen, kept)}
    assert call(store, lambda i: 0) <= 12  # 7 until the factor declines them, then a probe per 8 declines
    assert call(store, lambda i: int(i % 8 in (0, 3, 5))) >= 38  # the curves, still above break-even, again
