"""The draft/target tokenizer check: ids compared over the draft's range, special tokens by id."""
import copy

import pytest
from conftest import make_tokenizer

from specengine.errors import SpecEngineError
from specengine.models.tokenizer_check import check_tokenizers


def swapped(tok, a: str, b: str):
    """The same tokenizer with tokens a and b trading ids: same size, different meaning."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = tok.get_vocab()
    vocab[a], vocab[b] = vocab[b], vocab[a]
    inner = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    inner.pre_tokenizer = tok.backend_tokenizer.pre_tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=inner, unk_token="<unk>", eos_token=tok.eos_token,
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])


def test_the_same_tokenizer_passes_and_a_padded_target_too():
    tok = make_tokenizer()
    check_tokenizers(tok, copy.deepcopy(tok), len(tok))
    check_tokenizers(tok, tok, len(tok) - 5)  # a draft with fewer rows: only its range is compared


def test_same_size_different_tokenizers_are_refused_naming_the_first_difference():
    tok = make_tokenizer()
    other = swapped(tok, "a", "b")
    assert len(other) == len(tok)
    first = min(tok.get_vocab()["a"], tok.get_vocab()["b"])
    with pytest.raises(SpecEngineError, match=f"differs from the target's at id {first}"):
        check_tokenizers(tok, other, len(tok))


def test_a_different_eos_is_refused():
    tok = make_tokenizer()
    other = copy.deepcopy(tok)
    other.eos_token = "<|im_end|>"
    with pytest.raises(SpecEngineError, match="special token 'eos_token'"):
        check_tokenizers(tok, other, len(tok))


def test_from_pretrained_refuses_a_draft_with_another_tokenizer(tiny_dir, tmp_path, monkeypatch):
    """A draft from other files is checked (its tokenizer loaded); one from the target's own files,
    or from a folder whose tokenizer files are byte for byte the target's, shares its tokenizer,
    loaded once."""
    import shutil

    from specengine import Engine, api

    loads = []
    real = api.load_tokenizer
    monkeypatch.setattr(api, "load_tokenizer", lambda path: loads.append(path) or real(path))

    draft = tmp_path / "draft"
    shutil.copytree(tiny_dir, draft)
    tok = make_tokenizer()
    swapped(tok, "x", "y").save_pretrained(draft)
    with pytest.raises(SpecEngineError, match="differs from the target's at id"):
        Engine.from_pretrained(str(tiny_dir), draft=str(draft), dtype="float32", max_seq_len=64)
    assert len(loads) == 2
    loads.clear()
    assert Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), dtype="float32", max_seq_len=64).draft
    assert len(loads) == 1
    twin = tmp_path / "twin"  # other weights' folder, the same tokenizer files
    shutil.copytree(tiny_dir, twin)
    loads.clear()
    assert Engine.from_pretrained(str(tiny_dir), draft=str(twin), dtype="float32", max_seq_len=64).draft
    assert len(loads) == 1
