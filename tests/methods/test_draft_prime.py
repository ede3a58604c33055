"""`sd` γ auto and `pearl` with its window by cost read the prompt into the draft at their first drafted
round, and only where the rounds' projected savings over what the reply may still write pay for that
prefill (methods/draft_prime.py): a short reply to a long prompt never pays it. Tokens are `ar`'s
whatever they decide."""
import dataclasses
import time

import pytest

from specengine import Engine
from specengine.methods.pearl import Pearl
from specengine.methods.sd import SpeculativeDecoding
from specengine.runtime.step_costs import StepCosts

PROMPTS = ["def f(x):", "abc abc abc", "for i in range(10):"]
FLAT = StepCosts(1, draft_s=0.05, target_s=(1.0,) * 18)  # drafting wins: verify width is free
LOSING = StepCosts(1, draft_s=0.5, target_s=tuple(1.0 + 1.0 * w for w in range(18)))  # drafting loses


def run_method(eng, monkeypatch, costs, new, method="sd"):
    monkeypatch.setattr(eng, "step_costs", lambda state, width, **kw: costs)
    out = eng.generate(PROMPTS, max_new_tokens=new, method=method, gamma="auto", ignore_eos=True)
    drafted = sum(1 for proposed, _, _ in out[0].stats["round_log"] if proposed)
    return [r.token_ids for r in out], out[0].stats, drafted


@pytest.mark.parametrize("method,cls", [("sd", SpeculativeDecoding), ("pearl", Pearl)])
def test_the_draft_reads_the_prompt_only_where_drafting_pays_for_it(tiny_pair, tokenizer, monkeypatch, method, cls):
    target, _, perturbed = tiny_pair
    eng = Engine(target, tokenizer, draft=perturbed, max_seq_len=256)
    ar = [r.token_ids for r in eng.generate(PROMPTS, max_new_tokens=60, method="ar", ignore_eos=True)]
    assert cls(gamma="auto").defers_draft_prefill and not cls(gamma=3).defers_draft_prefill

    def run(eng, monkeypatch, costs, new):
        return run_method(eng, monkeypatch, costs, new, method)

    # drafting wins and the prefill is cheap: every row's text read once, at the first round (which drafts;
    # a PEARL round of its window of 16 commits more than a chain: fewer rounds)
    out, stats, drafted = run(eng, monkeypatch, FLAT, 60)
    assert out == ar and stats["draft_prefills_deferred"] == len(PROMPTS) and drafted > 4
    assert stats["round_log"][0][0] > 0
    # drafting loses: the draft never reads the prompt, not even for the probes every 16 plain rounds
    out, stats, drafted = run(eng, monkeypatch, LOSING, 60)
    assert out == ar and stats["draft_prefills_deferred"] == 0 and drafted == 0
    assert stats["plain_rounds"] == stats["rounds"]
    # drafting wins, but the prefill costs more than 8 tokens can save (a long prompt, a short reply)
    dear = dataclasses.replace(FLAT, draft_prefill_s=10.0)
    out, stats, drafted = run(eng, monkeypatch, dear, 8)
    assert out == [a[:8] for a in ar] and stats["draft_prefills_deferred"] == 0 and drafted == 0
    # ... which 60 tokens repay (0.1 s a token read, ~10 read a row)
    out, stats, drafted = run(eng, monkeypatch, dataclasses.replace(FLAT, draft_prefill_s=0.1), 60)
    assert out == ar and stats["draft_prefills_deferred"] == len(PROMPTS) and drafted > 4
    # rounds launched ahead of their read (Engine.overlap_rounds): plain ones while the read does not
    # pay, as `ar`'s are; and a read at a chain after a plain round launched ahead
    eng.overlap_rounds = True
    out, stats, drafted = run(eng, monkeypatch, dear, 60)
    assert out == ar and stats["draft_prefills_deferred"] == 0 and stats["rounds_launched_ahead"] > 40
    out, stats, drafted = run(eng, monkeypatch, dataclasses.replace(FLAT, draft_prefill_s=0.5), 60)
    assert out == ar and stats["draft_prefills_deferred"] == len(PROMPTS) and drafted > 4


@pytest.mark.parametrize("method", ["sd", "pearl"])
def test_a_deferred_draft_prefill_counts_as_the_calls_prefill(tiny_pair, tokenizer, monkeypatch, method):
    """stats["prefill_s"] holds the draft's prefill wherever it ran, so a decode rate over the rest
    compares with one whose draft read the prompt up front."""
    target, _, perturbed = tiny_pair
    eng = Engine(target, tokenizer, draft=perturbed, max_seq_len=256)
    seen = []
    real = type(eng.draft).prefill

    def slow_prefill(self, *args, **kw):  # the draft's read of the prompt takes 0.3 s more
        seen.append(self is eng.draft)
        if self is eng.draft:
            time.sleep(0.3)
        return real(self, *args, **kw)

    monkeypatch.setattr(type(eng.draft), "prefill", slow_prefill)
    out, stats, drafted = run_method(eng, monkeypatch, FLAT, 30, method)
    assert stats["draft_prefills_deferred"] == len(PROMPTS) and seen == [False, True]  # in a round, one batched read
    assert stats["prefill_s"] >= 0.3


def test_untimed_chains_are_priced_at_the_plain_rounds_factor(tiny_pair, tokenizer, monkeypatch):
    """Drafted rounds no call has timed are priced at the plain rounds' correction (the same moment's machine:
    draft_prime.chain_factor, policies.round_rate), not the bare model's 1: with a plain factor under 1 filed (the
    machine faster now than when the step costs were timed) a new process's `sd` never read the prompt (AMX
    Xeon, filed plain 0.86: HumanEval/1 64 plain rounds of 64 in every call, where it drafts at 1.2-1.3x)."""
    from specengine.methods.draft_prime import chain_factor
    from specengine.methods.round_clock import RoundClock
    from specengine.timing import CLOCK_SUFFIX

    clock = RoundClock()
    clock.seed({"plain": 0.4})
    assert chain_factor(clock) == 0.4
    target, _, perturbed = tiny_pair
    eng = Engine(target, tokenizer, draft=perturbed, max_seq_len=256)
    ar = eng.generate(PROMPTS[0], max_new_tokens=24, method="ar", ignore_eos=True).token_ids
    eng._acceptance["greedy" + CLOCK_SUFFIX] = {"plain": 0.4}  # as a new engine's first call seeds it (FiledClocks)
    # drafting wins at equal factors; at 0.4 against 1 a chain's 1.7 tokens a 1.05 s round lose to 2.5 a second
    costs = dataclasses.replace(FLAT, measured=True, draft_prefill_s=0.0)
    monkeypatch.setattr(eng, "step_costs", lambda state, width, **kw: costs)
    r = eng.generate(PROMPTS[0], max_new_tokens=24, method="sd", gamma="auto", ignore_eos=True)
    assert r.token_ids == ar and r.stats["draft_prefills_deferred"] == 1 and r.stats["round_log"][0][0]


@pytest.mark.parametrize("method", ["sd", "pearl", "hybrid"])
def test_an_earlier_calls_chain_factor_does_not_keep_the_prompt_unread_for_good(tiny_pair, tokenizer, monkeypatch,
                                                                                   method):
    """Drafted rounds measured slow in an earlier call (a slow moment of a shared VM) leave their factor to the
    next call, which then decodes plainly and would re-time them only by a probe. A probe must read the prompt
    first: priced at that stale factor, the read never paid, no probe ran, and the factor was carried on to every
    later call (AVX2 EPYC, HumanEval: 3 of 15 `sd` calls ran all plain at a spec factor of 1.65 against plain's
    1.1-1.3). Where only an earlier call's factor says so, the read is priced at the plain rounds' factor: the
    probe reads the prompt and drafts, and its round is timed with the prefill taken out (kept off the clock,
    the probe that read re-timed nothing: 4 of 15 calls still all plain at 1.42-1.67). `hybrid`'s chains share
    `sd`'s clock; its draft sat out every n-gram and plain round with γ held at 0 by that factor, never probed:
    those rounds now count toward a probe (`sat_out`), and the call's last timed round is filed too."""
    from specengine.timing import CLOCK_SUFFIX

    target, _, perturbed = tiny_pair
    eng = Engine(target, tokenizer, draft=perturbed, max_seq_len=256)
    ar = eng.generate(PROMPTS[0], max_new_tokens=60, method="ar", ignore_eos=True).token_ids
    # drafting wins by the model; rounds timed as they run; the read priced at nothing, so that what decides is the
    # chain factor, not how the tiny models' measured seconds (a loaded CI machine's) compare with the priced read
    costs = dataclasses.replace(FLAT, measured=True, draft_prefill_s=0.0)
    monkeypatch.setattr(eng, "step_costs", lambda state, width, **kw: costs)
    eng.generate(PROMPTS[0], max_new_tokens=60, method=method, gamma="auto", ignore_eos=True)  # files its factors
    key = ("pearl:" if method == "pearl" else "") + "greedy" + CLOCK_SUFFIX  # hybrid's chains: sd's clock
    assert key in eng._acceptance
    eng._acceptance[key] = {"plain": 1.0, "spec": 40.0}  # drafted rounds 40x slower than plain, as filed by that call
    r = eng.generate(PROMPTS[0], max_new_tokens=60, method=method, gamma="auto", ignore_eos=True)
    drafted = sum(1 for proposed, _, _ in r.stats["round_log"] if proposed)
    assert r.token_ids == ar and r.stats["draft_prefills_deferred"] == 1 and drafted >= 1
    # ... and the round that read is timed, its prefill taken out: the chain factor is re-timed, not carried on
    assert eng._acceptance[key]["spec"] < 0.9 * 40.0


@pytest.mark.parametrize("method", ["sd", "pearl", "hybrid"])
def test_a_draft_that_reads_late_proposes_from_the_committed_text(tiny_pair, tokenizer, monkeypatch, method):
    """A read after plain rounds takes in what they committed (rows of different lengths, one batched prefill),
    each row's text at its own positions: a draft with the target's weights then proposes the target's own
    tokens, and every round it drafts is accepted whole. A draft cache off by a position costs acceptance,
    never tokens, so only acceptance shows it."""
    from specengine.methods import draft_prime
    from specengine.methods.hybrid import HybridDecoding

    target, same, _ = tiny_pair
    eng = Engine(target, tokenizer, draft=same, max_seq_len=256)
    ar = [r.token_ids for r in eng.generate(PROMPTS, max_new_tokens=60, method="ar", ignore_eos=True)]
    asked = []  # the read's decision says "not yet" 8 times, then decides as the product does

    def late(real):
        def decide(*args, **kw):
            asked.append(1)
            return len(asked) > 8 and real(*args, **kw)
        return decide

    if method == "hybrid":
        monkeypatch.setattr(HybridDecoding, "_draft_wins", late(HybridDecoding._draft_wins))
    else:
        monkeypatch.setattr(draft_prime, "pays", late(draft_prime.pays))
    out, stats, _ = run_method(eng, monkeypatch, FLAT, 60, method)
    assert out == ar and stats["draft_prefills_deferred"] >= 2  # (hybrid's: the rows not yet finished)
    log = stats["round_log"]  # row 0's (proposed, accepted, draft forwards) per round
    drafted = [(proposed, accepted) for proposed, accepted, forwards in log if forwards]
    assert next(i for i, r in enumerate(log) if r[2]) >= 8 and len(drafted) >= 2
    assert all(accepted == proposed for proposed, accepted in drafted), drafted


@pytest.mark.parametrize("method", ["sd", "hybrid"])
def test_a_stale_low_rate_does_not_keep_the_draft_out_for_good(tiny_pair, tokenizer, monkeypatch, method):
    """The engine's rate for the pair learned where chains lost (prose) holds the draft out while its
    prompt is unread, and no probe runs then; after STALE_FIRST rounds without a chain, across calls, a
    call starts from the prior, reads the prompt and drafts again (methods/probe_wait.py). Without it every
    later call decoded plainly, code included (docs/design.md, "A stale rate")."""
    from specengine.methods.policies import best_gamma
    from specengine.methods.probe_wait import STALE_FIRST

    target, _, perturbed = tiny_pair
    eng = Engine(target, tokenizer, draft=perturbed, max_seq_len=256)
    costs = StepCosts(1, draft_s=0.3, target_s=(1.0, 1.25, 1.45) + tuple(1.45 + 0.2 * w for w in range(1, 16)),
                      draft_prefill_s=0.01)
    assert best_gamma(0.3, costs, 8, gamma_min=0) == 0 and best_gamma(0.7, costs, 8, gamma_min=0) >= 1
    monkeypatch.setattr(eng, "step_costs", lambda state, width, **kw: costs)
    prompt, new = "def f(x):", 60
    ar = eng.generate(prompt, max_new_tokens=new, method="ar", ignore_eos=True).token_ids
    eng._acceptance.update({"greedy": 0.3, "greedy:pair": (3.0, 7.0)})  # learned on text where chains lost
    for _ in range(12):
        idle = eng._acceptance.get("greedy:stale", (0,))[0]  # rounds without a chain so far
        r = eng.generate(prompt, max_new_tokens=new, method=method, gamma="auto", ignore_eos=True)
        assert r.token_ids == ar
        log = r.stats["round_log"]
        if r.stats["draft_prefills_deferred"]:  # the wait ended in this call: from the prior on, read and drafted
            assert idle + len(log) >= STALE_FIRST and r.stats["plain_rounds"] < r.stats["rounds"]
            if method == "sd":  # at the round right after the wait, mid-call where it ended there
                assert [i for i, (p, _, _) in enumerate(log) if p][0] == max(STALE_FIRST - idle, 0)
            break
        assert idle + len(log) < STALE_FIRST  # until then, the pair's low rate: the draft sits out
        if method == "sd":  # (hybrid's n-gram rounds propose without it)
            assert not any(p for p, _, _ in log)
    else:
        raise AssertionError("the draft never read the prompt again")
