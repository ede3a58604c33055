"""Rejection sampling (kernels/rejection_sampling.py), each promise on both backends: the torch
reference on CPU and the Triton kernel (one-kernel and vocab-split paths) on DEVICE. Exact
greedy cases, seeded determinism, tokens in range, the target's distribution; the kernel
also draws exactly the reference's tokens on the same random numbers."""
import pytest
import torch
from conftest import assert_sampler_matches_target
from helpers.ops import BACKENDS, implementation, on_cpu_fewer

from specengine.kernels.rejection_sampling import rejection_sample_any, rejection_sample_greedy, rejection_sample_ref

pytestmark = pytest.mark.triton  # a Triton kernel against its reference: `make gpu-rehearsal` runs these


def args(logits, drafts, q, num_draft, temp, seed=0, offset=0, device="cpu"):
    B = logits.shape[0]
    t = lambda x, dt: torch.as_tensor(x, dtype=dt).to(device)  # noqa: E731
    return (logits.to(device), drafts.to(device), None if q is None else q.to(device),
            t(num_draft, torch.int32), torch.full((B,), float(temp), device=device),
            torch.arange(B, device=device) + seed, t(offset, torch.int64))


def peaked(targets, V=10):
    """Logits whose argmax at position i is targets[b][i]."""
    t = torch.tensor(targets)
    return torch.nn.functional.one_hot(t, V).float() * 5 + torch.randn(*t.shape, V) * 0.1


@pytest.fixture(params=BACKENDS)
def sampler(request):
    """(rejection_sample on this backend, its device)."""
    return implementation("rejection_sample", request.param)


def test_greedy_all_accept_first_reject_middle_reject_and_ragged(sampler):
    fn, dev = sampler
    drafts = torch.tensor([[1, 2, 3], [7, 2, 3], [1, 2, 9], [1, 2, 3], [5, 5, 5]])
    out, n = fn(*args(peaked([[1, 2, 3, 4]] * 5), drafts, None, [3, 3, 3, 1, 0], 0.0, device=dev))
    assert n.tolist() == [3, 0, 2, 1, 0]
    assert out.tolist() == [[1, 2, 3, 4], [1, -1, -1, -1], [1, 2, 3, -1], [1, 2, -1, -1], [1, -1, -1, -1]]


@pytest.mark.parametrize("K", [0, 1, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_all_greedy_shortcut_gives_the_general_paths_tokens(K, dtype):
    """CPU batches with every row greedy skip the softmax and random numbers: same tokens, ragged
    num_draft, drafts that match for a while, ties in bf16, out-of-range drafts."""
    g = torch.Generator().manual_seed(K)
    B, V = 6, 50
    logits = (torch.randn(B, K + 1, V, generator=g) * 3).to(dtype)
    best = logits.float().argmax(-1)
    drafts = torch.where(torch.rand(B, K, generator=g) < 0.8, best[:, :K], torch.randint(0, V, (B, K), generator=g))
    if K:
        drafts[0, 0] = V + 3  # out of range: never accepted unless the clamp's token is the argmax, in both
    call = args(logits, drafts, None, torch.randint(0, K + 1, (B,), generator=g), 0.0)
    fast, general = rejection_sample_greedy(call[0], call[1], call[3]), rejection_sample_any(*call)
    assert torch.equal(fast[0], general[0]) and torch.equal(fast[1], general[1])
    assert torch.equal(rejection_sample_ref(*call)[0], general[0])
    mixed = call[:4] + (torch.tensor([0.0] * (B - 1) + [1.0]),) + call[5:]  # one sampled row: the general path
    assert torch.equal(rejection_sample_ref(*mixed)[0], rejection_sample_any(*mixed)[0])


def test_no_drafts_is_plain_sampling(sampler):
    fn, dev = sampler
    out, n = fn(*args(peaked([[4], [6]]), torch.zeros(2, 0, dtype=torch.long), None, [0, 0], 0.0, device=dev))
    assert out.tolist() == [[4], [6]] and n.tolist() == [0, 0]


def test_seeded_determinism_and_seed_and_offset_sensitivity(sampler):
    fn, dev = sampler
    g = torch.Generator().manual_seed(0)
    logits, drafts = torch.randn(16, 5, 300, generator=g), torch.randint(0, 300, (16, 4), generator=g)
    q = torch.softmax(torch.randn(16, 4, 300, generator=g), -1)
    run = lambda seed, offset: fn(*args(logits, drafts, q, [4] * 16, 1.0, seed, offset, dev))  # noqa: E731
    a, b, c, d = run(7, 3), run(7, 3), run(8, 3), run(7, 4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0]) and not torch.equal(a[0], d[0])


@pytest.mark.parametrize("V", [100, 32000, 151936, 49157])
def test_tokens_in_range_for_large_and_odd_vocabs(sampler, V):
    fn, dev = sampler
    g = torch.Generator().manual_seed(V)
    B, K = 4, 3
    logits = torch.randn(B, K + 1, V, generator=g) * 3
    logits[:, :, V - 5:] = float("-inf")  # a filtered tail (top-k / top-p) must never be sampled
    drafts = torch.randint(0, V - 5, (B, K), generator=g)
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1)
    for temp in (0.0, 0.7):
        out, n = fn(*args(logits, drafts, q, [3, 2, 1, 0], temp, seed=V, device=dev))
        valid = out[out >= 0]
        assert valid.numel() == int((n.long() + 1).sum()) and bool((valid < V - 5).all())


@pytest.mark.parametrize("stochastic", [True, False])
def test_output_distribution_equals_target(sampler, stochastic):
    fn, dev = sampler
    assert_sampler_matches_target(fn, stochastic, dev, seed=3)


# interpreted: the real 151936 vocabulary runs in the split-path test below (and in range above)
@pytest.mark.parametrize("V", on_cpu_fewer([100, 32000, 151936, 50257], [100, 32000, 50257]))
@pytest.mark.parametrize("stochastic", [True, False])
def test_kernel_draws_the_references_tokens(V, stochastic):
    kernel, dev = implementation("rejection_sample", "triton")
    g = torch.Generator().manual_seed(V)
    B, K = 5, 4
    logits = torch.randn(B, K + 1, V, generator=g) * 3
    logits[:, :, V - 7:] = float("-inf")
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1) if stochastic else None
    drafts = torch.randint(0, V - 7, (B, K), generator=g)
    for temp in (0.0, 0.6, 1.0):
        a = args(logits, drafts, q, [4, 3, 2, 1, 0], temp, seed=9, offset=2, device=dev)
        out, n = kernel(*a)
        ref_out, ref_n = rejection_sample_ref(*a)
        assert torch.equal(out.cpu(), ref_out.cpu()) and torch.equal(n.cpu(), ref_n.cpu())


@pytest.mark.parametrize("B,V,splits", [(1, 151936, 5), (33, 100, 3), (2, 50257, 4), (1, 17, 2)])
@pytest.mark.parametrize("stochastic", [True, False])
def test_vocab_split_path_draws_the_references_tokens(B, V, splits, stochastic):
    """The small-batch path (each row's vocab split across programs, two-pass reductions)
    against the one-kernel path and the reference, on the same random numbers; V not a
    multiple of the tile or of the split count, ragged num_draft, mixed greedy rows."""
    kernel, dev = implementation("rejection_sample", "triton")
    g = torch.Generator().manual_seed(B * V)
    K = 3
    logits = torch.randn(B, K + 1, V, generator=g) * 3
    q = torch.softmax(torch.randn(B, K, V, generator=g), -1) if stochastic else None
    drafts = torch.randint(0, V, (B, K), generator=g)
    drafts[:, 0] = logits[:, 0].argmax(-1)  # some rows accept a greedy draft
    nd = [(3, 2, 0, 1)[b % 4] for b in range(B)]
    for temp in (0.0, 0.8):
        a = args(logits, drafts, q, nd, temp, seed=3, offset=1, device=dev)
        split_out, split_n = kernel(*a, num_splits=splits, block_v=1024 if V > 1024 else None)
        one_out, one_n = kernel(*a, num_splits=1)
        ref_out, ref_n = rejection_sample_ref(*a)
        assert torch.equal(split_out.cpu(), ref_out.cpu()) and torch.equal(split_n.cpu(), ref_n.cpu())
        assert torch.equal(one_out.cpu(), ref_out.cpu())
