"""dtype "auto": each model's precision for its role, from the measured matmul table and the
method's work (specengine/precision.py); mixed pairs stay lossless; forcing for CI."""
import copy
import warnings

import pytest
import torch

from specengine import Engine, SpecEngineError, precision
from specengine.methods.policies import expected_tokens

# seconds of one forward's matmuls by row count, shaped like the AMD EPYC (AVX2)
# table: bf16 costs ~k x for k rows, fp32 is memory-bound (flat) and twice bf16's one row
AVX2 = {"float32": lambda r: 2.0 + 0.1 * r, "bfloat16": lambda r: 1.0 * r}
AMX = {"float32": lambda r: 2.0 + 0.1 * r, "bfloat16": lambda r: 1.0 + 0.05 * r}  # bf16 wins every width


def fake_tables(monkeypatch, target_table, draft_table, draft_scale=0.1):
    def seconds(model, dtype, rows, progress=True):
        table, scale = (target_table, 1.0) if model == "target" else (draft_table, draft_scale)
        return {r: scale * table[dtype](r) for r in rows}
    monkeypatch.setattr(precision, "matmul_seconds", seconds)


def sd_rate_by_hand(t, d, alpha, g):
    """tokens/s of an sd round of γ drafts: a 2-token catch-up, γ-1 one-token draft steps, a
    verify of γ+1 tokens; γ = 0 is a plain decode."""
    if g == 0:
        return 1.0 / t(1)
    return expected_tokens(alpha, g) / (d(2) + (g - 1) * d(1) + t(g + 1))


@pytest.mark.parametrize("table", [AVX2, AMX], ids=["avx2-like", "amx-like"])
@pytest.mark.parametrize("alpha", [0.3, 0.7, 0.95])
def test_the_choice_is_the_best_cell_of_the_grid(monkeypatch, table, alpha):
    fake_tables(monkeypatch, table, table)
    choice = precision.choose("target", "draft", "sd", alpha=alpha)
    by_hand = {}
    for tdt in precision.CPU_DTYPES:
        for ddt in precision.CPU_DTYPES:
            for g in range(0, 9):
                t = lambda r, tdt=tdt: table[tdt](r)  # noqa: E731
                d = lambda r, ddt=ddt: 0.1 * table[ddt](r)  # noqa: E731
                by_hand[(tdt, ddt, g)] = sd_rate_by_hand(t, d, alpha, g)
    best = max(by_hand, key=by_hand.get)
    got = (choice["target"], choice["draft"], choice["predicted_gamma"])
    assert by_hand[got] == pytest.approx(by_hand[best]) and choice["predicted_tokens_per_s"] == pytest.approx(
        by_hand[best])
    ar = choice["best_by_method"]["ar"]
    assert ar["target"] == min(precision.CPU_DTYPES, key=lambda dt: table[dt](1))  # ar: one-row decodes only


def test_avx2_like_costs_pick_a_bf16_draft_and_never_lose_to_plain_decoding(monkeypatch):
    """The issue's machine: bf16 wins a 1-row step, so the draft (1-row steps) is bf16; the
    target's verify is where bf16 loses. Whatever is chosen is never predicted below the best
    plain decoding (γ = 0 in the target's best ar dtype is in the grid)."""
    fake_tables(monkeypatch, AVX2, AVX2)
    for alpha in (0.2, 0.5, 0.9):
        choice = precision.choose("target", "draft", "sd", alpha=alpha)
        assert choice["predicted_tokens_per_s"] >= choice["best_by_method"]["ar"]["tokens_per_s"]
        if choice["predicted_gamma"]:
            assert choice["draft"] == "bfloat16"
    high = precision.choose("target", "draft", "sd", alpha=0.95)
    assert (high["target"], high["draft"]) == ("float32", "bfloat16") and high["predicted_gamma"] >= 3


def test_forced_dtype_and_its_errors(tiny_dir, monkeypatch):
    monkeypatch.setenv(precision.FORCE_ENV, "bfloat16")
    eng = Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), max_seq_len=64)
    assert eng.target.dtype == torch.bfloat16 and eng.draft.dtype == torch.bfloat16
    assert eng.dtype_choice["why"] == "forced by SPECENGINE_CPU_DTYPE=bfloat16"
    pinned = Engine.from_pretrained(str(tiny_dir), max_seq_len=64, dtype="float32")  # an explicit dtype wins
    assert pinned.target.dtype == torch.float32 and pinned.dtype_choice is None
    monkeypatch.setenv(precision.FORCE_ENV, "int4")
    with pytest.raises(SpecEngineError, match="SPECENGINE_CPU_DTYPE must be one of float32, bfloat16"):
        Engine.from_pretrained(str(tiny_dir), max_seq_len=64)


@pytest.mark.cpu_dtype_choice
def test_auto_loads_what_it_chose_and_says_why(tiny_dir):
    """On this machine (and in CI with each dtype forced): the models are in the dtypes the
    choice names; a measured choice is the best cell of its own grid; ar == sd wherever the
    target is fp32 or the batch-invariant mode is on."""
    eng = Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), max_seq_len=128)
    c = eng.dtype_choice
    assert str(eng.target.dtype) == f"torch.{c['target']}" and str(eng.draft.dtype) == f"torch.{c['draft']}"
    if c["why"] == "measured":
        cells = [x for x in c["grid"] if x["method"] == "sd"]
        assert c["predicted_tokens_per_s"] == max(x["tokens_per_s"] for x in cells)
        assert set(c["matmul_s"]["target"]) == set(precision.CPU_DTYPES)
    prompts = ["def f(x):", "for i in"]
    ar = [r.token_ids for r in eng.generate(prompts, max_new_tokens=16, method="ar", ignore_eos=True)]
    sd = [r.token_ids for r in eng.generate(prompts, max_new_tokens=16, method="sd", gamma=3, ignore_eos=True)]
    if eng.target.dtype == torch.float32 or eng.batch_invariant:
        assert sd == ar


@pytest.mark.parametrize("method,kw", [("sd", dict(gamma=3)), ("sd", dict(tree="2x3:5")), ("pearl", dict(gamma=2)),
                                       ("sd", dict(policy="confidence", gamma=4))])
def test_a_bf16_draft_for_an_fp32_target_is_lossless(tiny_pair, tokenizer, method, kw):
    """Mixed pairs: the draft's dtype changes what it proposes, never what is committed."""
    target, _, perturbed = tiny_pair
    draft = copy.deepcopy(perturbed).to(torch.bfloat16)
    eng = Engine(target, tokenizer, draft, max_seq_len=128)
    assert eng.target.dtype == torch.float32 and eng.draft.dtype == torch.bfloat16
    prompts = ["def f(x):", "abc abc abc", "x = [1"]
    ar = [r.token_ids for r in eng.generate(prompts, max_new_tokens=24, method="ar", ignore_eos=True)]
    out = eng.generate(prompts, max_new_tokens=24, method=method, ignore_eos=True, **kw)
    assert [r.token_ids for r in out] == ar and out[0].stats["accepted_drafts"] > 0


def test_a_call_that_switches_methods_is_told_the_better_setting(tiny_pair, tokenizer):
    target, _, perturbed = tiny_pair
    eng = Engine(target, tokenizer, perturbed, max_seq_len=64)
    eng.dtype_choice = {"method": "sd", "target": "float32", "draft": "float32", "best_by_method": {
        "ar": {"target": "bfloat16", "draft": None, "gamma": 0, "tokens_per_s": 10.0},
        "sd": {"target": "float32", "draft": "float32", "gamma": 3, "tokens_per_s": 8.0}},
        "grid": [{"method": "ar", "target": "float32", "draft": None, "gamma": 0, "tokens_per_s": 5.0}]}
    with pytest.warns(RuntimeWarning, match=r"method 'ar' is predicted 2.00x faster .* target bfloat16"):
        eng.generate("x", max_new_tokens=2, method="ar")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per method, and nothing for the method it chose for
        eng.generate("x", max_new_tokens=2, method="ar")
        eng.generate("x", max_new_tokens=2, method="sd", gamma=2)


def test_gguf_blocks_join_the_grid_per_role(monkeypatch):
    """weights "auto" with a GGUF source: the blocks join bf16 as a role's settings (fp32, 4-8x the
    blocks' bytes, is not timed), and the grid's best cell over all four pairs is chosen (by hand
    here); a draft tie goes to the cheaper draft step."""
    blocks = lambda r: 0.3 + 0.6 * r  # noqa: E731 - the cheapest one row (0.9 s), dearer per row than bf16's
    table = {"bfloat16": AVX2["bfloat16"], "gguf": blocks}

    def seconds(model, dtype, rows, progress=True):
        assert (dtype == "gguf") == model.startswith("q"), (model, dtype)  # blocks are measured on the twin
        return {r: (0.1 if model.endswith("draft") else 1.0) * table[dtype](r) for r in rows}
    monkeypatch.setattr(precision, "matmul_seconds", seconds)
    monkeypatch.setattr(precision, "one_row_floor", lambda model, dtype, progress=True: seconds(model, dtype, (1,))[1])
    for alpha in (0.3, 0.9):
        choice = precision.choose("target", "draft", "sd", alpha=alpha, quant={"target": "qtarget", "draft": "qdraft"})
        by_hand = {(t, d, g): sd_rate_by_hand(table[t], lambda r, d=d: 0.1 * table[d](r), alpha, g)
                   for t in table for d in table for g in range(9)}
        best = max(by_hand.values())
        assert choice["predicted_tokens_per_s"] == pytest.approx(best)
        assert {c["target"] for c in choice["grid"]} == set(table) == {c["draft"] for c in choice["grid"] if c["draft"]}
        if choice["predicted_gamma"] == 0:
            assert choice["draft"] == "gguf"  # the cheapest one-row draft step: 0.09 s vs 0.10
        assert choice["best_by_method"]["ar"]["target"] == "gguf"  # plain decoding: one-row steps only


def _counting_tables(monkeypatch, table, draft_scale=0.1):
    """Fake measurements that record which (model, dtype) got a full table and which a one-row floor."""
    full, floored = [], []

    def cost(model, dtype, r):
        return (draft_scale if model.endswith("draft") else 1.0) * table[dtype](r)

    def seconds(model, dtype, rows, progress=True):
        full.append((model, dtype))
        return {r: cost(model, dtype, r) for r in rows}

    def floor(model, dtype, progress=True):
        floored.append((model, dtype))
        return cost(model, dtype, 1)
    monkeypatch.setattr(precision, "matmul_seconds", seconds)
    monkeypatch.setattr(precision, "one_row_floor", floor)
    return full, floored


def test_a_float_setting_that_cannot_win_is_priced_by_its_one_row_floor_only(monkeypatch):
    """Blocks at a third of bf16's one-row time (a dequantized copy streams 2-4x the bytes): bf16's
    one-row time, taken as its cost at every width, already loses every method's grid, so its full
    table is never measured, and the choice equals the one made with bf16 measured in full."""
    table = {"bfloat16": lambda r: 1.0 * r, "gguf": lambda r: 0.3 + 0.1 * r}
    full, floored = _counting_tables(monkeypatch, table)
    quant = {"target": "qtarget", "draft": "qdraft"}
    choice = precision.choose("target", "draft", "sd", alpha=0.7, quant=quant)
    assert sorted(floored) == [("draft", "bfloat16"), ("target", "bfloat16")]
    assert all(dt == "gguf" for _, dt in full), full  # bf16 never measured past one row
    assert choice["floored"] == ["draft bfloat16", "target bfloat16"]
    # priced at exactly its one-row time at every width: never above what a width could cost
    assert set(choice["matmul_s"]["target"]["bfloat16"].values()) == {1.0}
    assert list(set(choice["matmul_s"]["draft"]["bfloat16"].values())) == [pytest.approx(0.1)]
    assert (choice["target"], choice["draft"]) == ("gguf", "gguf")
    assert all(bool(c.get("floor")) == (c["target"] == "bfloat16" or c["draft"] == "bfloat16") for c in choice["grid"])
    # the same choice as with every setting measured in full (the floor is never above the truth)
    monkeypatch.setattr(precision, "one_row_floor", lambda model, dtype, progress=True: 1e-9)  # floors win: all measured
    exact = precision.choose("target", "draft", "sd", alpha=0.7, quant=quant)
    assert exact["floored"] == [] and {k: exact[k] for k in ("target", "draft", "predicted_gamma")} == \
        {k: choice[k] for k in ("target", "draft", "predicted_gamma")}
    assert exact["best_by_method"] == choice["best_by_method"]


def test_a_float_setting_whose_floor_could_win_is_measured_in_full_and_chosen(monkeypatch):
    """AMX-like: bf16 one row dearer than the blocks but nearly flat in rows, so a wide verify is
    cheaper in bf16; its floor could win sd's grid, so it is measured in full, and it wins."""
    table = {"bfloat16": lambda r: 1.0 + 0.01 * r, "gguf": lambda r: 0.8 * r}
    full, floored = _counting_tables(monkeypatch, table)
    choice = precision.choose("target", "draft", "sd", alpha=0.9, quant={"target": "qtarget", "draft": "qdraft"})
    assert ("target", "bfloat16") in full and "target bfloat16" not in choice["floored"]
    assert choice["target"] == "bfloat16" and choice["predicted_gamma"] >= 2
    assert choice["best_by_method"]["ar"]["target"] == "gguf"
