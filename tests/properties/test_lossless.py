"""fp32 greedy: every sd configuration emits exactly ar's tokens (and transformers')."""
import pytest
import torch

from specengine import Engine

PROMPTS = ["def add(a, b):\n", "x = [1, 2", "q"]


@pytest.fixture(scope="module")
def engines(tiny_pair, tokenizer):
    target, same, perturbed = tiny_pair
    return {
        "same": Engine(target, tokenizer, same, max_seq_len=256),
        "perturbed": Engine(target, tokenizer, perturbed, max_seq_len=256),
    }


@pytest.fixture(scope="module")
def ar_out(engines):
    return engines["same"].generate(PROMPTS, max_new_tokens=40, method="ar", ignore_eos=True)


def test_ar_equals_transformers_generate(tiny_dir, engines, ar_out):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_dir).eval()
    hf.generation_config.eos_token_id = None
    for prompt, ours in zip(PROMPTS, ar_out):
        ids = engines["same"].encode(prompt)[0][0]
        x = torch.tensor([ids])
        ref = hf.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=40, pad_token_id=0)
        assert ref[0, len(ids):].tolist() == ours.token_ids


@pytest.mark.parametrize("draft", ["same", "perturbed"])
@pytest.mark.parametrize("policy", ["fixed", "heuristic", "confidence"])
@pytest.mark.parametrize("gamma", [1, 2, 3, 5])
def test_sd_equals_ar(engines, ar_out, draft, policy, gamma):
    out = engines[draft].generate(PROMPTS, max_new_tokens=40, method="sd", gamma=gamma, policy=policy,
                                  ignore_eos=True)
    for a, s in zip(ar_out, out):
        assert s.token_ids == a.token_ids
    stats = out[0].stats
    if draft == "same":
        assert stats["acceptance_rate"] == 1.0
    elif policy == "fixed" and gamma > 1:
        assert 0.0 < stats["acceptance_rate"] < 1.0, stats  # partial acceptance: reject paths run


@pytest.mark.parametrize("gamma", [1, 3, 4])
def test_all_accepted_gives_gamma_plus_one_tokens_per_target_forward(engines, gamma):
    r = engines["same"].generate("def f(", max_new_tokens=(gamma + 1) * 6, gamma=gamma, ignore_eos=True)
    assert r.stats["tokens_per_target_forward"] == gamma + 1
    assert r.stats["target_forwards"] == 6 and r.stats["draft_forwards"] == 6 * gamma


def test_batch_rows_match_single_row_runs(engines, ar_out):
    for i, prompt in enumerate(PROMPTS):
        single = engines["perturbed"].generate(prompt, max_new_tokens=40, gamma=3, ignore_eos=True)
        assert single.token_ids == ar_out[i].token_ids


def test_eos_stops_each_row_at_its_own_place(engines):
    eng = engines["perturbed"]
    full = eng.generate(PROMPTS, max_new_tokens=30, method="ar", ignore_eos=True)
    stop_tok = full[0].token_ids[7]  # make a token that appears mid-way act as EOS
    saved, eng.eos_ids = eng.eos_ids, {stop_tok}
    try:
        for method in ("ar", "sd"):
            out = eng.generate(PROMPTS, max_new_tokens=30, method=method, gamma=4)
            for f, o in zip(full, out):
                cut = f.token_ids.index(stop_tok) + 1 if stop_tok in f.token_ids else 30
                assert o.token_ids == f.token_ids[:cut]
                assert o.finish_reason == ("eos" if stop_tok in f.token_ids else "length")
    finally:
        eng.eos_ids = saved
