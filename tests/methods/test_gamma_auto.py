"""gamma="auto": the draft length that maximizes expected tokens per second, from measured
step costs and the running acceptance rate; lossless like every other policy."""
import dataclasses
import itertools

import pytest
import torch

from specengine import Engine, SpecEngineError
from specengine.methods.policies import AutoGammaPolicy, best_gamma, expected_tokens, make_policy
from specengine.runtime.step_costs import StepCosts


@pytest.mark.parametrize("alpha", [0.0, 0.3, 0.8, 1.0])
@pytest.mark.parametrize("gamma", [1, 2, 5])
def test_expected_tokens_matches_enumeration(alpha, gamma):
    # enumerate accept/reject patterns: a round commits (accepted prefix) + 1
    total = 0.0
    for pattern in itertools.product([1, 0], repeat=gamma):
        prob = 1.0
        for ok in pattern:
            prob *= alpha if ok else 1 - alpha
        n_acc = next((i for i, ok in enumerate(pattern) if not ok), gamma)
        total += prob * (n_acc + 1)
    assert expected_tokens(alpha, gamma) == pytest.approx(total)


def _brute(alpha, costs, gamma_max):
    rates = {g: expected_tokens(alpha, g) / (g * costs.draft_s + costs.verify_s(g + 1)) for g in range(1, gamma_max + 1)}
    return max(rates, key=rates.get)


FLAT = StepCosts(1, draft_s=0.05, target_s=(1.0,) * 9)  # a GPU-like verify: width is free
STEEP = StepCosts(1, draft_s=0.2, target_s=tuple(1.0 + 0.6 * w for w in range(9)))  # a CPU BLAS


@pytest.mark.parametrize("costs", [FLAT, STEEP])
@pytest.mark.parametrize("alpha", [0.1, 0.5, 0.8, 0.95])
def test_best_gamma_is_the_argmax(costs, alpha):
    assert best_gamma(alpha, costs, 8) == _brute(alpha, costs, 8)


def test_best_gamma_moves_the_right_way():
    assert best_gamma(0.95, FLAT, 8) == 8  # cheap draft, free width, high acceptance: draft long
    assert best_gamma(0.95, STEEP, 8) < 8  # the verify gets dearer with width
    assert best_gamma(0.05, STEEP, 8) == 1  # the draft is useless: propose as little as possible
    assert STEEP.verify_s(12) == pytest.approx(1.0 + 0.6 * 11)  # linear past the measured range


def test_policy_tracks_acceptance():
    pol = make_policy("fixed", "auto")
    assert isinstance(pol, AutoGammaPolicy) and pol.gamma_max == 8
    pol.set_costs(FLAT)
    for _ in range(30):  # every draft accepted: alpha -> 1, gamma -> max
        pol.update([pol.gamma], [pol.gamma])
    assert pol.alpha > 0.95 and pol.gamma == 8
    for _ in range(30):  # always rejected at once
        pol.update([0], [pol.gamma])
    assert pol.alpha < 0.3 and pol.gamma <= 2


def test_running_alpha_estimates_the_true_rate():
    g = torch.Generator().manual_seed(0)
    pol = make_policy("fixed", "auto")
    pol.set_costs(FLAT)  # speculation always pays: every round drafts and informs alpha
    estimates = []
    for _ in range(400):  # rounds of i.i.d. acceptance at 0.6, truncated at the first rejection
        ok = (torch.rand(pol.gamma, generator=g) < 0.6).tolist() + [False]
        pol.update([ok.index(False)], [pol.gamma])
        estimates.append(pol.alpha)
    assert sum(estimates[100:]) / 300 == pytest.approx(0.6, abs=0.05)


def test_auto_with_other_policies_starts_from_their_default():
    assert make_policy("heuristic", "auto").name == "heuristic"
    with pytest.raises(SpecEngineError, match="gamma must be an integer >= 1 or 'auto'"):
        make_policy("fixed", "eight")


def test_sd_auto_equals_ar_and_measures_costs_once(tiny_pair, tokenizer, monkeypatch, tmp_path):
    from helpers.cache import fresh_cache

    fresh_cache(monkeypatch, tmp_path)  # an empty machine table: another test's wider entry would be read
    target, _, perturbed = tiny_pair
    eng = Engine(target, tokenizer, draft=perturbed, max_seq_len=128)  # gamma defaults to "auto"
    prompts = ["def f(x):", "abc abc abc", "for i in"]
    ar = [r.token_ids for r in eng.generate(prompts, max_new_tokens=30, method="ar", ignore_eos=True)]
    out = eng.generate(prompts, max_new_tokens=30, method="sd", ignore_eos=True)
    assert [r.token_ids for r in out] == ar
    s = out[0].stats
    # 0: plain decoding wins (this tiny draft costs what its target does: by the measured costs drafting is marginal,
    # and untimed chains are priced at the plain rounds' factor, not below it)
    assert s["policy"] == "auto" and 0 <= s["gamma_mean"] <= 8 and 0 <= s["gamma"] <= 8
    costs = eng._step_costs[3]
    assert len(costs.target_s) == 9 and costs.draft_s > 0 and all(t > 0 for t in costs.target_s)
    eng.generate(prompts, max_new_tokens=4, method="sd", ignore_eos=True)
    assert eng._step_costs[3] is costs  # measured once per engine and batch size
    single = eng.generate(prompts[0], max_new_tokens=30, method="sd", gamma="auto", ignore_eos=True)
    assert single.token_ids == ar[0] and set(eng._step_costs) == {1, 3}


@pytest.mark.parametrize("method", ["sd", "hybrid"])
def test_sampling_with_auto_gamma_is_seeded(tiny_pair, tokenizer, method):
    """A seeded sampled call repeats its tokens on the same engine: its γ may depend on nothing an
    earlier call learned (the acceptance, the n-gram curves) nor on anything timed. Under costs
    where γ follows α, the α the first call learned changed the second call's γ, and
    with it which random numbers its rounds drew (failing 4 of 6 runs beside a busy process)."""
    target, _, perturbed = tiny_pair
    eng = Engine(target, tokenizer, draft=perturbed, max_seq_len=128)
    mid = StepCosts(1, draft_s=0.1, target_s=tuple(1.0 + 0.1 * w for w in range(17)))  # γ 3 at α 0.7, 1 at 0.3
    eng.step_costs = lambda state, width, draft=True: dataclasses.replace(mid, batch=state.batch)
    assert best_gamma(0.7, mid, 8, gamma_min=0) != best_gamma(0.3, mid, 8, gamma_min=0)
    kw = dict(max_new_tokens=20, temperature=0.9, seed=3, ignore_eos=True, method=method, gamma="auto")
    a, b = eng.generate("def f(", **kw), eng.generate("def f(", **kw)
    assert eng._acceptance  # the first call learned something ...
    assert a.token_ids == b.token_ids and a.stats["policy"] == "auto"  # ... which the second did not use
    assert torch.tensor(a.token_ids).lt(target.config.vocab_size).all()


LOSING = StepCosts(1, draft_s=0.5, target_s=tuple(1.0 + 1.0 * w for w in range(9)))  # bf16 on AVX2: verify ~ k decodes


def _brute_with_plain(alpha, costs, gamma_max):
    """Plain decoding (1 token per target decode) against every speculative γ, by enumeration."""
    rates = {0: 1.0 / costs.target_s[0]}
    for g in range(1, gamma_max + 1):
        rates[g] = expected_tokens(alpha, g) / (g * costs.draft_s + costs.target_s[g])
    return max(rates, key=rates.get)


@pytest.mark.parametrize("costs", [FLAT, STEEP, LOSING])
@pytest.mark.parametrize("alpha", [0.1, 0.5, 0.8])
def test_gamma_zero_is_chosen_exactly_when_plain_decoding_wins(costs, alpha):
    assert best_gamma(alpha, costs, 8, gamma_min=0) == _brute_with_plain(alpha, costs, 8)
    assert best_gamma(0.8, LOSING, 8, gamma_min=0) == 0 and best_gamma(0.95, FLAT, 8, gamma_min=0) == 8


def test_plain_rounds_probe_again_and_learn_from_the_probe():
    pol = make_policy("fixed", "auto")
    pol.set_costs(LOSING)
    assert pol.gamma == 0
    seen = []
    for _ in range(120):
        seen.append(pol.gamma)
        pol.update([0], [pol.gamma])  # a probe round: rejected at once
    probes = [i for i, g in enumerate(seen) if g]
    # each probe that confirms plain decoding doubles the wait: 16, 32, 64 plain rounds
    assert probes == [16, 49, 114] and all(seen[i] == 0 for i in range(120) if i not in probes)
    before = pol.alpha
    pol.costs = FLAT  # the text (or the machine) changed: speculation pays now
    while pol.gamma == 0:
        pol.update([0], [0])
    pol.update([pol.gamma], [pol.gamma])  # the probe accepted everything
    assert pol.alpha > before and pol.gamma >= 1


def test_a_probe_whose_short_stretch_ends_plain_doubles_the_wait():
    """An accepted probe lifts α for a round or two that the costs choose; when that stretch falls back
    to plain decoding within PROBE_SUSTAIN rounds the probe confirmed plain decoding: the wait doubles
    (16, 32, 64) instead of starting again at 16 (each probe pays the draft's catch-up: MT-bench prose,
    AVX2 copy, a call with two such probes ran 0.92x `ar`). A stretch that lasts resets the wait."""
    from specengine.methods.probe_wait import PROBE_SUSTAIN

    costs = StepCosts(1, 0.3, tuple(1.0 + 0.3 * w for w in range(9)))

    def drive(accepted_after_probe: int) -> list[int]:
        """The drafted rounds of 140: drafts rejected, except a probe's and the next
        `accepted_after_probe` rounds', accepted in full."""
        pol = make_policy("fixed", "auto")
        pol.set_costs(costs)
        drafted, good = [], 0
        for i in range(140):
            g = pol.gamma
            if pol.probing:
                good = accepted_after_probe + 1
            if g:
                drafted.append(i)
            pol.update([g if good > 0 else 0], [g])
            good -= bool(g)
        return drafted

    probes = [i for i in drive(0) if i > 1]  # round 0 drafts from the prior, then plain
    assert probes[::2] == [17, 51, 117] and probes[1::2] == [18, 52]  # probe, one round by the costs, plain
    lasting = drive(PROBE_SUSTAIN + 2)
    gaps = [b - a for a, b in zip(lasting, lasting[1:]) if b - a > 1]
    assert gaps and set(gaps) == {17}  # each lasting stretch reset the wait to 16 plain rounds


def test_sd_that_falls_back_to_plain_rounds_is_lossless(tiny_pair, tokenizer, monkeypatch):
    """Costs that make speculation lose: sd runs plain decode rounds, probes every 16, and its
    draft catches up across the plain rounds; tokens are ar's, greedy and seeded sampling,
    ragged batches included. The draft read the prompt up front (a deferred read never pays under
    these costs, so no probe would run: test_draft_prime.py)."""
    from specengine.methods import policies
    from specengine.methods.sd import SpeculativeDecoding

    target, _, perturbed = tiny_pair
    eng = Engine(target, tokenizer, draft=perturbed, max_seq_len=256)
    monkeypatch.setattr(eng, "step_costs", lambda state, width: LOSING)
    monkeypatch.setattr(SpeculativeDecoding, "defers_draft_prefill", False)
    prompts = ["def f(x):", "abc abc abc", "for i in range(10):"]
    for kw in (dict(), dict(temperature=0.9, top_k=20, seed=4)):
        ar = [r.token_ids for r in eng.generate(prompts, max_new_tokens=60, method="ar", ignore_eos=True, **kw)]
        results = eng.generate(prompts, max_new_tokens=60, method="sd", ignore_eos=True, **kw)
        out, s = [r.token_ids for r in results], results[0].stats
        if kw:  # sampling: the 16 plain rounds before the first probe are ar's rounds, same random stream
            assert [o[:16] for o in out] == [a[:16] for a in ar] and out != ar
        else:
            assert out == ar
        assert s["plain_rounds"] > 30 and s["rounds"] > s["plain_rounds"]  # some rounds probed
        assert s["predicted_tokens_per_s"] > 0 and "prediction_error" in s


@pytest.mark.parametrize("behind,width", [(1, None), (5, None), (16, None), (16, 5), (9, 4), (3, 13), (7, 2)])
def test_the_chain_first_forward_reads_what_the_draft_missed(tiny_pair, behind, width):
    """A draft behind+1 or behind+2 short of n reads what it missed in the chain's first forward
    (read_missed: the rest first where the KV headroom `width` is short): its logits after token
    n-1 and its K/V are those of a draft that prefilled tokens[:n-1] and decoded token n-1."""
    from specengine.methods.sampling import SamplingParams
    from specengine.methods.state import DecodeState
    from specengine.methods.steps import draft_catch_up, read_missed
    from specengine.runtime.runner import ModelRunner

    draft = ModelRunner(tiny_pair[2], cuda_graphs=False)
    g = torch.Generator().manual_seed(100 + behind)
    tokens = torch.randint(4, draft.config.vocab_size, (3, 64), generator=g)
    # the draft holds 29 tokens of rows 0 and 1 (behind+1 and behind+2 short) and all but the last
    # of row 2 (hybrid's per-row bound can exceed what a row missed)
    n = torch.tensor([30, 31, 30]) + behind
    draft.allocate(3, 64)
    draft.prefill(tokens[:, : 29 + behind], torch.tensor([29, 29, 29 + behind]))
    state = DecodeState(tokens, n, torch.ones(3, dtype=torch.bool), SamplingParams(), torch.zeros(3),
                        torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), attn_len=64)
    forwards, verify = [], draft.verify
    draft.verify = lambda tokens, **kw: (forwards.append(tokens.shape[1]), verify(tokens, **kw))[1]
    feed = read_missed(draft, state, behind, width)
    logits = draft_catch_up(draft, state, n, width=feed)
    draft.verify = verify
    if width is None or behind + 2 <= width:  # one forward where the headroom allows, else full ones first
        assert forwards == [behind + 2]
    else:
        assert forwards[-1] == width and all(f <= width for f in forwards) and sum(forwards) == behind + 2
    assert draft.cache.lens.tolist() == n.tolist()
    ref = ModelRunner(tiny_pair[2], cuda_graphs=False)
    for b in range(3):
        m = int(n[b]) - 1
        ref.allocate(1, 64)
        ref.prefill(tokens[b:b + 1, :m], torch.tensor([m]))
        want = ref.decode(tokens[b:b + 1, m], attn_len=64)
        torch.testing.assert_close(logits[b:b + 1], want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(draft.cache.kv[:, :, b, :m + 1], ref.cache.kv[:, :, 0, :m + 1], atol=1e-5,
                                   rtol=1e-5)


@pytest.mark.parametrize("behind,width", [(1, None), (5, None), (16, None), (16, 5), (9, 4)])
def test_draft_resync_gives_the_cache_of_a_draft_that_saw_every_token(tiny_pair, behind, width):
    """After `behind` plain rounds a row's draft is behind+1 or behind+2 tokens short of n-1;
    one resync forward (or forwards of at most `width` tokens: hybrid's headroom) brings it to
    n-1 with the K/V a prefill of those tokens gives."""
    from specengine.methods.sampling import SamplingParams
    from specengine.methods.state import DecodeState
    from specengine.methods.steps import draft_resync
    from specengine.runtime.runner import ModelRunner

    draft = ModelRunner(tiny_pair[2], cuda_graphs=False)
    g = torch.Generator().manual_seed(behind)
    tokens = torch.randint(4, draft.config.vocab_size, (2, 64), generator=g)
    n = torch.tensor([30, 31])  # committed before the plain rounds; the draft 1 and 2 short of n
    draft.allocate(2, 64)
    draft.prefill(tokens[:, :29], torch.tensor([29, 29]))
    state = DecodeState(tokens, n + behind, torch.ones(2, dtype=torch.bool), SamplingParams(), torch.zeros(2),
                        torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64), attn_len=64)
    draft_resync(draft, state, behind, width)
    assert draft.cache.lens.tolist() == (n + behind - 1).tolist()
    ref = ModelRunner(tiny_pair[2], cuda_graphs=False)
    for b in range(2):
        m = int(n[b]) + behind - 1
        ref.allocate(1, 64)
        ref.prefill(tokens[b:b + 1, :m], torch.tensor([m]))
        torch.testing.assert_close(draft.cache.kv[:, :, b, :m], ref.cache.kv[:, :, 0, :m], atol=1e-5, rtol=1e-5)


def _simulate(policy, rounds: int, spec_slowdown, accept: float = 0.8) -> list[int]:
    """Drive a γ auto policy for `rounds` rounds whose measured seconds are the model's, except
    drafted rounds, which take `spec_slowdown` times what the model predicts (a number, or a function
    of the drafted rounds before); returns the γs."""
    import random

    rng, gammas = random.Random(0), []
    for _ in range(rounds):
        g = policy.gamma
        slow = spec_slowdown(sum(1 for x in gammas if x)) if callable(spec_slowdown) else spec_slowdown
        gammas.append(g)
        n_acc = 0
        while n_acc < g and rng.random() < accept:
            n_acc += 1
        c = policy.costs
        predicted = g * c.draft_s + c.verify_s(g + 1)
        policy.update([n_acc], [g])
        policy.timed(predicted * (slow if g else 1.0))
    return gammas


def _calibrating(measured=True):
    from specengine.methods.policies import AutoGammaPolicy

    pol = AutoGammaPolicy()
    pol.calibrate = True
    pol.set_costs(StepCosts(1, 0.2, tuple(1.0 + 0.05 * w for w in range(9)), measured=measured))
    return pol


def test_gamma_auto_settles_on_plain_decoding_when_its_rounds_measure_slower_than_predicted():
    """The cost model says speculation wins; the rounds say it loses (3x slower than predicted):
    after a few rounds of each kind the policy decodes plainly, probing now and then."""
    pol = _calibrating()
    gammas = _simulate(pol, 200, spec_slowdown=3.0)
    assert gammas[0] > 0  # the model's choice first
    assert 0 in gammas[:10]  # plain decoding timed early, to compare
    late = gammas[50:]
    assert late.count(0) > 0.9 * len(late) and any(late)  # plain, with probes
    assert pol.clock.factor("spec") == pytest.approx(3.0)


def test_a_factor_taken_in_a_slow_moment_gives_way_to_the_next_probe():
    """The drifting-VM hazard (docs/design.md, "Never slower"): the call's first drafted rounds ran
    in a slow moment (2.5x), the plain factor is an earlier call's, so the policy turns to plain
    rounds, and the machine is fast again by then. A probe is measured in the same moment as the
    plain rounds before it; it must outweigh the drafted rounds timed back then, so the policy
    speculates again from the first probe on. (When only the probed kind aged, the first probe
    moved the factor 15% of the way, confirmed plain decoding, doubled the wait and the next
    48 of 74 rounds were plain.)"""
    from specengine.methods.policies import AutoGammaPolicy

    pol = AutoGammaPolicy()
    pol.calibrate = True
    pol.recall({"greedy:round_clock": {"plain": 1.0}}, "greedy")
    pol.set_costs(StepCosts(1, 0.2, tuple(1.0 + 0.05 * w for w in range(9)), measured=True))
    gammas = _simulate(pol, 80, spec_slowdown=lambda drafted: 2.5 if drafted < 4 else 1.0)  # the first 4 drafted rounds
    first_probe = next(i for i in range(5, 80) if gammas[i] and not gammas[i - 1])
    assert gammas[4] == 0 and first_probe <= 4 + 17  # it did turn to plain rounds, and probed once
    after = gammas[first_probe:]
    assert sum(g == 0 for g in after) <= 0.1 * len(after)  # and speculates again from that probe on


def test_a_factor_an_earlier_call_filed_in_a_slow_moment_gives_way_to_this_calls_first_probe():
    """The same hazard across calls: an earlier call filed chains at 3x their model (the VM's slow moment),
    this call decodes plainly on it, and the machine is fast again. The filed factor ages with the plain
    rounds this call books before its first chain, as this call's own would: the probe after them outweighs
    it, and the call drafts from there. (Seeded at the weight of 3 rounds whatever came before, each call's one
    probe moved the factor a fifth of the way: on the real pair, after a noisy hour, 12 calls in a row of 62
    plain rounds of 63.)"""
    pol = AutoGammaPolicy()
    pol.calibrate = True
    pol.recall({"greedy": 0.8, "greedy:round_clock": {"plain": 1.0, "spec": 3.0}}, "greedy")
    pol.set_costs(StepCosts(1, 0.2, tuple(1.0 + 0.05 * w for w in range(9)), measured=True))
    gammas = _simulate(pol, 64, spec_slowdown=1.0)  # the model's time: the machine is fast again
    first_probe = next(i for i, g in enumerate(gammas) if g)
    assert first_probe >= 8  # it did start plain on the filed factor
    after = gammas[first_probe:]
    assert sum(g == 0 for g in after) <= 0.1 * len(after)  # and drafts from the first probe on
    assert pol.clock.factor("spec") < 1.2


def test_gamma_auto_keeps_speculating_when_its_rounds_measure_as_predicted():
    pol = _calibrating()
    gammas = _simulate(pol, 100, spec_slowdown=1.0)
    assert sum(g == 0 for g in gammas) <= 5  # about the plain rounds that time the comparison
    assert pol.clock.factors() == {"plain": pytest.approx(1.0), "spec": pytest.approx(1.0)}


def test_pinned_costs_are_never_corrected_by_round_times():
    """Costs a caller pinned (tests, replays) are the model: round times never change the choice."""
    pol = _calibrating(measured=False)
    gammas = _simulate(pol, 60, spec_slowdown=3.0)
    assert 0 not in gammas and pol.clock.factors() == {}


def test_the_prediction_is_the_plan_as_the_measured_rounds_corrected_it():
    """Rounds that take 1.5x (drafted) and 1.2x (plain) what the step costs say: the prediction
    reported beside the measured rate charges each round the model's seconds times the correction
    measured before it, so past the first rounds it matches the time the rounds took (the bare
    model would be 20-50% fast)."""
    from specengine.methods.policies import expected_tokens

    pol = _calibrating()
    measured = 0.0
    for i in range(80):
        g = pol.gamma
        c = pol.costs
        pol.update([g // 2], [g])
        seconds = (g * c.draft_s + c.verify_s(g + 1)) * (1.5 if g else 1.2)
        pol.timed(seconds)
        measured += seconds
        if i == 9:
            early = (pol.clock.forecast[1], measured)
    late_predicted, late_measured = pol.clock.forecast[1] - early[0], measured - early[1]
    assert late_predicted == pytest.approx(late_measured, rel=0.02)
    assert pol.clock.forecast[0] > 0 and expected_tokens(pol.alpha, 1) > 1


def test_a_probe_after_plain_rounds_is_priced_with_its_catch_up():
    """A drafted round after k plain rounds first reads the k tokens the draft missed: the model
    prices that (`catch_up_s`, at the draft's cost per width), so a probe that took what
    its catch-up costs books as predicted, and the corrections stay at 1 (unpriced, the probe read
    as 1.2x slow and a factor taken in a slow moment could never come down by probes)."""
    from specengine.methods.policies import catch_up_s

    pol = _calibrating()
    c = pol.costs
    assert catch_up_s(c, 0, 9) == 0.0
    assert catch_up_s(c, 6, 5) == pytest.approx(0.2 * (c.verify_s(5) + c.verify_s(3) - c.verify_s(2)) / c.verify_s(1))
    steep = dataclasses.replace(c, draft_widths_s=(0.2, 0.3, 0.45, 0.6, 0.8))  # the draft's own curve, where timed
    assert catch_up_s(steep, 6, 5) == pytest.approx(0.8 + 0.45 - 0.3)

    def run(g, behind=0):
        pol.gamma = g
        extra = catch_up_s(c, behind, 9) if g else 0.0
        pol.extra_s = extra
        pol.update([min(g, 1)], [g])
        pol.timed(g * c.draft_s + c.verify_s(g + 1) + extra)

    for _ in range(5):
        run(3)
    for _ in range(8):
        run(0)
    run(3, behind=8)  # the probe
    assert pol.clock.factors() == {"plain": pytest.approx(1.0), "spec": pytest.approx(1.0)}


def test_carried_corrections_apply_to_measured_costs_only():
    """The corrections an earlier call (or the machine's table) left start a call whose costs were
    measured; pinned costs (tests, replays) stay the model whatever the store holds."""
    from specengine.methods.policies import AutoGammaPolicy

    store = {"greedy:round_clock": {"plain": 5.0}}
    for measured in (False, True):
        pol = AutoGammaPolicy()
        pol.calibrate = True
        pol.recall(store, "greedy")
        pol.set_costs(StepCosts(1, 0.2, tuple(1.0 + 0.05 * w for w in range(9)), measured=measured))
        assert pol.clock.factors() == ({"plain": 5.0} if measured else {})


def test_a_carried_plain_factor_is_timed_again_once_the_calls_speculation_was():
    """A plain factor filed in a slow moment (1.66) while speculation wins every round: without a plain
    round of its own the call never learns that plain decoding is cheaper now (MT-bench on the AVX2
    EPYC: `sd` drafted long chains and 5 of 15 calls ran slower than `ar`). So after this call's first
    drafted round the policy times one plain round, and the factor moves toward what it measured."""
    from specengine.methods.policies import AutoGammaPolicy

    pol = AutoGammaPolicy()
    pol.calibrate = True
    pol.recall({"greedy:round_clock": {"plain": 1.66, "spec": 1.0}}, "greedy")
    pol.set_costs(StepCosts(1, 0.2, tuple(1.0 + 0.05 * w for w in range(9)), measured=True))
    gammas = []
    for _ in range(12):
        g = pol.gamma
        gammas.append(g)
        c = pol.costs
        pol.update([g], [g])  # every proposal accepted
        pol.timed(g * c.draft_s + c.verify_s(g + 1))  # every round as the model predicted
    assert gammas.count(0) == 1 and gammas[0] > 0 and gammas.index(0) <= 2  # one plain round, once one was drafted
    assert pol.clock.factor("plain") < 1.66 and "plain" not in pol.clock.prior
    assert not pol.clock.wants_plain() and not pol.clock.wants_plain(afresh=True)


@pytest.mark.parametrize("round_s", [0.005, 0.07, 2.0])
def test_a_carried_correction_weighs_three_rounds_however_long_a_round_lasts(round_s):
    """A factor carried from an earlier call (or process) counts as MIN_ROUNDS rounds of this
    call's size: three rounds at factor 1 then bring a carried 4.0 to the same value whether a
    round lasts 5 ms (a GPU) or 2 s. Weighed in seconds, a slow call's 4.0 outlasted the hundreds of
    GPU rounds that contradicted it. Expected value computed here from the decayed weights."""
    from specengine.methods.round_clock import DECAY, MIN_ROUNDS, RoundClock

    clock = RoundClock(switch_costs=False)
    clock.seed({"plain": 4.0})
    assert clock.factor("plain") == 4.0 and clock.known("plain")
    for _ in range(3):
        clock.expect("plain", round_s)
        clock.timed(round_s)  # measured as the model predicted: factor 1
    prior = MIN_ROUNDS * DECAY ** 3
    own = sum(DECAY ** k for k in range(3))
    assert clock.factor("plain") == pytest.approx((4.0 * prior + own) / (prior + own))


@pytest.mark.parametrize("by", ["booked", "ticked"])  # sd's own plain rounds; hybrid's n-gram rounds (`tick`)
def test_a_carried_correction_ages_with_the_rounds_before_its_first(by):
    """A carried factor not yet weighed in ages with every round that goes by before the first round of its
    kind, as this call's own timings of it would: after 16 of them the first round outweighs it five to one (a
    carried 3.0 reads ~1.3 after it, where unaged it read 2.4). Expected
    value computed here from the decayed weights."""
    from specengine.methods.round_clock import DECAY, MIN_ROUNDS, RoundClock

    clock = RoundClock(switch_costs=False)
    clock.seed({"spec": 3.0})
    for _ in range(16):
        if by == "ticked":
            clock.tick()
        else:
            clock.expect("plain", 1.0)
            clock.timed(1.0)
    assert clock.factor("spec") == 3.0  # still the carried factor until a chain is timed
    clock.expect("spec", 1.0)
    clock.timed(1.0)
    prior = MIN_ROUNDS * DECAY ** 17
    assert clock.factor("spec") == pytest.approx((3.0 * prior + 1.0) / (prior + 1.0)) and clock.factor("spec") < 1.35


def test_hybrids_chain_clock_ages_with_the_rounds_its_chain_sat_out():
    """`hybrid`'s n-gram rounds are rounds its chains' clock does not book: they age it (`RoundClock.tick`), so an
    earlier call's chain factor gives way to the call's first chain as `sd`'s gives way to its first probe."""
    from test_ngram import hybrid_at

    m, _ = hybrid_at(0.9, 0.8, 0.1, lambda w: 1.0 + 0.1 * (w - 1))
    m.draft_policy.clock.seed({"spec": 3.0})
    m.ctx = type("Ctx", (), {"acceptance": {}})()
    m.key, m.kind = "greedy", "ngram"
    m.call = type("Call", (), {"rows": []})()
    m.after_round([1], [1])
    assert m.draft_policy.clock.aged["spec"] == 1


def test_no_probe_catches_up_more_tokens_than_the_call_has_left():
    """A probe pays the draft's catch-up of every plain round since the last one; only the tokens
    left can repay it. Settled on plain rounds, the probes come after 16, 32, 64 plain rounds, but
    not where fewer tokens are left than the probe would catch up (the policy alone, then sd on the
    tiny pair: the tokens stay ar's)."""
    def probes(new):
        pol = make_policy("fixed", "auto")
        pol.set_costs(LOSING)
        pol.left, seen = new, []
        while pol.left > 0:
            seen.append(pol.gamma)
            pol.left -= 1  # every round here commits one token
            pol.update([0], [pol.gamma])
        return [i for i, g in enumerate(seen) if g]

    assert probes(200) == [16, 49, 114]  # 86 tokens left at the third: it may repay its 64
    assert probes(120) == [16, 49]  # at round 114 six tokens are left: no catch-up of 64
    assert probes(60) == [16]  # at round 49, 11 left of 32


def test_sd_skips_the_probe_its_reply_cannot_repay(tiny_pair, tokenizer, monkeypatch):
    """(A draft that read the prompt up front: one whose read is deferred never probes under costs
    that lose, test_draft_prime.py.)"""
    from specengine.methods.sd import SpeculativeDecoding

    target, _, perturbed = tiny_pair
    eng = Engine(target, tokenizer, draft=perturbed, max_seq_len=256)
    monkeypatch.setattr(eng, "step_costs", lambda state, width: LOSING)
    monkeypatch.setattr(SpeculativeDecoding, "defers_draft_prefill", False)
    ar = eng.generate("def f(x):", max_new_tokens=60, method="ar", ignore_eos=True).token_ids
    r = eng.generate("def f(x):", max_new_tokens=60, method="sd", gamma="auto", ignore_eos=True)
    assert r.token_ids == ar
    drafted = [i for i, (proposed, _, _) in enumerate(r.stats["round_log"]) if proposed]
    assert len(drafted) == 1 and drafted[0] >= 16  # the probe after 16 plain rounds, none after 32 more


def test_a_new_call_starts_from_the_pairs_rate_not_the_last_texts():
    """A call's first choice comes from the pair's acceptance over the engine's recent greedy calls:
    a short call on text the draft gets wrong (its own rate below break-even) leaves the next call
    speculating on what the pair accepted over many rounds before it (PAIR_DECAY); a long run of such
    text moves the pair's rate too. (Started from the last call's own rate, HumanEval/2 decoded plainly
    after HumanEval/1 where it ran 1.21x `ar` after HumanEval/0; docs/design.md, "Never slower".)"""
    mid = StepCosts(1, draft_s=0.3, target_s=(1.0, 1.25, 1.45, 1.65, 1.85, 2.05, 2.25, 2.45, 2.65))
    assert best_gamma(0.5, mid, 8, gamma_min=0) == 0 and best_gamma(0.8, mid, 8, gamma_min=0) >= 1
    g, store = torch.Generator().manual_seed(0), {}

    def call(rounds, rate, costs=mid):
        pol = AutoGammaPolicy()
        pol.recall(store, "greedy")
        pol.set_costs(costs)
        first = (pol.alpha, pol.gamma)
        for _ in range(rounds):
            ok = (torch.rand(pol.gamma, generator=g) < rate).tolist() + [False]
            pol.update([ok.index(False) if pol.gamma else 0], [pol.gamma])
            pol.remember(store, "greedy")
        return first, pol.alpha

    call(30, 0.9)  # text the draft gets right
    _, own = call(20, 0.0)  # a short reply it gets wrong: its own rate ends below break-even
    assert best_gamma(own, mid, 8, gamma_min=0) == 0
    (start, gamma), _ = call(1, 0.9)
    assert start > 0.75 and gamma >= 1  # the pair's rate: speculate on the next text
    call(200, 0.3, FLAT)  # a long run of text it gets less right (FLAT: drafting throughout) moves it
    (start, gamma), _ = call(1, 0.3)
    assert start == pytest.approx(0.3, abs=0.1) and gamma == 0


def test_two_rejected_first_rounds_do_not_outweigh_the_pairs_rate():
    """A call starts from the pair's rate at START_WEIGHT tokens: a text whose first two rounds are
    rejected outright still drafts where the pair accepts most. (At the prior's weight of 4 the rate read
    0.54, below break-even here, and the call decoded plainly to its end: MT-bench/2, 62 plain rounds of
    64, where the same call drafting ran 1.18x `ar`; docs/design.md, "A new call starts from the pair's
    rate".) A pair with little history keeps the prior's weight."""
    costs = StepCosts(1, draft_s=0.3, target_s=tuple(1.0 + 0.25 * w for w in range(9)))
    assert best_gamma(0.54, costs, 8, gamma_min=0) == 0 and best_gamma(0.6, costs, 8, gamma_min=0) >= 1
    g, store = torch.Generator().manual_seed(1), {}

    def start():
        pol = AutoGammaPolicy()
        pol.recall(store, "greedy")
        pol.set_costs(costs)
        return pol

    for _ in range(3):  # earlier calls on text the draft gets right
        pol = start()
        for _ in range(20):
            ok = (torch.rand(pol.gamma, generator=g) < 0.85).tolist() + [False]
            pol.update([ok.index(False) if pol.gamma else 0], [pol.gamma])
            pol.remember(store, "greedy")
    pol = start()
    assert pol.accepted + pol.rejected == pytest.approx(8.0)
    for _ in range(2):  # this text's first two rounds: every draft rejected
        assert pol.gamma >= 1
        pol.update([0], [pol.gamma])
    assert pol.gamma >= 1 and pol.alpha > 0.6
    fresh = AutoGammaPolicy()
    fresh.recall({"greedy": 0.85, "greedy:pair": (0.85, 0.15)}, "greedy")  # one token of history
    assert fresh.accepted + fresh.rejected == pytest.approx(4.0) and fresh.alpha == pytest.approx(0.85)


def test_a_first_call_starts_from_the_filed_pairs_rate_at_the_start_weight():
    """A new engine's first call starts from the rate earlier processes filed for the pair (the
    machine's table: step_costs.FiledClocks) at START_WEIGHT, as later calls start from the engine's
    own: two rejected first rounds leave it drafting. At the prior's weight it fell to γ 1 for rounds
    where the next call, starting from its own rate, kept γ 2 (HumanEval/1: 28 rounds against 26)."""
    from specengine.timing import FILED

    costs = StepCosts(1, draft_s=0.3, target_s=tuple(1.0 + 0.25 * w for w in range(9)), measured=True)
    pol = AutoGammaPolicy()
    pol.calibrate = True  # a greedy call (sd.begin): measured costs are corrected, filed state applies
    pol.recall({"greedy" + FILED: 0.85}, "greedy")
    pol.set_costs(costs)
    assert pol.alpha == pytest.approx(0.85) and pol.accepted + pol.rejected == pytest.approx(8.0)
    for _ in range(2):
        assert pol.gamma >= 1
        pol.update([0], [pol.gamma])
    assert pol.gamma >= 1 and pol.alpha > 0.6


def test_a_stale_pairs_rate_gives_way_to_the_prior():
    """Rounds without a chain teach the pair's rate nothing, and a draft whose prompt is unread never probes
    (sd books them plain, as here). After STALE_FIRST such rounds, across calls or within one, the rate gives
    way to the prior and the policy drafts again; settled on plain decoding STALE_SUSTAIN rounds later, the wait
    doubles; still drafting, it resets. (Without this, a rate learned on prose kept `sd` plain on code for good: HumanEval
    64 plain rounds of 64 in every call after MT-bench/0, docs/design.md, "A stale rate".)"""
    from specengine.methods.probe_wait import STALE_FIRST

    mid = StepCosts(1, draft_s=0.3, target_s=(1.0, 1.25, 1.45, 1.65, 1.85, 2.05, 2.25, 2.45, 2.65))
    prior = AutoGammaPolicy().alpha
    assert best_gamma(0.3, mid, 8, gamma_min=0) == 0 and best_gamma(prior, mid, 8, gamma_min=0) >= 1
    store = {"greedy": 0.3, "greedy:pair": (3.0, 7.0)}  # a rate learned where chains lost

    def call(rounds, accept=None):
        """A call of `rounds`: chains the policy chooses accepted in full (accept=True) or rejected
        (False); None: every round plain (the prompt unread). Returns (α, γ) at its start."""
        pol = AutoGammaPolicy()
        pol.recall(store, "greedy")
        pol.set_costs(mid)
        start = (pol.alpha, pol.gamma)
        for _ in range(rounds):
            g = pol.gamma if accept is not None else 0
            pol.update([g if accept else 0], [g])
            pol.remember(store, "greedy")
        return start

    assert call(64) == (0.3, 0) and call(63) == (0.3, 0)
    assert call(1) == (0.3, 0)  # after 127 rounds without a chain: still the pair's rate
    assert "greedy:pair" not in store  # the 128th gave way to the prior: the pair's low counts are dropped too
    alpha, gamma = call(64, accept=False)  # after 128: from the prior; its chains lose and it settles plain
    assert alpha == pytest.approx(prior) and gamma >= 1
    assert store["greedy:stale"][1:] == (2 * STALE_FIRST, None)  # plain STALE_SUSTAIN rounds on: twice the wait
    while store["greedy:stale"][0] + 16 < 2 * STALE_FIRST:  # each call meanwhile from the pair's low rate, plain
        assert call(16) == (pytest.approx(store["greedy"]), 0) and store["greedy"] < 0.5
    # The wait ends within a call (the serving core's lasts as long as requests come): its rounds plain while
    # the rate is low (an unread draft: no probe), then from the prior on, and the text has changed: accepted.
    pol = AutoGammaPolicy()
    pol.recall(store, "greedy")
    pol.set_costs(mid)
    assert pol.gamma == 0 and pol.alpha < 0.5
    plain = 0
    for _ in range(64):
        drafts = pol.gamma if pol.alpha > 0.6 else 0
        plain += not drafts
        pol.update([drafts], [drafts])
        pol.remember(store, "greedy")
    assert 0 < plain < 32 and pol.gamma >= 1 and pol.alpha > 0.9  # plain until the wait ended, mid-call
    assert store["greedy:stale"][1:] == (STALE_FIRST, None)  # drafting STALE_SUSTAIN rounds on: the first wait


def test_a_round_that_captured_a_graph_is_not_booked_to_the_round_clock(tiny_pair, tokenizer, monkeypatch, tmp_path):
    """A capture (two eager runs and the graph: tens of ms on a GPU) is a one-time cost: the round
    that paid it is not timed into γ auto's cost corrections (on an H200 a probe's captures read as
    3.9x the model's cost of drafting and kept γ auto plain). The stand-in capture here takes 0.3 s."""
    import time

    from helpers.cache import fresh_cache

    from specengine.methods.policies import AutoGammaPolicy
    from specengine.runtime import graphs

    fresh_cache(monkeypatch, tmp_path)
    target, _, perturbed = tiny_pair
    eng = Engine(target, tokenizer, draft=perturbed, max_seq_len=128)

    def slow_capture(fn, pool, device):
        fn(), fn()
        time.sleep(0.3)
        return type("Replay", (), {"replay": staticmethod(fn)})()

    eng.set_cuda_graphs(True, capture=slow_capture, lazy=True)
    booked = []
    timed = AutoGammaPolicy.timed
    monkeypatch.setattr(AutoGammaPolicy, "timed", lambda self, s: (booked.append(s), timed(self, s)))
    before = graphs.captures()
    ar = eng.generate("def f(x):", max_new_tokens=20, method="ar", ignore_eos=True).token_ids
    out = eng.generate("def f(x):", max_new_tokens=20, method="sd", gamma="auto", ignore_eos=True)
    assert out.token_ids == ar
    assert graphs.captures() > before and booked  # graphs were captured, and rounds timed
    assert max(booked) < 0.3  # none of them a round that captured
