"""Triton fused rejection sampling vs the torch reference and vs the target distribution."""
import pytest
import torch
from conftest import DEVICE, assert_sampler_matches_target

from specengine.kernels import rejection_sample_ref

pytest.importorskip("triton")
from specengine.kernels.rejection_sampling import rejection_sample  # noqa: E402


def args(logits, drafts, q, num_draft, temp, seed=0, offset=0):
    B = logits.shape[0]
    t = lambda x, dt: torch.as_tensor(x, dtype=dt).to(DEVICE)  # noqa: E731
    return (logits.to(DEVICE), drafts.to(DEVICE), None if q is None else q.to(DEVICE),
            t(num_draft, torch.int32), torch.full((B,), float(temp), device=DEVICE),
            torch.arange(B, device=DEVICE) + seed, t(offset, torch.int64))


def peaked(targets, V=10):
    t = torch.tensor(targets)
    return torch.nn.functional.one_hot(t, V).float() * 5 + torch.randn(*t.shape, V) * 0.1


def test_greedy_all_accept_first_reject_middle_reject_ragged():
    drafts = torch.tensor([[1, 2, 3], [7, 2, 3], [1, 2, 9], [1, 2, 3], [5, 5, 5]])
    logits = peaked([[1, 2, 3, 4]] * 5)
    out, n = rejection_sample(*args(logits, drafts, None, [3, 3, 3, 1, 0], 0.0))
    assert n.tolist() == [3, 0, 2, 1, 0]
    assert out.tolist() == [[1, 2, 3, 4], [1, -1, -1, -1], [1, 2, 3, -1], [1, 2, -1, -1], [1, -1, -1, -1]]


@pytest.mark.parametrize("V", [100, 32000, 151936, 50257])
@pytest.mark.parametrize("stochastic", [True, False])
def test_agrees_with_reference_on_identical_random_numbers(V, stochastic):
    g = torch.Generator().manual_seed(V)
    B, K = 5, 4
    logits = torch.randn(B, K + 1, V, generator=g) * 3
    logits[:, :, V - 7:] = float("-inf")  # a filtered tail (top-k/top-p) is never sampled
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1) if stochastic else None
    drafts = torch.randint(0, V - 7, (B, K), generator=g)
    for temp in (0.0, 0.6, 1.0):
        a = args(logits, drafts, q, [4, 3, 2, 1, 0], temp, seed=9, offset=2)
        out, n = rejection_sample(*a)
        ref_out, ref_n = rejection_sample_ref(*a)
        assert torch.equal(out.cpu(), ref_out.cpu()) and torch.equal(n.cpu(), ref_n.cpu())
        valid = out[out >= 0]
        assert valid.numel() == int((n.long() + 1).sum()) and bool((valid < V - 7).all())


def test_seeded_determinism():
    g = torch.Generator().manual_seed(0)
    logits, drafts = torch.randn(16, 4, 300, generator=g), torch.randint(0, 300, (16, 3), generator=g)
    q = torch.softmax(torch.randn(16, 3, 300, generator=g), -1)
    a = rejection_sample(*args(logits, drafts, q, [3] * 16, 1.0, seed=5, offset=1))
    b = rejection_sample(*args(logits, drafts, q, [3] * 16, 1.0, seed=5, offset=1))
    c = rejection_sample(*args(logits, drafts, q, [3] * 16, 1.0, seed=5, offset=2))
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])


@pytest.mark.parametrize("stochastic", [True, False])
def test_output_distribution_equals_target(stochastic):
    assert_sampler_matches_target(rejection_sample, stochastic, DEVICE, seed=3)


@pytest.mark.parametrize("B,V,splits", [(1, 151936, 5), (33, 100, 3), (2, 50257, 4), (1, 17, 2)])
@pytest.mark.parametrize("stochastic", [True, False])
def test_vocab_split_path_gives_the_same_tokens(B, V, splits, stochastic):
    """The small-batch path (each row's vocab split across programs, two-pass reductions)
    against the one-kernel path and the reference, on the same random numbers; V not a
    multiple of the tile or of the split count, ragged num_draft, mixed greedy rows."""
    g = torch.Generator().manual_seed(B * V)
    K = 3
    logits = torch.randn(B, K + 1, V, generator=g) * 3
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1) if stochastic else None
    drafts = torch.randint(0, V, (B, K), generator=g)
    drafts[:, 0] = logits[:, 0].argmax(-1)  # some rows accept a greedy draft
    nd = [(3, 2, 0, 1)[b % 4] for b in range(B)]
    for temp in (0.0, 0.8):
        a = args(logits, drafts, q, nd, temp, seed=3, offset=1)
        split_out, split_n = rejection_sample(*a, num_splits=splits, block_v=1024 if V > 1024 else None)
        one_out, one_n = rejection_sample(*a, num_splits=1)
        ref_out, ref_n = rejection_sample_ref(*a)
        assert torch.equal(split_out.cpu(), ref_out.cpu()) and torch.equal(split_n.cpu(), ref_n.cpu())
        assert torch.equal(one_out.cpu(), ref_out.cpu())
