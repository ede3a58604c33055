"""The end-to-end benchmark's report: machine, matvec bound, exact match against ar."""
import json

import pytest

from specengine import Engine, SpecEngineError, benchmark
from specengine.benchmark import agreement, format_table, parse_provider, run_benchmark


def test_agreement_counts_exact_matches_and_first_divergence():
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9]]
    assert agreement(ref, ref) == {"same_tokens_as_reference": True, "exact_match_rate": 1.0,
                                   "first_divergence": None}
    out = agreement([[1, 2, 3, 4], [5, 6, 0, 8], [9, 1]], ref)
    assert out["exact_match_rate"] == pytest.approx(1 / 3) and out["first_divergence"] == 1
    assert not out["same_tokens_as_reference"]


def test_provider_specs():
    assert parse_provider("sd:auto") == ("sd", "auto", None, None, None)
    assert parse_provider("sd:3") == ("sd", 3, None, None, None)
    assert parse_provider("pearl") == ("pearl", None, None, None, None)
    assert parse_provider("pearl:3@parallel") == ("pearl", 3, "parallel", None, None)
    assert parse_provider("sd@heuristic") == ("sd", None, "heuristic", None, None)
    assert parse_provider("sd:8@specdec++=0.6") == ("sd", 8, "specdec++", 0.6, None)
    assert parse_provider("parallelspec:3") == ("parallelspec", 3, None, None, None)
    assert parse_provider("sd[tree=4x5:16]") == ("sd", None, None, None, "4x5:16")
    assert parse_provider("parallelspec[tree=3x4]") == ("parallelspec", None, None, None, "3x4")
    assert parse_provider("ngram:auto") == ("ngram", "auto", None, None, None)
    assert parse_provider("ngram[tree=4x6:16]") == ("ngram", None, None, None, "4x6:16")
    assert parse_provider("hybrid:3") == ("hybrid", 3, None, None, None)
    assert parse_provider("hf-lookup") == ("hf-lookup", None, None, None, None)
    for bad in ("pearl@heuristic", "sd@specdec++=x", "ar:3", "beam", "sd:3[tree=2x2]", "ar[tree=2x2]", "sd[tree=]",
                "pearl:auto", "hybrid[tree=2x2]", "ngram@heuristic"):
        with pytest.raises(SpecEngineError):
            parse_provider(bad)


def test_report_records_machine_bound_and_tokens(tiny_pair, tokenizer, monkeypatch, tmp_path):
    target, _, perturbed = tiny_pair
    monkeypatch.setattr(benchmark, "humaneval", lambda n: [{"prompt": p} for p in ["def f(x):", "abc ab"][:n]])
    eng = Engine(target, tokenizer, draft=perturbed, max_seq_len=128)
    report = run_benchmark(eng, ["sd:auto", "ar", "sd:2", "ngram:auto", "hybrid:2"], n_prompts=2, max_new_tokens=10,
                           baseline="ar")
    assert report["exact_match_reference"] == "ar"  # not the first provider: exact match is against ar
    env = report["environment"]
    assert env["cpu"] and env["cpu_threads"] >= 1 and env["cpu_isa"]
    bound = report["target_matvec_bound"]
    assert bound["tokens_per_s_bound"] > 0 and bound["matvec_gb_per_s"] > 0
    rows = {r["provider"]: r for r in report["results"]}
    assert all(r["same_tokens_as_reference"] and r["exact_match_rate"] == 1.0 for r in rows.values())
    assert rows["ar"]["decode_fraction_of_matvec_bound"] > 0
    assert rows["ar"]["decode_tokens_per_s"] > rows["ar"]["tokens_per_s"]  # prefill excluded
    auto = rows["sd:auto"]  # gamma_mean 0: every round was a plain decode (speculation lost here)
    assert (1 <= auto["gamma_mean"] <= 8 or auto["plain_rounds"] > 0) and rows["sd:2"]["gamma_mean"] == 2
    assert auto["predicted_tokens_per_s"] > 0 and isinstance(auto["prediction_error"], float)
    assert "prediction_error" not in rows["sd:2"]  # a fixed γ is not the cost model's choice
    table = format_table(report)
    assert "machine:" in table and "threads" in table and "matvec bound" in table and "% of the bound" in table
    assert "batch-invariant mode off" in table and "exactly ar's tokens" in table
    json.dumps(report)  # serializable as written by `specengine bench --out`


def test_providers_run_side_by_side_prompt_by_prompt(tiny_pair, tokenizer, monkeypatch):
    """Every provider runs a prompt before any runs the next (after one warm-up each), so that a
    machine's drift during the run weighs on every provider alike."""
    monkeypatch.setattr(benchmark, "humaneval", lambda n: [{"prompt": p} for p in ["def f(x):", "abc ab", "x = 1"][:n]])
    calls, real = [], benchmark._provider_fn

    def recording(engine, hf, name, *rest):
        run = real(engine, hf, name, *rest)
        return lambda ids, n: (calls.append((name, n)), run(ids, n))[1]
    monkeypatch.setattr(benchmark, "_provider_fn", recording)
    eng = Engine(tiny_pair[0], tokenizer, max_seq_len=128)
    run_benchmark(eng, ["ar", "ngram:auto"], n_prompts=3, max_new_tokens=6, baseline="ar")
    assert calls == [("ar", 4), ("ngram", 4)] + [("ar", 6), ("ngram", 6)] * 3


def test_stop_at_eos_ends_every_provider_at_the_engines_eos(tiny_dir, tiny_pair, tokenizer, monkeypatch):
    """Whole replies: ours and transformers' generate stop at the same EOS token (kept), and
    without the flag each provider generates exactly max_new_tokens."""
    monkeypatch.setattr(benchmark, "humaneval", lambda n: [{"prompt": "def f(x):"}])
    eng = Engine(tiny_pair[0], tokenizer, max_seq_len=128)
    full = eng.generate("def f(x):", max_new_tokens=12, ignore_eos=True).token_ids
    cut = next(i for i in range(2, 12) if full[i] not in full[:i])  # a token first seen at i
    eng.eos_ids = {full[cut]}
    providers = ["ar", "ngram:auto", "hf"]
    kw = dict(n_prompts=1, max_new_tokens=12, target_path=tiny_dir, baseline="ar")
    stopped = run_benchmark(eng, providers, stop_at_eos=True, **kw)
    assert stopped["stop_at_eos"] and stopped["reference_outputs"] == [full[:cut + 1]]
    assert all(r["new_tokens"] == cut + 1 and r["same_tokens_as_reference"] for r in stopped["results"])
    fixed = run_benchmark(eng, providers, **kw)
    assert fixed["reference_outputs"] == [full]
    assert all(r["new_tokens"] == 12 and r["same_tokens_as_reference"] for r in fixed["results"])
