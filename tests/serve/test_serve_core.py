"""The request-level core (continuous batching) and AsyncEngine, on tiny models."""
import asyncio

import pytest
import torch

from specengine import Engine
from specengine.errors import SpecEngineError
from specengine.serve import AsyncEngine, EngineCore, Overloaded, RequestParams

PROMPTS = ["def add(a, b):\n", "x = [1", "for i in range(3", "import os", "class A:", "while x:"]


@pytest.fixture()
def engines(tiny_pair, tokenizer):
    """(engine served by the core, a second engine for standalone references): same models,
    a draft that disagrees with the target (rollbacks), fp32."""
    target, _, draft = tiny_pair
    return (Engine(target, tokenizer, draft, max_seq_len=256, max_batch=2),
            Engine(target, tokenizer, draft, max_seq_len=256))


def drain(core):
    done, admitted_while_running = {}, False
    while core.has_unfinished():
        before = set(core.running)
        outs = core.step()
        if before and set(core.running) - before:
            admitted_while_running = True  # a waiting request took a freed row mid-flight
        for o in outs:
            if o.finished:
                done[o.request_id] = o
    return done, admitted_while_running


@pytest.mark.parametrize("sampling", [{}, dict(temperature=0.9, top_k=20)])
@pytest.mark.parametrize("method", ["ar", "sd", "pearl"])
def test_continuous_batching_gives_each_request_its_standalone_tokens(engines, method, sampling):
    """Greedy and sampled (each request its own seed): every request gets the tokens of
    `Engine.generate` on its own prompt with its own seed, whichever row it was admitted to
    and however late."""
    eng, ref_eng = engines
    core = EngineCore(eng, max_batch=2, method=method, gamma=3)
    lens = [5, 17, 9, 12, 3, 8]  # rows finish at different rounds, so rows are reused mid-flight
    seeds = [11, 12, 13, 14, 15, 16]
    ids = [core.add_request(p, RequestParams(max_new_tokens=n, ignore_eos=True, seed=s, **sampling))
           for p, n, s in zip(PROMPTS, lens, seeds)]
    done, reused = drain(core)
    assert reused and core.free_slots == 2 and not core.running and not core.waiting
    for rid, p, n, s in zip(ids, PROMPTS, lens, seeds):
        ref = ref_eng.generate(p, max_new_tokens=n, method=method, gamma=3, ignore_eos=True, seed=s, **sampling)
        assert done[rid].token_ids == ref.token_ids and done[rid].finish_reason == "length"
        assert done[rid].text == ref.text
    if sampling:  # the check can fail: another seed gives other tokens
        other = ref_eng.generate(PROMPTS[1], max_new_tokens=17, method=method, gamma=3, ignore_eos=True, seed=99,
                                 **sampling)
        assert other.token_ids != done[ids[1]].token_ids


def test_stop_strings_eos_and_limits_are_per_request(engines):
    eng, ref_eng = engines
    core = EngineCore(eng, max_batch=2, method="sd", gamma=2)
    full = ref_eng.generate(PROMPTS[0], max_new_tokens=20, ignore_eos=True).text
    stop = full[5:7]
    a = core.add_request(PROMPTS[0], RequestParams(max_new_tokens=20, stop=stop, ignore_eos=True))
    b = core.add_request(PROMPTS[1], RequestParams(max_new_tokens=7, ignore_eos=True))
    c = core.add_request(PROMPTS[2], RequestParams(max_new_tokens=30))  # eos honoured
    done, _ = drain(core)
    ref_a = ref_eng.generate(PROMPTS[0], max_new_tokens=20, stop=stop, ignore_eos=True)
    assert done[a].finish_reason == "stop" and done[a].text == ref_a.text and stop not in done[a].text
    assert len(done[b].token_ids) == 7
    ref_c = ref_eng.generate(PROMPTS[2], max_new_tokens=30)
    assert done[c].token_ids == ref_c.token_ids and done[c].finish_reason == ref_c.finish_reason


def test_streamed_deltas_add_up_and_hold_back_partial_stops(engines):
    eng, ref_eng = engines
    core = EngineCore(eng, max_batch=2)
    full = ref_eng.generate(PROMPTS[3], max_new_tokens=16, ignore_eos=True).text
    rid = core.add_request(PROMPTS[3], RequestParams(max_new_tokens=16, stop=full[8:11], ignore_eos=True))
    pieces, final = [], None
    while core.has_unfinished():
        for o in core.step():
            pieces.append(o.text_delta)
            final = o
    assert "".join(pieces) == final.text == full[:8]


def test_abort_frees_the_row_for_a_waiting_request(engines):
    eng, _ = engines
    core = EngineCore(eng, max_batch=2, method="sd", gamma=2)
    ids = [core.add_request(p, RequestParams(max_new_tokens=40, ignore_eos=True)) for p in PROMPTS[:3]]
    core.step()
    assert set(core.running) == set(ids[:2]) and [r.rid for r in core.waiting] == [ids[2]]
    assert core.abort(ids[0]) and not core.abort("nope")
    outs = core.step()
    aborted = [o for o in outs if o.request_id == ids[0]]
    assert aborted and aborted[0].finished and aborted[0].finish_reason == "abort"
    assert ids[2] in core.running and ids[0] not in core.running  # the freed row was reused
    core.abort(ids[1]), core.abort(ids[2])
    core.step()
    assert not core.has_unfinished() and core.free_slots == 2


def test_aborting_a_waiting_request_drops_it_before_it_runs(engines):
    eng, ref_eng = engines
    core = EngineCore(eng, max_batch=2, method="sd", gamma=2)
    ids = [core.add_request(p, RequestParams(max_new_tokens=6, ignore_eos=True)) for p in PROMPTS[:4]]
    core.step()
    assert [r.rid for r in core.waiting] == ids[2:]
    assert core.abort(ids[2])
    outs = core.step()
    dropped = [o for o in outs if o.request_id == ids[2]]
    assert dropped and dropped[0].finish_reason == "abort" and dropped[0].token_ids == []
    done, _ = drain(core)
    done.update({o.request_id: o for o in outs if o.finished and o.request_id != ids[2]})
    assert ids[2] not in done and set(done) == {ids[0], ids[1], ids[3]}
    for rid, p in ((ids[0], PROMPTS[0]), (ids[1], PROMPTS[1]), (ids[3], PROMPTS[3])):
        assert done[rid].token_ids == ref_eng.generate(p, max_new_tokens=6, method="sd", gamma=2,
                                                       ignore_eos=True).token_ids
    assert not core.has_unfinished() and core.free_slots == 2


def test_bounded_queue_and_bad_requests(engines):
    eng, _ = engines
    core = EngineCore(eng, max_batch=1, max_waiting=1)
    core.add_request("a", RequestParams(max_new_tokens=2))
    with pytest.raises(Overloaded, match="overloaded"):
        core.add_request("b", RequestParams(max_new_tokens=2))
    core = EngineCore(eng, max_batch=1)
    with pytest.raises(SpecEngineError, match="empty"):
        core.add_request("")
    with pytest.raises(SpecEngineError, match="max_seq_len"):
        core.add_request("x" * 300)
    with pytest.raises(SpecEngineError, match="temperature"):
        core.add_request("x", RequestParams(temperature=-1))
    with pytest.raises(SpecEngineError, match="max_new_tokens"):
        core.add_request("x", RequestParams(max_new_tokens=0))
    with pytest.raises(SpecEngineError, match="top_p"):
        core.add_request("x", RequestParams(top_p=0))
    with pytest.raises(SpecEngineError, match="raw log-probabilities only"):  # refused, never silently dropped
        core.add_request("x", RequestParams(logprobs=2, logprobs_mode="processed"))
    with pytest.raises(SpecEngineError, match="unknown method"):
        EngineCore(eng, method="nope")
    assert not core.has_unfinished()


def test_sampling_classes_take_turns_and_greedy_stays_exact(engines):
    eng, ref_eng = engines
    core = EngineCore(eng, max_batch=2, method="sd", gamma=2)
    g1 = core.add_request(PROMPTS[0], RequestParams(max_new_tokens=10, ignore_eos=True))
    s1 = core.add_request(PROMPTS[1], RequestParams(max_new_tokens=10, temperature=0.9, seed=3, ignore_eos=True))
    g2 = core.add_request(PROMPTS[2], RequestParams(max_new_tokens=10, ignore_eos=True))
    core.step()
    assert set(core.running) == {g1}  # s1 waits for the greedy rows; g2 waits behind it (FIFO)
    done, _ = drain(core)
    for rid, p in ((g1, PROMPTS[0]), (g2, PROMPTS[2])):
        assert done[rid].token_ids == ref_eng.generate(p, max_new_tokens=10, ignore_eos=True).token_ids
    assert len(done[s1].token_ids) == 10


def test_async_engine_concurrent_callers_and_early_exit(engines):
    eng, ref_eng = engines
    aeng = AsyncEngine(eng, max_batch=2, method="sd", gamma=3)
    try:
        async def main():
            outs = await asyncio.gather(*(aeng.generate(p, RequestParams(max_new_tokens=9, ignore_eos=True))
                                          for p in PROMPTS))
            stream = aeng.stream(PROMPTS[0], RequestParams(max_new_tokens=220, ignore_eos=True))
            async for _ in stream:
                break  # leaving early aborts the request
            await stream.aclose()
            for _ in range(100):
                if not aeng.core.has_unfinished() and aeng.metrics["aborted"] == 1:
                    break
                await asyncio.sleep(0.02)
            return outs
        outs = asyncio.run(main())
        for o, p in zip(outs, PROMPTS):
            assert o.token_ids == ref_eng.generate(p, max_new_tokens=9, ignore_eos=True).token_ids
        assert not aeng.core.has_unfinished() and aeng.core.free_slots == 2 and aeng.metrics["aborted"] == 1
        assert not aeng._queues
    finally:
        aeng.shutdown()


def test_core_never_leaves_a_row_active_on_the_device(engines):
    """Freed rows are frozen (active False): they never grow in the cache."""
    eng, _ = engines
    core = EngineCore(eng, max_batch=2, method="sd", gamma=2)
    core.add_request(PROMPTS[0], RequestParams(max_new_tokens=3, ignore_eos=True))
    drain(core)
    assert not bool(core.gen.state.active.any())
    n = core.gen.state.n.clone()
    rid = core.add_request(PROMPTS[1], RequestParams(max_new_tokens=4, ignore_eos=True))
    core.step()
    idle = 1 - core.running[rid].slot
    drain(core)
    assert torch.equal(core.gen.state.n[idle], n[idle])  # the idle row did not move


def test_rounds_run_on_the_occupied_rows_only(engines):
    """Free rows past the last running one sit rounds out (no compute for empty slots)."""
    eng, _ = engines
    core = EngineCore(eng, max_batch=2, method="sd", gamma=2)
    widths = []
    verify = eng.target.verify
    eng.target.verify = lambda tokens, **kw: (widths.append(tokens.shape[0]), verify(tokens, **kw))[1]
    try:
        core.add_request(PROMPTS[0], RequestParams(max_new_tokens=6, ignore_eos=True))
        drain(core)
    finally:
        del eng.target.verify
    assert widths and set(widths) == {1}


@pytest.mark.parametrize("method", ["sd", "pearl"])
def test_rows_admitted_mid_flight_are_read_by_the_draft_at_their_own_positions(tiny_pair, tokenizer, method,
                                                                               monkeypatch):
    """γ auto defers the draft's read of each request's prompt to its row's first drafted round, row by row as
    requests come and go (`prefill_row`). With the target's weights as the draft, every proposal made after such
    a read is the target's own token: a row read at another row's length or positions loses acceptance, never
    tokens."""
    from specengine.runtime.step_costs import StepCosts

    target, same, _ = tiny_pair
    eng, ref_eng = Engine(target, tokenizer, same, max_seq_len=256, max_batch=2), Engine(target, tokenizer, same)
    flat = StepCosts(1, draft_s=0.05, target_s=(1.0,) * 18)  # drafting wins
    monkeypatch.setattr(eng, "step_costs", lambda state, width, **kw: flat)
    core = EngineCore(eng, max_batch=2, method=method, gamma="auto")
    lens = [3, 40, 9, 30, 5, 12]  # rows finish at different rounds: later requests take freed rows
    ids = [core.add_request(p, RequestParams(max_new_tokens=n, ignore_eos=True)) for p, n in zip(PROMPTS, lens)]
    done, reused = drain(core)
    assert reused
    for rid, p, n in zip(ids, PROMPTS, lens):
        assert done[rid].token_ids == ref_eng.generate(p, max_new_tokens=n, method="ar", ignore_eos=True).token_ids
    c = core.gen.counters
    assert core.gen.method.primes >= len(PROMPTS) - 2 and c.proposed > len(PROMPTS)  # read in rounds, row by row
    assert c.accepted == c.proposed


def test_a_stale_low_rate_gives_way_within_the_cores_long_call(tiny_pair, tokenizer, monkeypatch):
    """The core's Generation lasts while requests of one sampling class keep coming, so a low rate the engine
    learned earlier (prose) must give way within it: after STALE_FIRST rounds without a chain the rate is the
    prior's, the next request's prompt is read and chains run (methods/probe_wait.py). Before, every request
    decoded plainly for the core's life: an unread draft never probes."""
    from specengine.methods.policies import best_gamma
    from specengine.methods.probe_wait import STALE_FIRST
    from specengine.runtime.step_costs import StepCosts

    target, _, draft = tiny_pair
    eng, ref_eng = Engine(target, tokenizer, draft, max_seq_len=256, max_batch=2), Engine(target, tokenizer, draft)
    costs = StepCosts(1, draft_s=0.3, target_s=(1.0, 1.25, 1.45) + tuple(1.45 + 0.2 * w for w in range(1, 16)),
                      draft_prefill_s=0.01)
    assert best_gamma(0.3, costs, 8, gamma_min=0) == 0 and best_gamma(0.7, costs, 8, gamma_min=0) >= 1
    monkeypatch.setattr(eng, "step_costs", lambda state, width, **kw: costs)
    eng._acceptance.update({"greedy": 0.3, "greedy:pair": (3.0, 7.0)})  # learned on text where chains lost
    core = EngineCore(eng, max_batch=2, method="sd", gamma="auto")
    rounds = []
    for wave in range(2):  # just short of STALE_FIRST rounds, then as many more
        ids = [core.add_request(p, RequestParams(max_new_tokens=40, ignore_eos=True)) for p in PROMPTS]
        done, _ = drain(core)
        for rid, p in zip(ids, PROMPTS):
            assert done[rid].token_ids == ref_eng.generate(p, max_new_tokens=40, method="ar", ignore_eos=True).token_ids
        c = core.gen.counters
        rounds.append((c.rounds, c.proposed, core.gen.method.primes))
    (rounds_1, proposed_1, read_1), (_, proposed_2, read_2) = rounds
    assert STALE_FIRST - 10 <= rounds_1 < STALE_FIRST and proposed_1 == read_1 == 0  # the low rate held the draft out
    assert proposed_2 > 0 and read_2 > 0  # then chains again, and the prompts read for them
