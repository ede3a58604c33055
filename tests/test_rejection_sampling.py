"""rejection_sample_ref: exact greedy cases, seeded determinism, lossless distribution."""
import pytest
import torch

from conftest import assert_sampler_matches_target

from specengine.kernels import rejection_sample_ref


def call(logits, drafts, q, num_draft, temp, seed=0, offset=0):
    B = logits.shape[0]
    return rejection_sample_ref(logits, drafts, q, torch.as_tensor(num_draft, dtype=torch.int32),
                                torch.full((B,), float(temp)), torch.arange(B, dtype=torch.int64) + seed,
                                torch.tensor(offset))


def greedy_logits(targets, V=10):
    """Logits whose argmax at position i is targets[b][i]."""
    t = torch.tensor(targets)
    return torch.nn.functional.one_hot(t, V).float() * 5 + torch.randn(*t.shape, V) * 0.1


def test_greedy_all_accept_first_reject_middle_reject_and_ragged():
    tgt = [[1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4], [1, 2, 3, 4]]
    drafts = torch.tensor([[1, 2, 3], [7, 2, 3], [1, 2, 9], [1, 2, 3]])
    out, n = call(greedy_logits(tgt), drafts, None, [3, 3, 3, 1], temp=0)
    assert n.tolist() == [3, 0, 2, 1]
    assert out.tolist() == [[1, 2, 3, 4], [1, -1, -1, -1], [1, 2, 3, -1], [1, 2, -1, -1]]


def test_no_drafts_is_plain_sampling():
    out, n = call(greedy_logits([[4], [6]]), torch.zeros(2, 0, dtype=torch.long), None, [0, 0], temp=0)
    assert out.tolist() == [[4], [6]] and n.tolist() == [0, 0]


def test_seeded_determinism_and_seed_sensitivity():
    g = torch.Generator().manual_seed(0)
    logits, drafts = torch.randn(64, 5, 50, generator=g), torch.randint(0, 50, (64, 4), generator=g)
    q = torch.softmax(torch.randn(64, 4, 50, generator=g), -1)
    a = call(logits, drafts, q, [4] * 64, temp=1.0, seed=7, offset=3)
    b = call(logits, drafts, q, [4] * 64, temp=1.0, seed=7, offset=3)
    c = call(logits, drafts, q, [4] * 64, temp=1.0, seed=8, offset=3)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


@pytest.mark.parametrize("V", [100, 32000, 151936, 49157])
def test_tokens_in_range_for_large_and_odd_vocabs(V):
    g = torch.Generator().manual_seed(V)
    B, K = 4, 3
    logits = torch.randn(B, K + 1, V, generator=g) * 3
    logits[:, :, V - 5:] = float("-inf")  # filtered tail must never be sampled
    drafts = torch.randint(0, V - 5, (B, K), generator=g)
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    for temp in (0.0, 0.7):
        out, n = call(logits, drafts, q, [3, 2, 1, 0], temp=temp, seed=V)
        valid = out[out >= 0]
        assert valid.numel() == (n.long() + 1).sum() and bool((valid < V - 5).all())


@pytest.mark.parametrize("stochastic", [True, False])
def test_output_distribution_equals_target(stochastic):
    assert_sampler_matches_target(rejection_sample_ref, stochastic)
