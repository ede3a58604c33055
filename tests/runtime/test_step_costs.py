"""measure_step_costs times every width (and the draft step) in rounds, so a machine whose speed
drifts during the measurement still gives the ratios between widths that γ "auto" is chosen by."""
from types import SimpleNamespace

import pytest
import torch

from specengine import timing
from specengine.runtime.step_costs import StepCosts, measure_step_costs
from helpers.cache import fresh_cache


class Clock:
    """A fake perf_counter: a forward of w tokens takes w units (the draft's 0.25), times the
    machine's speed, which is 1.5x slower for the first `slow_calls` forwards."""

    def __init__(self, slow_calls: int):
        self.now, self.calls, self.slow_calls = 0.0, 0, slow_calls

    def __call__(self):
        return self.now

    def forward(self, units: float) -> None:
        self.now += units * (1.5 if self.calls < self.slow_calls else 1.0)
        self.calls += 1


class Runner:
    def __init__(self, clock, unit: float):
        self.clock, self.unit = clock, unit

    def verify(self, tokens, attn_len):
        self.clock.forward(self.unit * tokens.shape[1])


def state():
    return SimpleNamespace(batch=1, n=20, attn_len=20, tokens=torch.zeros(1, 32, dtype=torch.int64),
                           positions=lambda start, width: torch.arange(start, start + width)[None])


@pytest.mark.parametrize("slow_calls", [0, 7, 13])
def test_a_drift_during_the_measurement_leaves_the_width_ratios_true(monkeypatch, slow_calls):
    clock = Clock(slow_calls)
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    costs = measure_step_costs(Runner(clock, 1.0), Runner(clock, 0.25), state(), max_width=9)
    # one round over the 9 widths and the draft's 9 is 18 calls: the slow ones all fall in the first
    assert [costs.verify_s(w) / costs.verify_s(1) for w in range(1, 10)] == pytest.approx(list(range(1, 10)))
    assert costs.cost_ratio == pytest.approx(0.25)


def test_the_drafts_own_width_curve_is_timed_and_read(monkeypatch):
    """A catch-up reads several tokens in one draft forward, whose cost per width is the draft's own
    (on the AVX2 EPYC the Q4_0 draft's 4 tokens cost 1.78x one, the target's 1.33x): timed beside the
    target's widths, in the same rounds, and read by `draft_read_s`; pinned costs without a curve
    scale the draft step by the target's."""
    clock = Clock(0)
    monkeypatch.setattr(timing.time, "perf_counter", clock)

    class Steep(Runner):  # w tokens cost w^2 units: steeper than the target's w
        def verify(self, tokens, attn_len):
            self.clock.forward(self.unit * tokens.shape[1] ** 2)

    costs = measure_step_costs(Runner(clock, 1.0), Steep(clock, 0.25), state(), max_width=4)
    assert costs.draft_widths_s == pytest.approx((0.25, 1.0, 2.25, 4.0)) and costs.draft_s == pytest.approx(0.25)
    assert [costs.draft_read_s(w) for w in (1, 3, 6)] == pytest.approx([0.25, 2.25, 4.0 + 2 * 1.25])
    pinned = StepCosts(1, 0.25, (1.0, 2.0, 4.0))
    assert [pinned.draft_read_s(w) for w in (1, 2, 3)] == pytest.approx([0.25, 0.5, 1.0])
    assert measure_step_costs(Runner(clock, 1.0), None, state(), max_width=3).draft_widths_s is None
    alone = costs.target_only()  # n-gram rounds: the target's widths, the draft's reads free
    assert alone.target_s == costs.target_s and alone.draft_s == 0.0 and alone.draft_read_s(3) == 0.0


def test_without_a_draft_the_step_is_free(monkeypatch):
    clock = Clock(0)
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    costs = measure_step_costs(Runner(clock, 1.0), None, state(), max_width=3)
    assert costs.draft_s == 0.0 and costs.target_s == pytest.approx((1.0, 2.0, 3.0))


class PrefillRunner(Runner):
    """A draft runner whose prefill-sized forward (logits at the last token) is timed too."""

    def __init__(self, clock, unit: float, max_seq_len: int):
        super().__init__(clock, unit)
        self.cache, self.seen = SimpleNamespace(max_seq_len=max_seq_len), []

    def forward(self, tokens, attn_len, logits_at):
        self.seen.append((tokens.shape[1], attn_len, logits_at.tolist()))
        self.clock.forward(self.unit * tokens.shape[1])


def test_the_drafts_prefill_rate_is_timed_where_the_cache_has_room(monkeypatch):
    """hybrid's deferred draft prefill is priced at the draft's own prefill rate: a forward of
    PRIME_CHUNK tokens past the row's end (scratch K/V), logits at its last token, per token;
    not timed (None) where the cache has no room for it."""
    from specengine.runtime.step_costs import PRIME_CHUNK

    clock = Clock(0)
    monkeypatch.setattr(timing.time, "perf_counter", clock)
    st = state()
    st.n, st.positions = torch.tensor([20]), lambda start, width: (start[:, None] + torch.arange(width)).clamp_max(31)
    draft = PrefillRunner(clock, 0.25, max_seq_len=19 + PRIME_CHUNK)
    costs = measure_step_costs(Runner(clock, 1.0), draft, st, max_width=3)
    assert costs.draft_prefill_s == pytest.approx(0.25)  # 0.25 a token, whatever the chunk
    assert draft.seen == [(PRIME_CHUNK, 19 + PRIME_CHUNK, [[PRIME_CHUNK - 1]])] * 3
    tight = PrefillRunner(clock, 0.25, max_seq_len=18 + PRIME_CHUNK)
    assert measure_step_costs(Runner(clock, 1.0), tight, st, max_width=3).draft_prefill_s is None
    assert not tight.seen and measure_step_costs(Runner(clock, 1.0), None, st, max_width=3).draft_prefill_s is None


def test_warmup_measures_what_every_cost_driven_method_would_measure_in_its_first_call(tiny_pair, tokenizer,
                                                                                        monkeypatch, tmp_path):
    """After warmup() no call measures step costs (the first request pays nothing): sd / hybrid γ
    auto and PEARL with the draft, n-gram rounds on the target alone, at their widest widths."""
    from specengine import Engine
    from specengine.runtime import step_costs as sc

    fresh_cache(monkeypatch, tmp_path)  # an empty machine table: warmup times them
    measured = []
    real = sc.measure_step_costs
    monkeypatch.setattr(sc, "measure_step_costs", lambda *a, **k: measured.append(1) or real(*a, **k))
    eng = Engine(tiny_pair[0], tokenizer, draft=tiny_pair[2], max_seq_len=96)
    eng.warmup()
    assert set(eng.measured_step_costs) == {1, (1, "target")}
    # timed once, at hybrid's widest width: sd and PEARL read its widths, n-gram the target's alone
    assert measured == [1] and eng.measured_step_costs[(1, "target")].target_s == eng.measured_step_costs[1].target_s
    assert not eng._acceptance  # nothing learned of acceptance from warmup's junk prompt carries over
    measured.clear()
    for method in ("sd", "hybrid", "pearl", "ngram"):
        eng.generate([5, 9, 2], max_new_tokens=4, ignore_eos=True, method=method, gamma="auto")
    assert not measured


def test_a_second_engine_on_this_machine_reads_the_costs_from_its_table(tiny_pair, tokenizer, monkeypatch, tmp_path):
    """Step costs are filed in the machine's table under the runners' cost signature: a second engine
    of the same models reads them (no forward timed); one whose forward differs (the torch ops
    instead of the compiled ones) times them again."""
    import copy

    from specengine import Engine
    from specengine.runtime import step_costs as sc

    fresh_cache(monkeypatch, tmp_path)
    measured = []
    real = sc.measure_step_costs
    monkeypatch.setattr(sc, "measure_step_costs", lambda *a, **k: measured.append(a[3]) or real(*a, **k))
    first = Engine(copy.deepcopy(tiny_pair[0]), tokenizer, draft=copy.deepcopy(tiny_pair[2]), max_seq_len=96)
    first.generate([5, 9, 2], max_new_tokens=4, ignore_eos=True, method="sd", gamma="auto")
    assert len(measured) == 1
    second = Engine(copy.deepcopy(tiny_pair[0]), tokenizer, draft=copy.deepcopy(tiny_pair[2]), max_seq_len=96)
    second.generate([7, 1], max_new_tokens=4, ignore_eos=True, method="sd", gamma="auto")
    assert len(measured) == 1 and second.measured_step_costs[1] == first.measured_step_costs[1]
    assert sc.cost_signature(second.target) == sc.cost_signature(first.target)
    third = Engine(copy.deepcopy(tiny_pair[0]), tokenizer, draft=copy.deepcopy(tiny_pair[2]), max_seq_len=96,
                   kernels="torch")
    assert sc.cost_signature(third.target) != sc.cost_signature(first.target)
    third.generate([7, 1], max_new_tokens=4, ignore_eos=True, method="sd", gamma="auto")
    assert len(measured) == 2


def test_an_engine_forgets_its_step_costs_when_what_its_forwards_run_changes(tiny_pair, tokenizer, monkeypatch,
                                                                            tmp_path):
    """Costs timed on one ops table, matmul plan, graph setting or batch-invariant mode would price
    forwards that no longer run: each switch drops them, and the next γ auto call times the forwards that
    do (here the torch ops: another cost signature, so the machine's table has none to read)."""
    import copy

    from specengine import Engine
    from specengine.runtime import step_costs as sc

    fresh_cache(monkeypatch, tmp_path)
    measured = []
    real = sc.measure_step_costs
    monkeypatch.setattr(sc, "measure_step_costs", lambda *a, **k: measured.append(a[3]) or real(*a, **k))
    eng = Engine(copy.deepcopy(tiny_pair[0]), tokenizer, draft=copy.deepcopy(tiny_pair[2]), max_seq_len=96)
    call = lambda: eng.generate([5, 9, 2], max_new_tokens=4, ignore_eos=True, method="sd", gamma="auto")  # noqa: E731
    for switch in (lambda: eng.set_kernels("torch"), lambda: eng.set_cuda_graphs(False),
                   lambda: eng.set_cpu_matmul("auto"), lambda: eng.set_batch_invariant(False)):
        call()
        assert eng.measured_step_costs
        switch()
        assert not eng.measured_step_costs
    call()
    assert len(measured) == 2 and eng.measured_step_costs  # the compiled ops' costs, then the torch ops'


def test_the_rounds_corrections_are_filed_and_a_new_engine_starts_from_them(tiny_pair, tokenizer, monkeypatch,
                                                                             tmp_path):
    """What a call's plain rounds measured against the step costs (round_clock.py: measured /
    predicted seconds) is filed beside them: a second engine of the same models starts its first call
    from it. The drafted rounds' correction is never filed. A call whose correction moved by no more
    than REPLAN writes nothing; one that moved more files it again (the plan it predicted by missed)."""
    import copy

    from specengine import Engine, machine
    from specengine.methods import round_clock

    fresh_cache(monkeypatch, tmp_path)
    first = Engine(copy.deepcopy(tiny_pair[0]), tokenizer, draft=copy.deepcopy(tiny_pair[2]), max_seq_len=96)
    with first._clocks.paused():  # costs filed; its own rounds' factor (timing-dependent: filed since a call's last
        # timed round is, it could sit within REPLAN of the 1.3 below, which then wrote nothing) is not
        first.generate([5, 9, 2], max_new_tokens=4, ignore_eos=True, method="sd", gamma="auto")
    first._acceptance["greedy:round_clock"] = {"plain": 1.3, "spec": 1.5}  # as a call's rounds leave them
    first._clocks.file(first._acceptance)
    filed = {"plain": 1.3}  # the drafted rounds' is the call's own: a slow call's must not stick

    seeded = []
    real_seed = round_clock.RoundClock.seed
    monkeypatch.setattr(round_clock.RoundClock, "seed", lambda self, f: seeded.append(dict(f)) or real_seed(self, f))
    second = Engine(copy.deepcopy(tiny_pair[0]), tokenizer, draft=copy.deepcopy(tiny_pair[2]), max_seq_len=96)
    with second._clocks.paused():  # its own rounds' factor (timing-dependent) is not what is tested here
        second.generate([7, 1], max_new_tokens=4, ignore_eos=True, method="sd", gamma="auto")
    assert seeded[0] == filed  # the first call's policy started from the filed corrections

    writes = []
    real_update = machine.update
    monkeypatch.setattr(machine, "update", lambda new, **kw: writes.append(new) or real_update(new, **kw))
    second._clocks.file({"greedy:round_clock": {"plain": 1.35, "spec": 3.0}})  # within 10%: the plan holds
    assert writes == []
    second._clocks.file({"greedy:round_clock": {"plain": 1.0, "spec": 1.5}})  # missed by 23%: re-planned
    assert len(writes) == 1
    third = Engine(copy.deepcopy(tiny_pair[0]), tokenizer, draft=copy.deepcopy(tiny_pair[2]), max_seq_len=96)
    assert {k: v for k, v in third._clocks.filed.items() if k.endswith(":round_clock")} == {
        "greedy:round_clock": {"plain": 1.0}}


def test_what_the_rounds_filed_is_seen_by_a_faster_process(tiny_pair, tokenizer, monkeypatch, tmp_path):
    """The rounds' corrections and the acceptance are ratios and rates, not times: filed without the
    machine's speed stamp, they seed a process whose reference matvec runs STALE times faster than the
    filing one's. Stamped, such a process (this VM's reference: 1.4-2.15 ms process to process) started
    from the priors: a first PEARL call read the prompt and ran losing windows (0.92x the next call)."""
    import copy

    from specengine import Engine, machine

    fresh_cache(monkeypatch, tmp_path)
    speed = {"ms": 10.0}
    monkeypatch.setattr(machine, "reference_ms", lambda: speed["ms"])
    engine = lambda: Engine(copy.deepcopy(tiny_pair[0]), tokenizer, draft=copy.deepcopy(tiny_pair[2]),  # noqa: E731
                            max_seq_len=96)
    filed = {"greedy": 0.8, "greedy:round_clock": {"plain": 1.2}, "pearl:greedy:learned": {"alpha": 0.4, "every": 16}}
    engine()._clocks.file(copy.deepcopy(filed))
    speed["ms"] = 10.0 / (machine.STALE * 1.1)  # a faster moment: a timed entry of 10 ms would be left out
    assert engine()._clocks.filed == {**filed, "pearl:greedy:learned": {"alpha": 0.4, "every": 16, "run": 0}}


def test_the_filed_state_follows_the_runners_key(tiny_pair, tokenizer, monkeypatch, tmp_path):
    """The table's key is the runners' cost signature as it is now. Widening an unpadded batch-invariant
    mode (a wider method's first call: hybrid's, PEARL's) keeps it, so an engine that never ran warmup()
    files where one that did reads (it kept its first call's key, and hybrid's widening made another
    for the step costs: timed again); other kernels make another key, filed and read apart."""
    import copy

    from specengine import Engine

    fresh_cache(monkeypatch, tmp_path)
    eng = Engine(copy.deepcopy(tiny_pair[0]), tokenizer, draft=copy.deepcopy(tiny_pair[2]), max_seq_len=96,
                 batch_invariant=True, invariant_width=4)
    inv = eng.target.invariance
    inv.apply(inv.candidates()[0])  # unpadded, as the CPUs' kernels pass (this tiny model's plan pads)
    key = eng._clocks.key
    inv.width = 12  # widened, as hybrid's first call does
    assert key is not None and eng._clocks.key == key
    inv.apply(inv.candidates()[-1])  # padded to the width: every forward's cost moves
    assert eng._clocks.key not in (None, key)
    inv.apply(inv.candidates()[0])
    eng._clocks.file({"greedy": 0.8})
    eng.set_kernels("torch")
    assert eng._clocks.key not in (None, key) and "greedy" not in eng._clocks.filed
    eng._clocks.file({"greedy": 0.6})
    again = Engine(copy.deepcopy(tiny_pair[0]), tokenizer, draft=copy.deepcopy(tiny_pair[2]), max_seq_len=96,
                   batch_invariant=True, invariant_width=4)
    again.target.invariance.width = 12
    again.target.invariance.apply(again.target.invariance.candidates()[0])
    assert again._clocks.key == key and again._clocks.filed["greedy"] == 0.8


def test_the_greedy_acceptance_is_filed_and_seeds_measured_costs_only(tiny_pair, tokenizer, monkeypatch, tmp_path):
    """The draft's greedy acceptance a call learned is filed beside the corrections (moved by more
    than ALPHA_MOVED): a second engine's first γ auto call starts from it (hybrid need not pay the
    draft's prefill to learn it), unless its step costs are pinned (then the prior: choices that
    depend on no earlier process); a sampled call never starts from it."""
    import copy

    from specengine import Engine
    from specengine.methods.policies import AutoGammaPolicy

    fresh_cache(monkeypatch, tmp_path)
    engine = lambda: Engine(copy.deepcopy(tiny_pair[0]), tokenizer, draft=copy.deepcopy(tiny_pair[2]),  # noqa: E731
                            max_seq_len=96)
    first = engine()
    with first._clocks.paused():  # the α this call learns (its rounds follow measured costs) is not filed
        first.generate([5, 9, 2], max_new_tokens=4, ignore_eos=True, method="sd", gamma="auto")
    first._acceptance["greedy"] = 0.83
    first._clocks.file(first._acceptance)
    assert engine()._clocks.filed["greedy"] == 0.83
    first._clocks.file({**first._acceptance, "greedy": 0.85})  # within ALPHA_MOVED: nothing written
    assert engine()._clocks.filed["greedy"] == 0.83

    starts = []
    real_set_costs = AutoGammaPolicy.set_costs
    monkeypatch.setattr(AutoGammaPolicy, "set_costs",
                        lambda self, c: real_set_costs(self, c) or starts.append((self.alpha, self.learned)))
    second = engine()
    second.generate([7, 1], max_new_tokens=4, ignore_eos=True, method="sd", gamma="auto")
    prior = AutoGammaPolicy().alpha
    assert starts[-1] == (pytest.approx(0.83), True)
    third = engine()
    third.generate([7, 1], max_new_tokens=4, ignore_eos=True, method="sd", gamma="auto", temperature=0.8, seed=1)
    assert starts[-1] == (pytest.approx(prior), False)  # sampled: the prior
    third.step_costs = lambda state, width, draft=True: StepCosts(state.batch, 0.05, (1.0,) * width)
    third._acceptance.clear()
    third.generate([7, 1], max_new_tokens=4, ignore_eos=True, method="hybrid", gamma="auto")
    assert starts[-1] == (pytest.approx(prior), False)  # pinned costs: the prior


def test_the_ngram_curves_are_filed_and_a_new_engine_starts_from_them(tiny_pair, tokenizer, monkeypatch, tmp_path):
    """The n-gram methods' greedy acceptance curves by match length are filed beside the draft's
    acceptance (once CURVES_MOVED tries changed them): a new engine's first greedy γ auto call
    continues them instead of exploring at the priors again, unless its costs are pinned; a
    sampled call never reads them."""
    import copy

    from specengine import Engine
    from specengine.methods.ngram_policy import NgramGammaPolicy
    from specengine.runtime import step_costs as sc

    fresh_cache(monkeypatch, tmp_path)
    engine = lambda: Engine(copy.deepcopy(tiny_pair[0]), tokenizer, max_seq_len=96)  # noqa: E731
    key = "ngram:greedy:by_match"
    first = engine()
    text = [5, 9, 2, 7, 5, 9, 2, 7, 5, 9, 2, 7, 5, 9]
    with first._clocks.paused():
        first.generate(text, max_new_tokens=16, ignore_eos=True, method="ngram", gamma="auto")
    seen, kept = first._acceptance[key]
    seen[0][1], kept[0][1] = seen[0][1] + 40.0, kept[0][1] + 4.0  # as forty rejected tries leave them
    first._clocks.file(first._acceptance)
    filed = engine()._clocks.filed[key]
    assert filed[0][0][1] == seen[0][1] and filed[1][0][1] == kept[0][1]
    seen[0][2] += sc.CURVES_MOVED - 1  # fewer tries than CURVES_MOVED apart: nothing written
    first._clocks.file(first._acceptance)
    assert engine()._clocks.filed[key][0][0][2] == filed[0][0][2]

    starts, real = [], NgramGammaPolicy.recall
    monkeypatch.setattr(NgramGammaPolicy, "recall",
                        lambda self, store, k, f=None: real(self, store, k, f) or starts.append(self.seen[0][1]))
    second = engine()
    second.generate([3, 4, 3, 4, 3], max_new_tokens=4, ignore_eos=True, method="ngram", gamma="auto")
    assert starts == [filed[0][0][1]]  # the first call continued the filed curves
    pinned = engine()
    pinned.step_costs = lambda state, width, draft=True: StepCosts(state.batch, 0.0, (1.0,) * width)
    pinned.generate([3, 4, 3, 4, 3], max_new_tokens=4, ignore_eos=True, method="ngram", gamma="auto")
    assert starts[-1] == 0.0  # pinned costs: the priors
    engine().generate([3, 4, 3, 4, 3], max_new_tokens=4, method="ngram", gamma="auto", temperature=0.8, seed=1)
    assert len(starts) == 2  # sampled: no recall at all


def test_pearls_greedy_state_is_filed_and_a_new_engines_first_call_starts_from_it(tiny_pair, tokenizer, monkeypatch,
                                                                                   tmp_path):
    """PEARL's greedy state (acceptance, yield, probe wait) is filed beside the draft's acceptance when
    its acceptance moved by ALPHA_MOVED or its wait changed (the plain rounds under way are not: a new
    process starts none): a second engine's first greedy PEARL call starts from it instead of the prior
    and a wait of 16; this engine's own last call comes first; a sampled call reads none. (Its draft reads
    the prompt up front: a 4-token reply never pays for the deferred read, and plain rounds would then
    not ask the choice this test watches.)"""
    import copy

    from specengine import Engine
    from specengine.methods.pearl import Pearl

    fresh_cache(monkeypatch, tmp_path)
    monkeypatch.setattr(Pearl, "defers_draft_prefill", False)
    engine = lambda: Engine(copy.deepcopy(tiny_pair[0]), tokenizer, draft=copy.deepcopy(tiny_pair[2]),  # noqa: E731
                            max_seq_len=96)
    key = "pearl:greedy:learned"
    first = engine()
    with first._clocks.paused():
        first.generate([5, 9, 2], max_new_tokens=4, ignore_eos=True, method="pearl")
    assert key in first._acceptance  # what the call left for the next
    state = {"alpha": 0.62, "scale": 1.1, "every": 64, "run": 7}
    first._acceptance[key] = dict(state)
    first._clocks.file(first._acceptance)
    assert engine()._clocks.filed[key] == {**state, "run": 0}
    first._clocks.file({**first._acceptance, key: {**state, "alpha": 0.65, "run": 9}})  # within ALPHA_MOVED
    assert engine()._clocks.filed[key]["alpha"] == 0.62
    first._clocks.file({**first._acceptance, key: {**state, "every": 128}})  # the wait doubled: filed
    assert engine()._clocks.filed[key]["every"] == 128

    recalled, real = [], Pearl._recall
    monkeypatch.setattr(Pearl, "_recall", lambda self, learned: recalled.append(learned) or real(self, learned))
    waits = []
    real_choice = Pearl._choice
    monkeypatch.setattr(Pearl, "_choice", lambda self: waits.append(self.wait.every) or real_choice(self))
    second = engine()
    with second._clocks.paused():
        second.generate([7, 1], max_new_tokens=4, ignore_eos=True, method="pearl")
    assert recalled[-1] == {**state, "every": 128, "run": 0} and waits[0] == 128
    own = second._acceptance[key]
    with second._clocks.paused():
        second.generate([7, 1], max_new_tokens=4, ignore_eos=True, method="pearl")
    assert recalled[-1] is own  # its own last call's, not the filed
    n = len(recalled)
    engine().generate([7, 1], max_new_tokens=4, method="pearl", temperature=0.8, seed=1)
    assert len(recalled) == n  # sampled: no recall


def test_warmup_files_nothing(tiny_pair, tokenizer, monkeypatch, tmp_path):
    """warmup's calls decode a junk prompt: what they accept is no pair's rate, so the machine's
    table is left as it was (a first request seeded from it started with plain rounds)."""
    import copy

    from specengine import Engine, machine

    fresh_cache(monkeypatch, tmp_path)
    eng = Engine(copy.deepcopy(tiny_pair[0]), tokenizer, draft=copy.deepcopy(tiny_pair[2]), max_seq_len=96)
    eng.warmup()
    assert eng._clocks.key is not None and eng._clocks.key not in machine.load()
    eng.generate([5, 9, 2], max_new_tokens=8, ignore_eos=True, method="sd", gamma="auto")
    assert "greedy" in machine.load()[eng._clocks.key]  # a request's is filed


def test_best_seconds_times_back_to_back_calls_per_call():
    """back_to_back=k: each time is k calls between two syncs, divided by k (a GPU step's cost
    inside a round, where forwards queue behind one another; step_costs.BACK_TO_BACK)."""
    import time

    from specengine.timing import best_seconds

    calls = []

    def fn():
        calls.append(1)
        time.sleep(0.01)

    per_call = best_seconds(fn, 2, back_to_back=3)
    assert len(calls) == 6
    assert 0.009 < per_call < 0.02  # one call's time, not three calls'
