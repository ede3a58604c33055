"""The fused commit (kernels/commit_tokens.py) against its torch reference, and the reference
against a plain Python loop over rows and tokens: odd widths, rows that keep nothing,
finished rows at the end of their capacity, a row view of a larger buffer, strided drafts."""
import pytest
import torch
from helpers.ops import DEVICE

from specengine.kernels.commit_tokens import commit_tokens_ref

pytest.importorskip("triton")
from specengine.kernels.commit_tokens import commit_tokens  # noqa: E402

pytestmark = pytest.mark.triton  # a Triton kernel against its reference: `make gpu-rehearsal` runs these


def case(B, W, S=24, seed=0):
    """A buffer and a round's output: active rows keep n_new ≤ W tokens within capacity; one
    finished row (when B > 1) sits at the last slot, where its positions clamp."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 1000, (B, S), generator=g)
    n = torch.randint(1, S - W + 1, (B,), generator=g)
    active = torch.rand(B, generator=g) < 0.7
    active[0] = True
    if B > 1:
        n[-1], active[-1] = S - 1, False
    n_new = torch.randint(0, W + 1, (B,), generator=g).to(torch.int32)
    out = torch.randint(1000, 2000, (B, W), generator=g)
    offset = torch.randint(0, 50, (B,), generator=g)
    return [t.to(DEVICE) for t in (tokens, n, offset, active, out, n_new)]


def by_loop(tokens, n, offset, active, out, n_new):
    tokens, n, offset = tokens.clone(), n.clone(), offset.clone()
    for b in range(tokens.shape[0]):
        if active[b]:
            for j in range(int(n_new[b])):
                tokens[b, min(int(n[b]) + j, tokens.shape[1] - 1)] = out[b, j]
            n[b] += int(n_new[b])
        offset[b] += 1
    return tokens, n, offset


@pytest.mark.parametrize("B,W", [(1, 1), (1, 4), (3, 2), (5, 7), (4, 9)])
def test_reference_is_the_loop_and_the_kernel_is_the_reference(B, W):
    args = case(B, W, seed=B * 10 + W)
    want = by_loop(*args)
    ref = [t.clone() for t in args]
    commit_tokens_ref(*ref)
    got = [t.clone() for t in args]
    commit_tokens(*got)
    for w, r, k, name in zip(want, ref[:3], got[:3], ("tokens", "n", "offset")):
        assert torch.equal(r, w), f"reference {name}"
        assert torch.equal(k, w), f"kernel {name}"
    assert torch.equal(got[3], args[3]) and torch.equal(got[4], args[4])  # inputs untouched


def test_a_row_view_of_a_larger_buffer_and_strided_drafts():
    """The driver commits through row views (rows past the last live one sit a round out);
    the sampler may hand a column slice."""
    tokens, n, offset, active, out, n_new = case(5, 6, seed=7)
    wide = torch.cat([out, out + 500], 1)[:, ::2]  # a strided [5,6] view
    want = by_loop(tokens[:3], n[:3], offset[:3], active[:3], wide[:3], n_new[:3])
    before = tokens.clone(), n.clone(), offset.clone()
    commit_tokens(tokens[:3], n[:3], offset[:3], active[:3], wide[:3], n_new[:3])
    for full, w, b in zip((tokens, n, offset), want, before):
        assert torch.equal(full[:3], w) and torch.equal(full[3:], b[3:])


def test_bad_inputs_are_named():
    tokens, n, offset, active, out, n_new = case(3, 2)
    with pytest.raises(ValueError, match="n must be a unit-stride"):
        commit_tokens(tokens, n.to(torch.int32), offset, active, out, n_new)
    with pytest.raises(ValueError, match="active"):
        commit_tokens(tokens, n, offset, active.to(torch.int64), out, n_new)
    with pytest.raises(ValueError, match="tokens must be"):
        commit_tokens(tokens[:2], n, offset, active, out, n_new)
