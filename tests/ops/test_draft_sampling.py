"""Draft sampling (kernels/draft_sampling.py) after the call's filter (`sampling.sample_draft`):
the kernel draws the reference's tokens on the same counter-based random numbers, q and
confidences to fp32 rounding (odd vocabularies, B = 1 and B = 33); on both backends the
tokens follow q."""
import pytest
import torch
from helpers.ops import BACKENDS, DEVICE, implementation

from specengine.methods.sampling import SamplingParams, sample_draft

pytestmark = pytest.mark.triton  # a Triton kernel against its reference: `make gpu-rehearsal` runs these


def sample_draft_fused(logits, params, seed, offset, pos):
    return sample_draft(logits, params, seed, offset, pos, implementation("draft_sample", "triton")[0])


def case(B, V, seed):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, V, generator=g) * 3).to(DEVICE)
    return logits, torch.arange(B, device=DEVICE) * 7 + seed, torch.tensor(3, device=DEVICE)


@pytest.mark.parametrize("B,V", [(1, 151936), (33, 100), (3, 50257), (1, 17)])
@pytest.mark.parametrize("params", [SamplingParams(0.0), SamplingParams(0.7, seed=1), SamplingParams(1.0, seed=2),
                                    SamplingParams(0.8, top_k=20, top_p=0.9, seed=3)])
def test_fused_draft_sampling_matches_reference(B, V, params):
    logits, seed, offset = case(B, V, V + B)
    for pos in (0, 1, 5):
        tok, q, conf = sample_draft_fused(logits, params, seed, offset, pos)
        ref_tok, ref_q, ref_conf = sample_draft(logits, params, seed, offset, pos)
        assert torch.equal(tok.cpu(), ref_tok.cpu()), (pos, tok, ref_tok)
        assert (q is None) == (ref_q is None) == params.greedy
        if q is not None:
            torch.testing.assert_close(q, ref_q, rtol=1e-4, atol=1e-7)  # exp and sum order: fp32 rounding
        torch.testing.assert_close(conf, ref_conf, rtol=1e-4, atol=1e-7)


def test_bf16_logits_and_a_strided_view():
    logits, seed, offset = case(4, 1000, 0)
    wide = torch.zeros(4, 2, 1000, device=DEVICE, dtype=torch.bfloat16)
    wide[:, 1] = logits.bfloat16()
    view = wide[:, 1]  # row stride 2000
    for params in (SamplingParams(0.0), SamplingParams(0.9, seed=4)):
        tok, _, _ = sample_draft_fused(view, params, seed, offset, 2)
        ref_tok, _, _ = sample_draft(view, params, seed, offset, 2)
        assert torch.equal(tok.cpu(), ref_tok.cpu())


@pytest.mark.parametrize("backend", BACKENDS)
def test_sampled_tokens_follow_q(backend):
    """Many rows of the same logits: the empirical distribution is q (chi-square-free check:
    total variation against q within a bound that holds with overwhelming probability)."""
    op, dev = implementation("draft_sample", backend)
    V, B = 6, 500  # the interpreter runs one program per row: keep B modest
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]], device=dev).expand(B, V).contiguous()
    tok, q, _ = sample_draft(logits, SamplingParams(1.0, seed=11), torch.arange(B, device=dev) + 11,
                             torch.tensor(0, device=dev), 0, op)
    freq = torch.bincount(tok.cpu(), minlength=V).double() / B
    tv = 0.5 * (freq - q[0].cpu().double()).abs().sum()
    assert tv < 0.12, tv  # E[TV] is about 0.04 at B = 500
