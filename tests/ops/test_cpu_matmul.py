"""CPU matmul paths chosen by measurement: every path computes F.linear, the choice follows
the timings, the table is cached per machine, packed weights round-trip, tokens unchanged."""
import json
import os
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specengine import Engine, machine
from specengine.models import cpu_matmul
from specengine.models.cpu_matmul import PATHS, Plan, plan_from_entry, storage_available
from specengine.models.loading import load_model
from specengine.runtime.runner import ModelRunner
from helpers.cache import fresh_cache


@pytest.fixture
def cache(tmp_path, monkeypatch):
    fresh_cache(monkeypatch, tmp_path)
    return tmp_path


def _weights(name, w):
    storage = PATHS[name][0]
    return cpu_matmul._pack_mkldnn(w) if storage == "mkldnn" else w


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 5e-2)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17, 70])
@pytest.mark.parametrize("out_f,in_f", [(7, 33), (96, 64), (130, 257)])
def test_every_path_computes_linear(dtype, tol, rows, out_f, in_f):
    g = torch.Generator().manual_seed(rows * out_f)
    w = torch.randn(out_f, in_f, generator=g).to(dtype)
    x = torch.randn(rows, in_f, generator=g).to(dtype)
    ref = F.linear(x.float(), w.float())
    for name, (storage, fn) in PATHS.items():
        if not storage_available(storage, dtype):
            continue
        y = fn(x, _weights(name, w))
        assert y.shape == (rows, out_f) and y.dtype == dtype, name
        torch.testing.assert_close(y.float(), ref, atol=tol * in_f ** 0.5, rtol=tol, msg=name)


def test_plan_follows_timings():
    entry = {"storage": "plain", "ms": {
        "1": {"linear": 3.0, "wxt": 2.0, "wxt_pad": 1.0, "mkldnn": 0.1},
        "2": {"linear": 1.0, "wxt": 2.0, "mkldnn": 0.1},
        "4": {"linear": 5.0, "wxt": 2.0, "mkldnn": 0.1}}}
    plan = plan_from_entry(entry)
    # mkldnn is faster but not this group's storage; row 3 was not tuned: the next tuned (4)
    assert plan.by_rows == ("linear", "wxt_pad", "linear", "wxt", "wxt")
    entry["storage"] = "mkldnn"
    assert set(plan_from_entry(entry).by_rows) == {"mkldnn"}


def test_a_prompt_takes_the_path_that_won_at_the_prefill_width():
    """Past the largest tuned verify width a forward takes the PREFILL_ROWS winner where that width was
    timed (bf16: F.linear or our `rows`), else the storage's large path, as before."""
    P = cpu_matmul.PREFILL_ROWS
    entry = {"storage": "plain", "ms": {"1": {"linear": 3.0, "rows": 1.0}, "16": {"linear": 3.0, "rows": 1.0}}}
    plan = plan_from_entry(entry)
    assert plan.by_rows[0] == "linear" and len(plan.by_rows) == 17
    entry["ms"][str(P)] = {"linear": 5.0, "rows": 2.0}
    plan = plan_from_entry(entry)
    assert plan.by_rows[0] == "rows" and set(plan.by_rows[17:]) == {"rows"} and len(plan.by_rows) == P + 1
    if "rows" in PATHS:  # the extension built (CI builds it)
        assert plan.fns()[1] is PATHS["rows"][1]
    entry["ms"][str(P)] = {"linear": 1.0, "rows": 2.0}
    assert plan_from_entry(entry).by_rows[0] == "linear"


def test_the_prefill_width_is_timed_where_rows_applies_and_only_against_the_large_paths(tiny_dir, cache, monkeypatch):
    """bf16 (our `rows` kernel's dtype) times PREFILL_ROWS, on the large-input paths and `rows` only;
    fp32 never times it (its large path stays F.linear, untimed)."""
    P = cpu_matmul.PREFILL_ROWS
    timed = []
    real = cpu_matmul._time_pass
    monkeypatch.setattr(cpu_matmul, "_time_pass", lambda fn, x, *a, **k: timed.append((x.shape[0], fn)) or real(fn, x, *a, **k))
    for dtype in (torch.float32, torch.bfloat16):
        timed.clear()
        entries = cpu_matmul.tune(load_model(tiny_dir, dtype=dtype)[0], progress=False)
        wide = {fn for r, fn in timed if r == P}
        if dtype == torch.bfloat16 and "rows" in PATHS:
            assert wide <= {PATHS[p][1] for p in cpu_matmul.PREFILL_PATHS if p in PATHS}
            assert {PATHS["rows"][1], PATHS["linear"][1]} <= wide
            assert all(str(P) in e["ms"] for e in entries.values())
        else:
            assert not wide and all(str(P) not in e["ms"] for e in entries.values())


def test_storage_is_the_least_total_time():
    ms = {"1": {"linear": 3.0, "mkldnn": 2.0}, "4": {"linear": 1.0, "wxt": 0.5, "mkldnn": 2.0}}
    assert cpu_matmul._choose_storage(ms, ["plain", "mkldnn"]) == "plain"  # 3.5 < 4.0
    ms["4"]["mkldnn"] = 1.0
    assert cpu_matmul._choose_storage(ms, ["plain", "mkldnn"]) == "mkldnn"  # 3.0 < 3.5
    assert cpu_matmul._choose_storage(ms, ["plain"]) == "plain"


def test_table_is_cached_per_machine(tiny_dir, cache, monkeypatch):
    model = load_model(tiny_dir)[0]
    calls = []
    real = cpu_matmul.measure_group
    monkeypatch.setattr(cpu_matmul, "measure_group", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    entries = cpu_matmul.tune(model, progress=False)
    assert calls and all(rows == list(cpu_matmul.ROWS_TUNED) for rows in calls)
    path = machine.cache_path()
    assert path.parent == cache / "plan" and path.exists()
    saved = json.loads(path.read_text())
    assert saved["machine"]["threads"] == torch.get_num_threads() and saved["machine"]["torch"] == torch.__version__
    assert set(entries) == set(cpu_matmul.shape_groups(model)) <= set(saved["entries"])
    calls.clear()
    assert cpu_matmul.tune(model, progress=False) == entries and not calls  # second time: no measuring
    # another machine (here: another thread count) gets its own table, and so do other kernels
    key = machine.key()
    with monkeypatch.context() as m:
        m.setattr(machine, "kernel_digest", lambda: "0123456789ab")
        assert machine.key() != key and machine.cache_path().parent == path.parent
    monkeypatch.setattr(torch, "get_num_threads", lambda: 977)
    assert machine.key() != key


def test_an_entry_timed_over_other_paths_is_timed_again(tiny_dir, cache, monkeypatch):
    """The table's key holds the kernels' digest; a change of the Python path list (a path
    added) is caught per entry: its timings are taken again, never read stale."""
    model = load_model(tiny_dir)[0]
    entries = cpu_matmul.tune(model, rows=(1,), progress=False)
    table = machine.load()
    for key in entries:
        table[key]["paths"] = table[key]["paths"][:-1]  # as if timed before the last path existed
    machine.save(table)
    calls = []
    real = cpu_matmul.measure_group
    monkeypatch.setattr(cpu_matmul, "measure_group", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    cpu_matmul.tune(model, rows=(1,), progress=False)
    assert len(calls) == len(entries)


def _logits(model, tokens):
    runner = ModelRunner(model)
    runner.allocate(1, 64)
    with torch.inference_mode():
        prefill = runner.prefill(tokens, torch.tensor([tokens.shape[1]]))
        runner.cache.set_lens(torch.tensor([5], dtype=torch.int32))
        verify = runner.verify(tokens[:, :4])
        return prefill, verify


@pytest.mark.parametrize("storage", ["plain", "mkldnn"])
def test_applied_plans_keep_logits_and_unpack_restores_weights(tiny_dir, storage):
    if not storage_available(storage, torch.float32):
        pytest.skip("oneDNN packing not available in this torch build")
    model = load_model(tiny_dir)[0]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tokens = torch.tensor([[5, 9, 13, 21, 33, 40, 7, 8, 9, 10, 11]])
    ref = _logits(model, tokens)
    for key, layers in cpu_matmul.shape_groups(model).items():
        names = [p for p, (s, _) in PATHS.items() if s == storage and p != "wxt_pad"]
        plan = Plan(storage, tuple(names[i % len(names)] for i in range(17)))  # paths vary by rows
        for layer in layers:
            layer.use(plan if not key.endswith(":tied") else Plan("plain", ("linear",) * 17))
    packed = [m for m in cpu_matmul._linears(model) if m.packed_weight is not None]
    assert bool(packed) == (storage == "mkldnn") and all(m.weight is None for m in packed)  # one copy
    for a, b in zip(ref, _logits(model, tokens)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    cpu_matmul.unpack(model)
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_matvec_bound_is_measured(tiny_dir):
    model = load_model(tiny_dir)[0]
    b = cpu_matmul.matvec_bound(model)
    assert b["weight_bytes"] == sum(m.weight.numel() * 4 for m in cpu_matmul._linears(model)
                                    if m.weight is not model.embed_tokens.weight) + \
        (model.lm_head.weight.numel() * 4 if model.config.tie_word_embeddings else 0)
    assert b["matvec_s"] > 0 and b["tokens_per_s_bound"] == pytest.approx(1 / b["matvec_s"])


def test_engine_tokens_same_with_tuned_and_plain_linear(tiny_pair, tokenizer):
    target, _, perturbed = tiny_pair
    prompts = ["def f(x):", "abc abc abc", "for i in"]
    eng = Engine(target, tokenizer, draft=perturbed, max_seq_len=128, cpu_matmul="linear")
    assert all(m.plan_fns is None for m in cpu_matmul._linears(target))
    ref = {m: [r.token_ids for r in eng.generate(prompts, max_new_tokens=24, method=m, gamma=3, ignore_eos=True)]
           for m in ("ar", "sd")}
    assert ref["ar"] == ref["sd"]
    eng.set_cpu_matmul("auto")
    assert all(m.plan_fns is not None for m in cpu_matmul._linears(target))
    for m in ("ar", "sd"):
        out = [r.token_ids for r in eng.generate(prompts, max_new_tokens=24, method=m, gamma=3, ignore_eos=True)]
        assert out == ref["ar"]
    eng.set_cpu_matmul("linear")  # the shared fixtures go back to plain weights


def test_a_packed_model_deep_copies_to_plain_weights(tiny_dir):
    """oneDNN's packed weight cannot be deep-copied: a copy gets the plain weight back, no plan,
    the same logits; the original keeps its packing."""
    import copy

    from specengine.models import cpu_matmul
    from specengine.models.loading import load_model

    model = load_model(tiny_dir)[0]
    layer = model.layers[0].mlp.down_proj
    dense = layer.weight.detach().clone()
    layer.use(Plan("mkldnn", ("mkldnn",) * 3))
    clone = copy.deepcopy(model).layers[0].mlp.down_proj
    assert layer.weight is None and layer.packed_weight is not None
    assert clone.packed_weight is None and clone.plan_fns is None and torch.equal(clone.weight, dense)
    x = torch.randn(2, dense.shape[1])
    torch.testing.assert_close(clone(x), layer(x), rtol=1e-5, atol=1e-5)


def test_the_suite_files_into_a_table_of_its_own(monkeypatch, tmp_path):
    """conftest.py points the machine's table away from the user's cache (no test files into a
    user's table); SPECENGINE_PLAN_DIR moves it."""
    assert machine.cache_path().parent == Path(os.environ["SPECENGINE_PLAN_DIR"])
    assert machine.cache_dir() not in machine.cache_path().parents
    monkeypatch.setenv("SPECENGINE_PLAN_DIR", str(tmp_path))
    assert machine.cache_path().parent == tmp_path
    monkeypatch.delenv("SPECENGINE_PLAN_DIR")
    assert machine.cache_path().parent == machine.cache_dir() / "plan"


def test_a_path_that_cannot_win_stops_its_one_pass_at_the_bound_and_a_contender_gets_its_best():
    """The table's passes: a path whose first timed pass goes past `loses_at` (seconds per weight) stops
    at the weight that took it there and is not timed again (one untimed call on the first weight
    first), its rate so far the answer; a contender gets every rep, its minimum."""
    import time

    calls = []

    def fn(cost):
        def run(x, w):
            calls.append(cost)
            time.sleep(cost)
        return run

    weights = list(range(10))  # a pass is ten calls; the bound: 10 x 1 ms
    slow = cpu_matmul._time_pass(fn(0.004), None, weights, reps=2, loses_at=0.001)
    assert 1 + 2 <= len(calls) <= 1 + 3 and slow >= 0.004  # warm-up, three weights at most (12 ms): per weight
    calls.clear()
    weights = [0, 1]  # two weights: a pass is two calls
    # a wide cut (50x the sleep): a loaded CI machine's scheduling delays never make it a loser
    close = cpu_matmul._time_pass(fn(0.001), None, weights, reps=2, loses_at=0.05)
    assert len(calls) == 1 + 2 * 2 and 0.001 <= close < 0.05
    calls.clear()
    cpu_matmul._time_pass(fn(0.001), None, weights, reps=2)  # no bound (the first path timed): as before
    assert len(calls) == 2 * 2


def test_the_last_row_counts_winner_is_timed_first_so_its_losers_take_one_pass(monkeypatch):
    """measure_group times each row count's paths with the previous row count's winner first: a path
    that lost there by more than LOSES_BY gets one pass, cut at the bound, and one that lost by more
    than DROPPED_AT at 2 rows or more is timed no more (bf16 on an AVX2 EPYC: our `rows` kernel, last
    in PATHS, beats F.linear from 2 rows on, which otherwise took every rep at every row count)."""
    import time

    calls = []

    def path(name, cost):
        def run(x, w):
            calls.append((x.shape[0], name))
            time.sleep(cost)
        return run

    w = torch.zeros(4, 8)
    monkeypatch.setattr(cpu_matmul, "PATHS", {"slow": ("plain", path("slow", 0.05)), "fast": ("plain", path("fast", 0.001))})
    monkeypatch.setattr(cpu_matmul, "PATH_DTYPES", {})
    monkeypatch.setattr(cpu_matmul, "_sample", lambda layers, dtype: [w, w])  # two weights: a pass is two calls
    layer = types.SimpleNamespace(out_features=4)
    ms = cpu_matmul.measure_group([layer], torch.float32, [1, 2, 3, 4], ["plain"], reps=2)
    assert all(ms[str(r)]["fast"] < ms[str(r)]["slow"] for r in (1, 2))
    per = {(r, n): sum(1 for c in calls if c == (r, n)) for r in (1, 2, 3, 4) for n in ("slow", "fast")}
    # row 1: PATHS' order, `slow` first and timed in full (2 reps x 2 weights); then `fast`, cut by nothing
    assert per[1, "slow"] == 2 * 2 and per[1, "fast"] == 1 + 2 * 2
    # row 2: `fast` first; `slow` one untimed call and its pass cut at its first weight (50 ms > 1.3 x 2 ms)
    assert per[2, "fast"] == 2 * 2 and per[2, "slow"] == 1 + 1
    assert [n for r, n in calls if r == 2][0] == "fast"
    # rows 3, 4: `slow` lost by more than DROPPED_AT at 2 rows: not timed again (one row alone never drops it)
    assert all(per[r, "fast"] == 2 * 2 and per[r, "slow"] == 0 and "slow" not in ms[str(r)] for r in (3, 4))
