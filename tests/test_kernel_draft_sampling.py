"""The fused draft-sampling kernel vs the torch reference (`sampling.sample_draft`):
the same tokens on the same counter-based random numbers, q and confidences to fp32
rounding; odd vocabularies (not a multiple of the tile), B = 1 and B = 33."""
import pytest
import torch
from conftest import DEVICE

from specengine.methods.sampling import SamplingParams, sample_draft

pytest.importorskip("triton")
from specengine.methods.sampling import sample_draft_fused  # noqa: E402


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


def test_sampled_tokens_follow_q():
    """Many rows of the same logits: the empirical distribution is q (chi-square-free check:
    total variation against q within a bound that holds with overwhelming probability)."""
    V, B = 6, 500  # the interpreter runs one program per row: keep B modest
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]], device=DEVICE).expand(B, V).contiguous()
    tok, q, _ = sample_draft_fused(logits, SamplingParams(1.0, seed=11), torch.arange(B, device=DEVICE) + 11,
                                   torch.tensor(0, device=DEVICE), 0)
    freq = torch.bincount(tok.cpu(), minlength=V).double() / B
    tv = 0.5 * (freq - q[0].cpu().double()).abs().sum()
    assert tv < 0.12, tv  # E[TV] is about 0.04 at B = 500
