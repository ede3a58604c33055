"""rejection_sample_ref: exact greedy cases, seeded determinism, lossless distribution."""
import pytest
import torch

from specengine.kernels import rejection_sample_ref, total_variation_bound


def call(logits, drafts, q, num_draft, temp, seed=0, offset=0):
    B = logits.shape[0]
    return rejection_sample_ref(logits, drafts, q, torch.as_tensor(num_draft, dtype=torch.int32),
                                torch.full((B,), float(temp)), torch.full((B,), seed, dtype=torch.int64),
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
    """>= 1e5 rows, one round each: first token ~ p1; given d1 accepted, second ~ p2."""
    V, K, N = 6, 2, 200_000
    g = torch.Generator().manual_seed(11)
    p_logits = torch.randn(K + 1, V, generator=g) * 1.5
    q_probs = torch.softmax(torch.randn(K, V, generator=g) * 1.5, -1)
    if stochastic:
        drafts = torch.multinomial(q_probs, N, replacement=True, generator=g).T  # [N,K]
        q = q_probs.expand(N, K, V)
    else:  # a deterministic draft always proposes the same tokens
        drafts = torch.tensor([[2, 4]]).expand(N, K)
        q = None
    temp = 0.8
    out, n = rejection_sample_ref(p_logits.expand(N, K + 1, V), drafts, q, torch.full((N,), K, dtype=torch.int32),
                                  torch.full((N,), temp), torch.full((N,), 5, dtype=torch.int64), torch.tensor(0))
    p = torch.softmax(p_logits / temp, -1)
    emp1 = torch.bincount(out[:, 0], minlength=V).double() / N
    tv1 = 0.5 * (emp1 - p[0]).abs().sum().item()
    assert tv1 <= total_variation_bound(V, N), tv1
    acc = out[:, 0] == drafts[:, 0]
    m = int(acc.sum())
    emp2 = torch.bincount(out[acc, 1], minlength=V).double() / m
    tv2 = 0.5 * (emp2 - p[1]).abs().sum().item()
    assert tv2 <= total_variation_bound(V, m), tv2
    # and a wrong sampler would fail: the draft's own distribution is far away
    if stochastic:
        assert 0.5 * (q_probs[0] - p[0]).abs().sum() > 5 * total_variation_bound(V, N)
