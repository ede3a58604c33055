"""A draft's blocks requantized for its role (models/requant.py): our Q4_0 quantizer is the `gguf`
package's bit for bit; the requantized draft shares every tensor it does not requantize; `sd` with it
gives the target's own greedy tokens (a plain loop over the target's blocks); the grid prices it
with its measured agreement and picks it only where it predicts more tokens per second; the switch
and its errors; the agreement is measured once."""
import numpy as np
import pytest
import torch
from conftest import make_tokenizer, save_tiny

from helpers.gguf_files import write_gguf
from specengine import Engine, SpecEngineError, draft_requant, precision
from specengine.models import requant
from specengine.models.config import ModelConfig
from specengine.models.decoder import Transformer
from specengine.models.gguf_weights import load_quantized
from specengine.models.quant_linear import QuantLinear, quant_layers
from specengine.runtime.kv_cache import KVCache
from helpers.cache import fresh_cache

gguf = pytest.importorskip("gguf")


QUANTIZERS = {"extension": requant.quantize_q4_0, "reference": requant.quantize_q4_0_ref}


@pytest.mark.parametrize("which", QUANTIZERS)
@pytest.mark.parametrize("rows,cols", [(1, 32), (7, 96), (16, 256)])
def test_q4_0_quantizer_is_the_gguf_packages(rows, cols, which):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, cols, generator=g) * torch.rand(rows, 1, generator=g) * 3
    x[0, :32] = 0.0  # an all-zero block: d = 0
    if rows > 1:
        x[1, :32] = torch.linspace(-1, 1, 32)  # equal magnitudes at both ends: the first one wins
        x[1, 32:64] = torch.linspace(1, -1, 32)  # and the other way round
        x[1, 40] = -5.0  # a negative peak
        x[1, 64:96] = 0.0
        x[1, 64:96:3] = -0.0  # zeros of both signs: d's sign from the first
    ours = QUANTIZERS[which](x)
    theirs = gguf.quants.quantize(x.numpy(), gguf.GGMLQuantizationType.Q4_0)
    assert np.array_equal(ours.numpy(), theirs)
    with pytest.raises(ValueError, match="whole blocks of 32"):
        QUANTIZERS[which](torch.zeros(1, 48))


def test_the_extensions_q4_0_quantizer_gives_the_references_bytes_on_many_blocks():
    """~10^5 blocks of several scales, values on a grid (x / d + 8.5 landing on whole numbers, where a
    fused multiply-add would round otherwise), and the halves and odd row counts: the same bytes."""
    assert requant._quantext is not None  # built in every install (CI's too)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(301, 1024, generator=g) * torch.logspace(-4, 2, 301).unsqueeze(1)
    x[::3] = (x[::3] * 4).round() / 4  # a coarse grid: many exact ties
    for rows in (x, x[:1, :32], x[5:8, :96]):
        assert torch.equal(requant.quantize_q4_0(rows), requant.quantize_q4_0_ref(rows))


@pytest.fixture(scope="module")
def blocks(tmp_path_factory):
    """(target, draft) tiny Qwen3 models as Q8_0 blocks; the draft is the target's weights perturbed."""
    path = tmp_path_factory.mktemp("requant")
    hf = save_tiny(path / "t", "qwen3", seed=11, scale=4.0, head_dim=32, tie_word_embeddings=False)
    write_gguf(hf, path / "t.gguf", "qwen3")
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for p in hf.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05 * p.abs().mean())
    write_gguf(hf, path / "d.gguf", "qwen3")
    cfg = ModelConfig.from_hf(hf.config)
    out = []
    for name in ("t.gguf", "d.gguf"):
        with torch.device("meta"):
            skeleton = Transformer(cfg)
        out.append(load_quantized(skeleton, path / name, torch.float32).eval())
    return out


def test_the_requantized_draft_holds_q4_0_and_shares_the_rest(blocks):
    _, draft = blocks
    small = requant.requantized(draft, progress=False)
    assert precision.setting_of(small) == requant.SETTING and precision.setting_of(draft) == precision.GGUF
    assert all(q == "Q8_0" for layer in quant_layers(draft) for q in layer.qtypes)  # the file's model unchanged
    assert all(q == "Q4_0" for layer in quant_layers(small) for q in layer.qtypes)
    assert small.embed_tokens.qweight is draft.embed_tokens.qweight  # lookups keep the file's rows
    assert small.norm.weight is draft.norm.weight
    before = sum(w.numel() for layer in quant_layers(draft) for _, w in layer.segments())
    after = sum(w.numel() for layer in quant_layers(small) for _, w in layer.segments())  # rows, unpadded
    assert after == pytest.approx(before * 18 / 34)
    for a, b in zip(quant_layers(draft), quant_layers(small)):  # the same weights, in 4 bits
        wa, wb = a.dequantized(), b.dequantized()
        assert (wa - wb).abs().max() <= wa.abs().max() / 7 and not torch.equal(wa, wb)


@torch.inference_mode()
def plain_greedy(model, ids: list[int], new: int) -> list[int]:
    """The target's greedy tokens by a plain loop: the whole sequence through the model each step."""
    out = list(ids)
    for _ in range(new):
        cache = KVCache.for_model(model, 1, len(out))
        out.append(int(model(torch.tensor([out]), cache)[0, -1].argmax()))
    return out[len(ids):]


@pytest.mark.parametrize("gamma", [3, "auto"])
def test_sd_with_the_requantized_draft_gives_the_targets_greedy_tokens(blocks, gamma):
    target, draft = blocks
    small = requant.requantized(draft, progress=False)
    tok = make_tokenizer()
    eng = Engine(target, tok, small, max_seq_len=128, gamma=gamma)
    for prompt in ("def f(x):", "abc abc abc", "x = [1"):
        ids = tok(prompt)["input_ids"]
        ref = plain_greedy(target, ids, 24)
        out = eng.generate(prompt, max_new_tokens=24, method="sd", ignore_eos=True)
        assert out.token_ids == ref
    if gamma == 3:  # (auto may rightly decode plainly: on models this small a draft step costs a target's)
        assert out.stats["acceptance_rate"] > 0  # the draft did propose what the target took


def test_the_grid_prices_the_requantized_draft_by_its_agreement(blocks, monkeypatch):
    """Half the draft's bytes: chosen while it agrees as often as the file's draft, not once it
    agrees far less (alpha scaled by the measured ratio); the choice names the agreement."""
    target, draft = blocks
    one_row = {"gguf": 0.04, requant.SETTING: 0.02, "bfloat16": 0.2}  # a draft step; a target's is 0.1

    def seconds(model, dtype, rows, progress=True):
        base = 0.1 if model is target else one_row[dtype]
        return {r: base * (1 + 0.1 * (r - 1)) for r in rows}

    monkeypatch.setattr(precision, "matmul_seconds", seconds)
    monkeypatch.setattr(precision, "one_row_floor", lambda model, dtype, progress=True: seconds(model, dtype, (1,))[1])
    for agree, chosen in ((0.6, requant.SETTING), (0.15, precision.GGUF)):
        monkeypatch.setattr(draft_requant, "agreement", lambda *a, **k: {"file": 0.6, "requantized": agree, "tokens": 9})
        quant = {"target": target, "draft": draft, "calibration": torch.arange(9)}
        given = dict(quant)
        choice = precision.choose(target, draft, "sd", quant=quant)
        assert choice["draft"] == chosen and choice["draft_agreement"]["requantized"] == agree
        assert quant == given  # the caller's dict is read, never written
        cells = {c["draft"]: c for c in choice["grid"] if c["method"] == "sd" and c["target"] == "gguf"}
        assert cells[requant.SETTING]["tokens_per_s"] != cells[precision.GGUF]["tokens_per_s"]


def test_the_switch_and_its_errors(blocks, monkeypatch):
    _, draft = blocks
    assert requant.offered(draft) and not requant.offered(requant.requantized(draft, progress=False))
    monkeypatch.setenv(requant.ENV, "off")
    assert not requant.offered(draft)
    monkeypatch.setenv(requant.ENV, "Q4_K")
    with pytest.raises(SpecEngineError, match="SPECENGINE_DRAFT_REQUANT must be one of auto, off, Q4_0"):
        requant.offered(draft)


def test_the_agreement_is_measured_once(blocks, monkeypatch, tmp_path):
    fresh_cache(monkeypatch, tmp_path)
    target, draft = blocks
    calls = []
    real = draft_requant._greedy
    monkeypatch.setattr(draft_requant, "_greedy", lambda m, ids: calls.append(m) or real(m, ids))
    built = []
    ids = torch.randint(0, 60, (40,), generator=torch.Generator().manual_seed(0))
    first = draft_requant.agreement(target, draft, lambda: built.append(1) or requant.requantized(draft, False),
                                    lambda: ids, False)
    assert len(calls) == 3 and built == [1] and 0 <= first["requantized"] <= 1 and first["tokens"] == 40
    again = draft_requant.agreement(target, draft, lambda: built.append(1), lambda: 1 / 0, False)
    assert again == first and len(calls) == 3 and built == [1]  # from the machine table: nothing run, built or tokenized
    assert isinstance(quant_layers(draft)[0], QuantLinear)
