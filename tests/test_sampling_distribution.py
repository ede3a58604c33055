"""Sampling end to end: the joint distribution of two generated tokens equals the target's
(exact enumeration of the 64 continuations vs 1e5 independent rows, TV bound from n)."""
import pytest
import torch
from conftest import small_vocab_models

from specengine import Engine, SamplingParams
from specengine.statistics import total_variation_bound
from specengine.sampling import probs_of

V, N, PROMPT = 8, 100_000, [3, 5, 2]


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory, tokenizer):
    hf, target, draft = small_vocab_models(tmp_path_factory.mktemp("v8"), V)
    return hf, Engine(target, tokenizer, draft, max_seq_len=32)


def exact_joint(hf, params: SamplingParams) -> torch.Tensor:
    with torch.no_grad():
        p1 = probs_of(hf(torch.tensor([PROMPT])).logits[0, -1], params)
        joint = torch.zeros(V, V)
        for a in range(V):
            joint[a] = p1[a] * probs_of(hf(torch.tensor([PROMPT + [a]])).logits[0, -1], params)
    return joint.flatten()


@pytest.mark.parametrize("method,gamma,kw", [
    ("ar", None, dict(temperature=1.0)),
    ("sd", 2, dict(temperature=1.0)),
    ("sd", 1, dict(temperature=0.7, top_k=5)),
    ("sd", 3, dict(temperature=1.3, top_p=0.8)),
    ("sd", None, dict(temperature=1.0, tree="3x2")),  # token trees: sibling-by-sibling residual rule
    ("sd", None, dict(temperature=0.8, top_k=6, tree="2x3:5")),
])
def test_two_token_joint_matches_target(small_vocab, method, gamma, kw):
    hf, eng = small_vocab
    kw = dict(kw)
    tree = kw.pop("tree", None)
    params = SamplingParams(seed=1234, **kw)
    exact = exact_joint(hf, params)
    out = eng.generate([PROMPT] * N, max_new_tokens=2, method=method, gamma=gamma, seed=1234,
                       ignore_eos=True, tree=tree, **kw)
    pairs = torch.tensor([r.token_ids for r in out])
    emp = torch.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).double() / N
    tv = 0.5 * (emp - exact.double()).abs().sum().item()
    assert tv <= total_variation_bound(V * V, N), (tv, total_variation_bound(V * V, N))
    if method == "sd":
        assert 0 < out[0].stats["acceptance_rate"] < 1  # both accept and reject paths ran


def test_draft_distribution_differs_from_target(small_vocab):
    """The test above can fail: the draft's own joint is far from the target's."""
    hf, eng = small_vocab
    params = SamplingParams(temperature=1.0)
    draft = eng.draft
    joint = torch.zeros(V, V)
    with torch.no_grad():
        for a in range(V):
            draft.allocate(1, 16)
            logits = draft.verify(torch.tensor([PROMPT + [a]]))[0]
            joint[a] = probs_of(logits[-2], params)[a] * probs_of(logits[-1], params)
    tv = 0.5 * (joint.flatten() - exact_joint(hf, params)).abs().sum()
    assert tv > 3 * total_variation_bound(V * V, N)
