"""A draft whose vocabulary is a prefix of a padded target's (Qwen2.5-0.5B -> 7B): accepted,
padded in place (models/vocab.py), never proposing a padded id, and lossless: greedy equals
ar for every method, sampling keeps the target's distribution (the target's padded ids
included), for float and GGUF-shaped heads alike."""
import copy

import pytest
import torch
from conftest import VOCAB, make_tokenizer, save_tiny, small_vocab_models
from helpers.exact import V, assert_sd_keeps_the_joint, exact_joint
from helpers.every_method import every_method, generate_tokens

from specengine import Engine
from specengine.models.loading import load_model
from specengine.models.quant_linear import QuantEmbedding, QuantLinear
from specengine.models.vocab import pad_vocab

PAD = 29  # the target's extra rows (152,064 - 151,936 = 128 in the real pair)
PROMPTS = ["def add(a, b):\n", "x = [1, 2"]


def truncated(model, size: int):
    """A copy of `model` whose vocabulary is its first `size` ids (what the smaller model of a
    padded family is to the larger, here with the same weights so drafts are often accepted)."""
    out = copy.deepcopy(model)
    emb = out.embed_tokens.weight.data[:size].clone()
    out.embed_tokens = torch.nn.Embedding.from_pretrained(emb, freeze=True)
    if out.config.tie_word_embeddings:
        out.lm_head.weight = out.embed_tokens.weight
    else:
        out.lm_head.weight = torch.nn.Parameter(out.lm_head.weight.data[:size].clone(), requires_grad=False)
    out.lm_head.out_features = out.config.vocab_size = size
    return out


@pytest.fixture(scope="module")
def padded_pair(tmp_path_factory):
    """(target dir with VOCAB + PAD rows, draft dir with VOCAB rows: the target's own first rows)."""
    from transformers import AutoModelForCausalLM

    tdir, ddir = tmp_path_factory.mktemp("padded_target"), tmp_path_factory.mktemp("prefix_draft")
    save_tiny(tdir, "qwen2", seed=3, scale=4.0, vocab=VOCAB + PAD)
    hf = AutoModelForCausalLM.from_pretrained(tdir)
    with torch.no_grad():  # perturbed a little: some drafts rejected
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05 * p.abs().mean())
    hf.resize_token_embeddings(VOCAB)
    hf.save_pretrained(ddir)
    make_tokenizer().save_pretrained(ddir)
    return tdir, ddir


@pytest.fixture(scope="module")
def engine(padded_pair):
    tdir, ddir = padded_pair
    return Engine.from_pretrained(str(tdir), draft=str(ddir), max_seq_len=128, dtype="float32")


def test_the_pair_is_accepted_and_the_draft_padded(engine):
    cfg = engine.draft.model.config
    assert (cfg.vocab_size, cfg.trained_vocab_size, cfg.own_vocab_size) == (VOCAB + PAD, VOCAB, VOCAB)
    assert engine.target.model.config.trained_vocab_size is None  # the target keeps its own distribution
    logits = engine.draft.model(torch.tensor([[5, 6]]), engine.draft.allocate(1, 16))
    assert logits.shape[-1] == VOCAB + PAD
    assert torch.isneginf(logits[..., VOCAB:]).all() and torch.isfinite(logits[..., :VOCAB]).all()
    assert float(torch.softmax(logits, -1)[..., VOCAB:].sum()) == 0.0  # q is exactly zero there


@pytest.fixture(scope="module")
def ar_ref(engine):
    return [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=30, method="ar", ignore_eos=True)]


@every_method
def test_every_method_gives_ar_tokens(engine, ar_ref, kw):
    tokens, accepted = generate_tokens(engine, PROMPTS, kw)
    assert tokens == ar_ref and accepted > 0


def test_a_target_emitting_its_padded_ids_is_followed_and_the_draft_never_proposes_them(padded_pair):
    """Target rows past the draft's range made likely: the target emits them (the draft embeds
    them as zeros), and no token the draft proposes for verification is past its own range,
    even sampling hot enough that an unmasked padded logit would be drawn."""
    tdir, ddir = padded_pair
    target, draft = load_model(tdir)[0], load_model(ddir)[0]
    with torch.no_grad():
        target.lm_head.weight[VOCAB + 3] = target.lm_head.weight[:VOCAB].mean(0) * 40  # a padded id that wins often
    eng = Engine(target, make_tokenizer(), draft, max_seq_len=128)
    verified = []
    real = eng.target.forward

    def spy(tokens, *a, **k):
        verified.append(tokens[:, 1:].clone())  # a verify's drafts follow the last committed token
        return real(tokens, *a, **k)
    eng.target.forward = spy
    ar = eng.generate(PROMPTS, max_new_tokens=20, method="ar", ignore_eos=True)
    assert any(t >= VOCAB for r in ar for t in r.token_ids), "the target never emitted a padded id"
    verified.clear()
    sd = eng.generate(PROMPTS, max_new_tokens=20, method="sd", gamma=3, ignore_eos=True)
    assert [r.token_ids for r in sd] == [r.token_ids for r in ar]
    eng.generate(PROMPTS * 8, max_new_tokens=20, method="sd", gamma=3, ignore_eos=True, temperature=8.0, seed=3)
    drafts = torch.cat([v.reshape(-1) for v in verified[len(PROMPTS):] if v.numel()])
    assert drafts.numel() > 100 and int(drafts.max()) < VOCAB


def test_gguf_shaped_layers_pad_with_zero_blocks():
    """A GGUF draft's embedding and (tied) head are block bytes: zero rows are zero values."""
    from specengine.models.config import ModelConfig

    g = torch.Generator().manual_seed(0)  # Q8_0 rows of 64 values: per 32, an fp16 scale and 32 int8
    blocks = torch.randint(0, 256, (40, 2, 34), generator=g, dtype=torch.uint8)
    blocks[..., :2] = (torch.rand(40, 2, generator=g) * 0.01 + 0.001).half().view(torch.uint8).reshape(40, 2, 2)
    blocks = blocks.reshape(40, 68)

    class M(torch.nn.Module):
        pass
    m = M()
    m.config = ModelConfig(40, 64, 128, 1, 4, 2, 16, 1e-6, False, True, 64, None)
    m.embed_tokens = QuantEmbedding("Q8_0", blocks, 64, torch.float32)
    m.lm_head = QuantLinear([("Q8_0", blocks)])
    pad_vocab(m, 48)
    assert m.embed_tokens.qweight.shape[0] == 48 and m.lm_head.out_features == 48
    assert m.lm_head.segments()[0][1].data_ptr() == m.embed_tokens.qweight.data_ptr()  # still tied
    assert not m.lm_head.dequantized()[40:].any() and not m.embed_tokens(torch.tensor([45])).any()
    torch.testing.assert_close(m.lm_head.dequantized()[:40], QuantLinear([("Q8_0", blocks)]).dequantized())


def test_sampling_keeps_the_target_distribution_padded_ids_included(tmp_path, tokenizer):
    """V = 8 target, a 6-id draft: the joint of two sampled tokens matches the target's exact
    one (which gives ids 6 and 7 real mass), and the check fails with every draft accepted."""

    hf, target, full = small_vocab_models(tmp_path, V)
    draft = truncated(full, V - 2)
    eng = Engine(target, tokenizer, draft, max_seq_len=40)
    exact = exact_joint(hf, 1.0)
    assert exact.view(V, V)[V - 2:].sum() > 0.05  # the padded ids matter to the check
    assert_sd_keeps_the_joint(eng, exact)
