"""Incremental detokenization: same text as a full decode, at O(new tokens) per push."""
import random

import pytest

from specengine.detokenize import IncrementalDetokenizer, find_stop, partial_stop

TEXT = "def f(x):\n    return x  # héllo 世界 🙂 龘 𝔘𝔫𝔦 🦜🪼 ꙮ naïve café\n"


def pushed(tokenizer, ids, seed=0):
    rng, d, pieces, i = random.Random(seed), IncrementalDetokenizer(tokenizer), [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        pieces.append(d.push(ids[i: i + n]))
        i += n
    pieces.append(d.flush())
    return d, pieces


def test_pieces_join_to_the_full_decode(tokenizer):
    ids = tokenizer.encode("def add(a, b):\n    return a + b")
    for seed in range(5):
        d, pieces = pushed(tokenizer, ids, seed)
        assert "".join(pieces) == d.text == tokenizer.decode(ids, skip_special_tokens=True)


class CountingTokenizer:
    def __init__(self, inner):
        self.inner, self.decoded = inner, 0

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.inner.decode(ids, **kw)


def test_work_per_push_does_not_grow_with_the_text(tokenizer):
    counting = CountingTokenizer(tokenizer)
    d = IncrementalDetokenizer(counting)
    ids = tokenizer.encode("abc def " * 100)
    for t in ids:
        d.push([t])
    assert d.text == tokenizer.decode(ids, skip_special_tokens=True)
    assert counting.decoded < 6 * len(ids)  # re-decoding the whole text each push: ~len^2 / 2


def test_find_stop_looks_at_the_new_tail_only():
    assert find_stop("abc STOP", ["STOP"], 0) == 4
    assert find_stop("abc STOP", ["STOP"], 5) == 4  # a stop that straddles the old end
    assert find_stop("abc STOP def", ["x", "def"], 9) == 9
    assert find_stop("abc", [], 0) is None and find_stop("abcabc", ["zz"], 2) is None


def test_partial_stop_is_the_tail_to_hold_back():
    assert partial_stop("abc ST", ["STOP"]) == 2 and partial_stop("abc S", ["STOP", "SX"]) == 1
    assert partial_stop("abc", ["STOP"]) == 0 and partial_stop("abc", []) == 0


def test_stream_with_a_stop_string_equals_generate(tiny_dir):
    from specengine import Engine

    eng = Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), device="cpu", max_seq_len=256, dtype="float32")
    full = eng.generate("q", max_new_tokens=30, ignore_eos=True, method="ar")
    stop = full.text[7:9]
    ref = eng.generate("q", max_new_tokens=30, ignore_eos=True, stop=[stop], method="sd", gamma=3)
    streamed = "".join(eng.stream("q", max_new_tokens=30, ignore_eos=True, stop=[stop], method="sd", gamma=3))
    assert ref.finish_reason == "stop" and streamed == ref.text == full.text[: full.text.index(stop)]


@pytest.mark.real
def test_byte_level_bpe_splits_characters_and_is_held_back():
    """Qwen's byte-level BPE splits CJK/emoji across tokens: no piece carries U+FFFD, and
    the pieces join to the full decode."""
    from transformers import AutoTokenizer

    from specengine.models.fetch import DEFAULT_DRAFT, fetch

    tok = AutoTokenizer.from_pretrained(fetch(DEFAULT_DRAFT))
    ids = tok.encode(TEXT)
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # the case under test really occurs
    for seed in range(5):
        d, pieces = pushed(tok, ids, seed)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True) == TEXT
        assert not any("\ufffd" in p for p in pieces)
