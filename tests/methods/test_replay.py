"""Acceptance replay (specengine/replay): a run on OTHER random weights, replaying a trace of a
pair, makes the pair's rounds: per round the same proposals, acceptances and draft forwards,
and the pair's tokens, for every method. The reference is the pair's own run (real models,
real verification), never the replay; step costs are pinned so cost-driven choices agree."""
import pytest
import torch
from conftest import save_tiny
from helpers.fakes import random_drafter, random_head

from specengine import Engine, SpecEngineError
from specengine.models.loading import load_model
from specengine.replay import Replay, TraceSet
from specengine.replay.record import record
from specengine.runtime.step_costs import StepCosts

PROMPTS = ["def add(a, b):\n", "x = [1, 2"]
NEW = 30
TREES = {"sd": "2x3:5", "parallelspec": "2x3:4"}
CASES = {
    "sd:3": dict(method="sd", gamma=3),
    "sd:auto": dict(method="sd", gamma="auto"),
    "sd@confidence": dict(method="sd", policy="confidence", threshold=0.3),
    "sd@specdec++": dict(method="sd", policy="specdec++", gamma=6, threshold=0.5),
    "sd[tree]": dict(method="sd", tree=TREES["sd"]),
    "parallelspec:3": dict(method="parallelspec", gamma=3),
    "parallelspec[tree]": dict(method="parallelspec", tree=TREES["parallelspec"]),
    "pearl": dict(method="pearl"),
    "pearl@parallel": dict(method="pearl", policy="parallel", gamma=3),
    "ngram": dict(method="ngram"),
    "hybrid": dict(method="hybrid"),
}


def pinned(state, width, draft=True):
    """Costs that make γ auto, PEARL (window 3) and the hybrid decide, identically in both runs."""
    return StepCosts(state.batch, 0.3, tuple(1.0 + 0.15 * w for w in range(width)))


def engine_over(target, draft, tokenizer, seed):
    eng = Engine(target, tokenizer, draft=draft, max_seq_len=160, cpu_matmul="linear")
    eng._heads["greedy"] = random_head(draft, seed=seed, bias=2.0)  # P(accept) ~ 0.9: K varies
    eng._drafter = random_drafter(draft, k_max=4, seed=seed)
    eng.step_costs = pinned
    return eng


def scrambled(path, seed):
    """A model of the same shapes with other random weights."""
    model = load_model(path)[0]
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


@pytest.fixture(scope="module")
def pair_runs(tiny_pair, tokenizer):
    """The pair's trace and its own per-round logs and tokens for every case and prompt."""
    eng = engine_over(tiny_pair[0], tiny_pair[2], tokenizer, seed=0)
    prompts = [(f"p{i}", eng.encode(p)[0][0]) for i, p in enumerate(PROMPTS)]
    traces = record(eng, prompts, NEW, depth=8, trees=TREES, show=False)
    runs = {}
    for name, kw in CASES.items():
        eng._acceptance.clear()  # each case starts from the prior: so does its replay
        runs[name] = [eng.generate(ids, max_new_tokens=NEW, ignore_eos=True, **kw) for _, ids in prompts]
    return traces, runs


@pytest.fixture(scope="module")
def replayed(pair_runs, tiny_dir, tokenizer, tmp_path_factory):
    traces, _ = pair_runs
    path = traces.save(tmp_path_factory.mktemp("trace") / "trace.safetensors")
    loaded = TraceSet.load(path)  # what a GPU run reads
    eng = engine_over(scrambled(tiny_dir, 7), scrambled(tiny_dir, 8), tokenizer, seed=3)
    replay = Replay(loaded, vocab=eng.target.config.vocab_size, device="cpu")
    replay.attach(eng)
    return eng, replay


@pytest.mark.parametrize("name", list(CASES))
def test_a_replay_makes_the_pairs_rounds(name, pair_runs, replayed):
    traces, runs = pair_runs
    eng, replay = replayed
    eng._acceptance.clear()
    for i, real in enumerate(runs[name]):
        r = replay.generate(eng, i, **CASES[name])
        assert real.token_ids == traces.traces[i].target_tokens  # the trace is the pair's ar
        assert r.token_ids == real.token_ids
        assert r.stats["round_log"] == real.stats["round_log"]


def test_the_pair_accepts_some_and_rejects_some(pair_runs):
    """The replay test means something only if rounds both accept and reject."""
    _, runs = pair_runs
    log = [entry for r in runs["sd:3"] for entry in r.stats["round_log"]]
    assert any(acc == prop for prop, acc, _ in log) and any(acc < prop for prop, acc, _ in log)
    assert any(0 < acc < prop for prop, acc, _ in log)


def test_without_a_replay_the_scrambled_engine_accepts_nothing_like_the_pair(pair_runs, replayed):
    """Control: the same engine with the replay detached decides on its own random weights."""
    traces, runs = pair_runs
    eng, replay = replayed
    replay.detach(eng)
    try:
        r = eng.generate(traces.traces[0].prompt, max_new_tokens=NEW, ignore_eos=True, **CASES["sd:3"])
        assert r.token_ids != runs["sd:3"][0].token_ids
    finally:
        replay.attach(eng)


def test_a_tree_shape_the_trace_lacks_is_a_clear_error(replayed):
    eng, replay = replayed
    with pytest.raises(SpecEngineError, match="trees of shape"):
        replay.generate(eng, 0, method="sd", tree="2x2")


def test_replay_is_greedy_only(replayed):
    eng, replay = replayed
    with pytest.raises(SpecEngineError, match="greedy"):
        replay.generate(eng, 0, method="sd", policy="specdec++", temperature=1.0)


def test_a_missing_or_foreign_trace_file_is_named(tmp_path):
    with pytest.raises(SpecEngineError, match="no acceptance trace"):
        TraceSet.load(tmp_path / "none.safetensors")
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a trace")
    with pytest.raises(SpecEngineError, match="not an acceptance trace"):
        TraceSet.load(bad)


@pytest.mark.parametrize("name", ["sd:3", "sd:auto", "pearl", "hybrid"])
def test_a_replay_under_graphs_makes_the_pairs_rounds(name, pair_runs, tiny_dir, tokenizer, tmp_path):
    """With graphs on (a stand-in capture that freezes what a CUDA graph freezes, runtime tests),
    the replay's chain plan runs as one graphed call per round (a GPU's launches: the benchmark's
    own work) and the rounds are still the pair's."""
    from runtime.test_graphs import fake_capture

    traces, runs = pair_runs
    eng = engine_over(scrambled(tiny_dir, 7), scrambled(tiny_dir, 8), tokenizer, seed=3)
    eng.set_cuda_graphs(True, capture=fake_capture)
    replay = Replay(TraceSet.load(traces.save(tmp_path / "trace.safetensors")), vocab=eng.target.config.vocab_size,
                    device="cpu")
    replay.attach(eng)
    for i, real in enumerate(runs[name]):
        r = replay.generate(eng, i, **CASES[name])
        assert r.token_ids == real.token_ids and r.stats["round_log"] == real.stats["round_log"]
    if name == "sd:3":  # every round drafts a chain: its plan came from a graphed call
        assert any(key[0] == "replay chain" for key in eng.target._calls.entries)
