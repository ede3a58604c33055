"""Sampling end to end: the joint distribution of two generated tokens equals the target's
(exact enumeration of the 64 continuations vs 5e4 independent rows, TV bound from n).

The exact target is computed with transformers' own logits warpers (temperature, then
top-k, then top-p, HF's order), never with our filter, so a broken top-k / top-p in
specengine cannot hide behind a reference that shares it. Each method also has a control:
the same run with a wrong acceptance rule (every draft accepted) is caught by the bound."""
import dataclasses

import pytest
import torch
from conftest import small_vocab_models
from helpers.exact import N, PROMPT, V, exact_joint
from helpers.fakes import random_drafter

import specengine.methods.token_tree
from specengine import Engine
from specengine.runtime.step_costs import StepCosts
from helpers.distribution_bounds import total_variation_bound

N_CONTROL = 20_000


def joint_tv(out, exact) -> tuple[float, float]:
    """(TV between the rows' (t1, t2) frequencies and `exact`, the bound for that many rows)."""
    pairs = torch.tensor([r.token_ids for r in out])
    emp = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).double() / len(out)
    return 0.5 * (emp - exact.double()).abs().sum().item(), total_variation_bound(V * V, len(out))


COSTS = {  # step costs pinned for γ auto (the tiny models' measured ones make either likely)
    "pays": StepCosts(1, draft_s=0.05, target_s=(1.0,) * 9),
    "loses": StepCosts(1, draft_s=0.5, target_s=tuple(1.0 + w for w in range(9))),
}


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory, tokenizer):
    hf, target, draft = small_vocab_models(tmp_path_factory.mktemp("v8"), V)
    drafter = random_drafter(draft, k_max=3)

    def engine(max_seq_len=40, costs=None, pure=False):
        eng = Engine(target, tokenizer, None if pure else draft, max_seq_len=max_seq_len,
                     parallel_drafter=None if pure else drafter)
        if costs:
            eng.step_costs = lambda state, width, draft=True: COSTS[costs]
        return eng
    return hf, engine


CASES = [  # (id, generate kwargs): every method, policy and drafting shape that samples
    ("ar", dict(method="ar", temperature=1.0)),
    ("sd", dict(method="sd", gamma=2, temperature=1.0)),
    ("sd-topk", dict(method="sd", gamma=1, temperature=0.7, top_k=5)),
    ("sd-topp", dict(method="sd", gamma=3, temperature=1.3, top_p=0.8)),
    # gamma from past rounds only (no bias to look for in the current one): fewer rows; the
    # heuristic's gamma may grow to 16, so its cache is longer
    # γ auto under costs where speculation pays, and where it loses (every round a plain decode)
    ("sd-auto", dict(method="sd", gamma="auto", temperature=1.0, rows=30_000, costs="pays")),
    ("sd-auto-plain", dict(method="sd", gamma="auto", temperature=1.0, rows=30_000, costs="loses")),
    ("sd-heuristic", dict(method="sd", gamma=2, policy="heuristic", temperature=0.9, top_k=6, rows=30_000,
                          max_seq_len=72)),
    ("sd-confidence", dict(method="sd", gamma=3, policy="confidence", threshold=0.5, temperature=1.0)),
    ("sd-tree", dict(method="sd", tree="3x2", temperature=1.0)),  # sibling-by-sibling residual rule
    ("sd-tree-topk", dict(method="sd", tree="2x3:5", temperature=0.8, top_k=6)),
    ("pearl-parallel", dict(method="pearl", policy="parallel", gamma=3, temperature=1.0)),
    ("parallelspec-tree", dict(method="parallelspec", tree="2x2", temperature=0.9, top_p=0.9)),
    # n-gram proposals are one-hot drafts (q = None); the second token's round matches where t1 repeats PROMPT
    ("ngram", dict(method="ngram", gamma=2, temperature=1.0)),  # the loaded draft sits it out
    ("ngram-tree", dict(method="ngram", tree="2x2", temperature=0.8, top_k=6, pure=True)),
    # with the draft model: its chains where a row has no match (round 1), n-gram rounds where all match
    ("hybrid", dict(method="hybrid", gamma=2, temperature=1.0)),
    # γ auto where the draft pays: round 1 (no match, nothing written yet) decodes plainly, round 2
    # runs the draft's deferred prefill, then its chain
    ("hybrid-auto", dict(method="hybrid", gamma="auto", temperature=1.0, rows=30_000, costs="pays")),
]


def _sampling(kw):
    return dict(temperature=kw["temperature"], top_k=kw.get("top_k", 0), top_p=kw.get("top_p", 1.0))


@pytest.mark.parametrize("kw", [c[1] for c in CASES], ids=[c[0] for c in CASES])
def test_two_token_joint_matches_target(small_vocab, kw):
    hf, engine = small_vocab
    kw = dict(kw)
    rows, eng = kw.pop("rows", N), engine(kw.pop("max_seq_len", 40), kw.pop("costs", None), kw.pop("pure", False))
    out = eng.generate([PROMPT] * rows, max_new_tokens=2, seed=1234, ignore_eos=True, **kw)
    tv, bound = joint_tv(out, exact_joint(hf, **_sampling(kw)))
    assert tv <= bound, (tv, bound)
    stats = out[0].stats
    # γ auto fell back to plain decoding: no draft ran (n-gram and hybrid rounds may be plain by match)
    if stats.get("plain_rounds") and kw["method"] not in ("ngram", "hybrid"):
        assert stats["plain_rounds"] == stats["rounds"] and stats["proposed_drafts"] == 0
    elif kw["method"] != "ar":
        assert 0 < stats["acceptance_rate"] < 1  # both accept and reject paths ran
    if kw["method"] == "hybrid" and kw["gamma"] == "auto":
        assert stats["draft_rounds"] > 0 and stats["draft_prefills_deferred"] == rows


def accept_everything(monkeypatch, eng):
    """A wrong rule: every draft token is accepted. Chains: q = 0 makes u * q(x) < p(x) always
    true; trees: u = 0 accepts the first child tried."""
    real = eng.ops.rejection_sample

    def sampler(logits, drafts, q, *rest):  # q = None (one-hot drafts: n-gram) gets zeros too
        return real(logits, drafts, torch.zeros(*drafts.shape, logits.shape[-1]) if q is None else
                    torch.zeros_like(q), *rest)
    monkeypatch.setattr(eng.target, "ops", dataclasses.replace(eng.ops, rejection_sample=sampler))
    monkeypatch.setattr(specengine.methods.token_tree, "counter_uniform", lambda seed, *a: torch.zeros(seed.shape))


CONTROLS = [c for c in CASES[1:] if c[0] != "sd-auto-plain"]  # plain rounds accept nothing to break


@pytest.mark.parametrize("kw", [c[1] for c in CONTROLS], ids=[c[0] for c in CONTROLS])
def test_a_wrong_acceptance_rule_fails_the_same_check(small_vocab, kw, monkeypatch):
    """The check above can fail: with every draft accepted the output is (close to) the draft's
    own distribution, and the bound catches it at a fifth of the rows."""
    hf, engine = small_vocab
    kw = dict(kw)
    kw.pop("rows", None)
    eng = engine(kw.pop("max_seq_len", 40), kw.pop("costs", None), kw.pop("pure", False))
    accept_everything(monkeypatch, eng)
    out = eng.generate([PROMPT] * N_CONTROL, max_new_tokens=2, seed=1234, ignore_eos=True, **kw)
    tv, bound = joint_tv(out, exact_joint(hf, **_sampling(kw)))
    assert tv > bound, (tv, bound)


def test_transformers_reference_sees_the_filters(small_vocab):
    """The reference is sensitive to what the mutations remove: top-k 5 of 8 moves the
    target distribution far beyond the bound, and so does top-p 0.8."""
    hf = small_vocab[0]
    plain = exact_joint(hf, 0.7)
    for kw in (dict(top_k=5), dict(top_p=0.8)):
        assert 0.5 * (plain - exact_joint(hf, 0.7, **kw)).abs().sum() > 3 * total_variation_bound(V * V, N)
