"""The method interface: a new method is one class in the registry; the driver checks the
KV capacity once per round on the device."""
import pytest
import torch

from specengine import Engine, SpecEngineError, api, generation
from specengine.generation import headroom
from specengine.methods import METHODS
from specengine.methods.ar import AutoRegressive
from specengine.methods.base import Method


class Greedy2(AutoRegressive):
    """A toy method written against the interface only: ar, counting its own rounds."""
    name = "ar-counted"

    def begin(self, ctx, call):
        super().begin(ctx, call)
        self.rounds_seen = 0

    def after_round(self, n_acc, num_draft):
        self.rounds_seen += 1

    def stats(self, totals):
        return {"rounds_seen": self.rounds_seen}


def test_a_registered_method_runs_without_touching_the_driver(tiny_pair, tokenizer, monkeypatch):
    monkeypatch.setitem(METHODS, Greedy2.name, Greedy2)
    eng = Engine(tiny_pair[0], tokenizer, max_seq_len=64)
    ref = eng.generate("abc", max_new_tokens=9, method="ar", ignore_eos=True)
    out = eng.generate("abc", max_new_tokens=9, method="ar-counted", ignore_eos=True)
    assert out.token_ids == ref.token_ids and out.stats["rounds_seen"] == 9 and out.stats["method"] == "ar-counted"


def test_methods_declare_their_headroom(tiny_pair, tokenizer):
    eng = Engine(tiny_pair[0], tokenizer, draft=tiny_pair[2], max_seq_len=64)
    room = lambda method, **kw: headroom(eng.new_method(method, **kw), eng.target)  # noqa: E731
    assert room("ar") == 2  # one token, padded to its bucket, target + draft margin
    assert room("sd", gamma=3) == 2 * 4 and room("sd", gamma=5) == 2 * 8
    assert room("pearl", gamma=2) == 2 * 4
    assert all(issubclass(m, Method) for m in METHODS.values())


def test_a_round_writing_past_the_cache_is_caught_not_corrupting(tiny_pair, tokenizer, monkeypatch):
    eng = Engine(tiny_pair[0], tokenizer, draft=tiny_pair[2], max_seq_len=64)
    monkeypatch.setattr(api, "headroom", lambda method, target: 0)  # a miscounted method
    monkeypatch.setattr(generation, "headroom", lambda method, target: 0)
    prompt = list(range(5, 15))
    with pytest.raises(SpecEngineError, match="wrote past the KV cache"):
        eng.generate(prompt, max_new_tokens=64 - len(prompt), method="sd", gamma=5, ignore_eos=True)
    assert int(eng.target.cache.high_water) > 64  # recorded on the device, read in the round's sync
    assert eng.target.cache.kv.shape[3] == 64


def test_finished_rows_and_lengths_are_set_by_the_driver(tiny_pair, tokenizer):
    eng = Engine(tiny_pair[0], tokenizer, draft=tiny_pair[2], max_seq_len=128)
    gen, _ = eng._start(["abc", "defgh"], max_new_tokens=6, method="sd", gamma=3, ignore_eos=True)
    for _ in gen.rounds():
        n = gen.state.n
        assert torch.equal(eng.target.cache.lens.to(torch.int64), n - 1)  # the round invariant
        assert bool((eng.draft.cache.lens.to(torch.int64) <= n - 1).all())
