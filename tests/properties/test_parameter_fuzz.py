"""Random parameter sets for every method (hypothesis, tiny models, bounded): each call either
returns tokens that keep the greedy / sampled contract or raises SpecEngineError; anything
else (a raw torch error, a NaN sampled into token 0) fails the test."""
import math

import pytest
import torch
from helpers.fakes import random_drafter
from helpers.fakes import random_head

from specengine import Engine, SpecEngineError
from specengine.methods.sampling import FP32_TINY

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

PROMPT, NEW = [5, 17, 30, 42], 5

# Valid values (ordinary ones and the edges of fp32 and of each contract); in about one call
# of three, one field gets an invalid value or a plain wrong type instead.
JUNK = [None, "0.7", [0.5], True, object(), math.nan, math.inf, -math.inf]
VALID = {
    "temperature": st.one_of(st.sampled_from([0.0, 1e-45, 1e-40, FP32_TINY, 1.2e-38, 1e-30, 1e-9,
                                              3.4028234663852886e38]), st.floats(0.05, 3.0)),
    "top_k": st.one_of(st.just(0), st.integers(0, 3), st.integers(0, 80), st.just(2**63)),
    "top_p": st.one_of(st.sampled_from([1.0, 1e-300, 1e-45, FP32_TINY, 0.999999999]), st.floats(0.05, 1.0)),
    "seed": st.one_of(st.integers(0, 10), st.integers(0, 2**63 - 1)),
    "gamma": st.one_of(st.none(), st.integers(1, 5), st.just("auto")),
    "threshold": st.one_of(st.none(), st.floats(0.01, 0.99)),
}
INVALID = {
    "temperature": [-1e-45, -1.0, 3.5e38, 1e39, 1e308] + JUNK,
    "top_k": [-1, 2.0, 10**30 * -1] + JUNK,
    "top_p": [0.0, -0.5, 1.5] + JUNK,
    "seed": [-1, 2**63, 1.0] + JUNK,
    "gamma": [0, -2, 2.5, 10**9] + JUNK[1:],
    "threshold": [0.0, 1.0, -0.1, 2.0] + JUNK[1:],
}


@st.composite
def parameter_sets(draw):
    params = {name: draw(strategy) for name, strategy in VALID.items()}
    bad = draw(st.sampled_from([None, None] + list(INVALID)))
    if bad is not None:
        params[bad] = draw(st.sampled_from(INVALID[bad]))
    return params


CALLS = [dict(method="ar"), dict(method="sd"), dict(method="sd", policy="heuristic"),
         dict(method="sd", policy="confidence"), dict(method="sd", policy="specdec++"), dict(method="pearl"),
         dict(method="parallelspec"), dict(method="sd", tree="2x2:3"), dict(method="parallelspec", tree="2x2")]


@pytest.fixture(scope="module")
def engine(tiny_pair, tokenizer):
    target, _, draft = tiny_pair
    return Engine(target, tokenizer, draft, max_seq_len=128, acceptance_head=random_head(draft, seed=1, bias=1.0),
                  parallel_drafter=random_drafter(draft, k_max=4))


@pytest.fixture(scope="module")
def greedy(engine):
    return engine.generate(PROMPT, max_new_tokens=NEW, method="ar", ignore_eos=True).token_ids


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture],
          database=None, derandomize=True)
@given(call=st.sampled_from(CALLS), params=parameter_sets())
def test_every_parameter_set_keeps_the_contract_or_raises_a_clear_error(engine, greedy, call, params):
    kw = dict(call, temperature=params["temperature"], top_k=params["top_k"], top_p=params["top_p"],
              seed=params["seed"])
    temperature, top_k, top_p = kw["temperature"], kw["top_k"], kw["top_p"]
    if params["gamma"] is not None and "tree" not in call:
        kw["gamma"] = params["gamma"]
    if params["threshold"] is not None and call.get("policy") in ("confidence", "specdec++"):
        kw["threshold"] = params["threshold"]
    try:
        r = engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True, **kw)
    except SpecEngineError as e:
        assert str(e)  # a message that names the problem
        return
    V = engine.target.config.vocab_size
    assert len(r.token_ids) == NEW and all(0 <= t < V for t in r.token_ids)
    t = float(temperature)
    if t < FP32_TINY or top_k == 1 or float(top_p) < FP32_TINY:  # greedy, or one token kept
        assert r.token_ids == greedy, kw
    else:  # sampled: reproducible from its seed
        assert engine.generate(PROMPT, max_new_tokens=NEW, ignore_eos=True, **kw).token_ids == r.token_ids


@pytest.mark.interpreter  # the triton sampler on CPU tensors
@pytest.mark.parametrize("temperature", [1e-45, 1e-40, 1.2e-38, 1e-37])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_tiny_temperatures_are_greedy_on_both_samplers(tiny_pair, tokenizer, temperature, backend):
    """Below fp32's smallest normal: greedy by rule; just above: l / T would overflow fp32,
    (l - max) / T does not, and the sharpest distribution is the argmax."""
    pytest.importorskip("triton")
    target, _, draft = tiny_pair
    eng = Engine(target, tokenizer, draft, max_seq_len=64, kernels=f"torch,rejection_sample={backend},"
                 f"draft_sample={backend}")
    want = eng.generate(PROMPT, max_new_tokens=NEW, method="ar", ignore_eos=True).token_ids
    for method in ("ar", "sd"):
        got = eng.generate(PROMPT, max_new_tokens=NEW, method=method, temperature=temperature, seed=3,
                           ignore_eos=True)
        assert got.token_ids == want, (method, temperature)


def test_overflowing_logits_stay_finite_in_the_reference():
    """Logits 40 apart at T = 1e-37: l / T overflows fp32 to inf (inf - inf = NaN); the
    reference keeps the distribution exact (all mass on the argmax)."""
    from specengine.kernels.rng import tempered_softmax

    logits = torch.tensor([[10.0, 50.0, -3.0, 49.0]])
    assert torch.isnan(torch.softmax(logits / 1e-37, -1)).any()
    assert torch.equal(tempered_softmax(logits, 1e-37), torch.tensor([[0.0, 1.0, 0.0, 0.0]]))
