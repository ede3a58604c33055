"""Log-probabilities (issue 41 item 1): every method reports the target's, from the logits its rounds
already computed, equal to log_softmax of transformers' logits at the same positions (fp32,
<= 1e-4): accepted drafts, bonus tokens, tree paths and PEARL's pre/post-verify alike, never the
draft's. Prompt log-probabilities come from the prefill; "processed" is the sampled distribution."""
import pytest
import torch
from helpers.tiny_refs import engine, hf  # noqa: F401 (fixtures)

from specengine import SpecEngineError

PROMPT = "abcabcabc def add(a, b):\n"
TOL = 1e-4
CASES = [("ar", {}), ("sd", dict(gamma=3)), ("sd", dict(gamma=4, policy="confidence")),
         ("sd", dict(tree="2x3:5")), ("pearl", dict(gamma=3)),
         ("parallelspec", dict(gamma=3)), ("parallelspec", dict(tree="2x3:5")), ("ngram", dict(gamma=4)),
         ("ngram", dict(tree="2x3:5")), ("hybrid", dict(gamma=3))]


def reference(hf, ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax [T,V] over `ids`: row i is the distribution of token i + 1."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def assert_matches(entries, ref_rows, tokens, top):
    assert len(entries) == len(tokens)
    for e, row, t in zip(entries, ref_rows, tokens):
        assert e.token_id == t and abs(e.logprob - row[t].item()) <= TOL, (e, row[t].item())
        values, ids = row.topk(top)
        assert list(e.top) == ids.tolist()  # most likely first
        assert max(abs(v - w) for v, w in zip(e.top.values(), values.tolist())) <= TOL


@pytest.mark.parametrize("method, options", CASES, ids=[f"{m}-{'-'.join(map(str, o.values()))}" for m, o in CASES])
def test_every_method_reports_the_targets_logprobs(engine, hf, method, options):
    prompt = engine.tokenizer(PROMPT).input_ids
    plain = engine.generate(prompt, max_new_tokens=20, method="ar", ignore_eos=True)
    r = engine.generate(prompt, max_new_tokens=20, method=method, ignore_eos=True, logprobs=3, prompt_logprobs=True,
                        **options)
    assert r.token_ids == plain.token_ids  # greedy: ar's tokens
    if method != "ar":
        assert r.stats["accepted_drafts"] > 0  # accepted draft positions are among those checked
    ref = reference(hf, prompt + r.token_ids)
    P = len(prompt)
    assert_matches(r.logprobs, ref[P - 1: P - 1 + len(r.token_ids)], r.token_ids, 3)
    assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == P
    assert_matches(r.prompt_logprobs[1:], ref[: P - 1], prompt[1:], 3)


def test_ragged_batches_report_each_rows_own(engine, hf):
    prompts = [engine.tokenizer(p).input_ids for p in ("xy", PROMPT, "for i in range(3)")] + [[5]]
    out = engine.generate(prompts, max_new_tokens=12, method="sd", gamma=3, ignore_eos=True, logprobs=2,
                          prompt_logprobs=True)
    for p, r in zip(prompts, out):
        ref = reference(hf, p + r.token_ids)
        assert_matches(r.logprobs, ref[len(p) - 1:], r.token_ids, 2)
        assert r.prompt_logprobs[0] is None and len(r.prompt_logprobs) == len(p)  # one-token prompts too
        assert_matches(r.prompt_logprobs[1:], ref[: len(p) - 1], p[1:], 2)
    alone = engine.generate([5], max_new_tokens=2, prompt_logprobs=True)  # no prefill at all
    assert alone.prompt_logprobs == [None]


def test_tokens_cut_at_eos_or_a_stop_string_keep_only_their_logprobs(engine):
    r = engine.generate(PROMPT, max_new_tokens=17, method="sd", gamma=4, logprobs=True, ignore_eos=True)
    assert len(r.logprobs) == len(r.token_ids) == 17 and all(not e.top for e in r.logprobs)
    full = engine.generate(PROMPT, max_new_tokens=12, method="sd", gamma=4, ignore_eos=True).text
    cut = engine.generate(PROMPT, max_new_tokens=12, method="sd", gamma=4, ignore_eos=True, stop=full[3:5],
                          logprobs=0)
    assert len(cut.logprobs) == len(cut.token_ids) < 12


def test_processed_mode_is_the_sampled_distribution(engine, hf):
    prompt = engine.tokenizer(PROMPT).input_ids
    for method in ("ar", "sd", "pearl"):
        r = engine.generate(prompt, max_new_tokens=10, method=method, gamma=3, temperature=0.7, top_k=4, seed=3,
                            ignore_eos=True, logprobs=4, logprobs_mode="processed")
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + r.token_ids])).logits[0].float()
        kth = logits.topk(4).values[:, -1:]
        want = torch.log_softmax(logits.masked_fill(logits < kth, float("-inf")) / 0.7, -1)
        assert_matches(r.logprobs, want[len(prompt) - 1:], r.token_ids, 4)
    greedy = engine.generate(prompt, max_new_tokens=5, method="sd", gamma=3, ignore_eos=True, logprobs=2,
                             logprobs_mode="processed")
    for e in greedy.logprobs:  # all the mass on the argmax
        assert e.logprob == 0.0 and list(e.top.values())[1] == float("-inf")


@pytest.mark.parametrize("options, param", [(dict(logprobs=-1), "logprobs"), (dict(logprobs=21), "logprobs"),
                                            (dict(logprobs=1.5), "logprobs"),
                                            (dict(logprobs=2, logprobs_mode="softmax"), "logprobs_mode")])
def test_bad_logprob_options_are_refused_naming_them(engine, options, param):
    with pytest.raises(SpecEngineError, match=param) as err:
        engine.generate("x", max_new_tokens=2, **options)
    assert err.value.param == param
