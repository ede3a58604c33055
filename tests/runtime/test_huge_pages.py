"""CPU weights held in 2 MiB pages (specengine/huge_pages.py): the same values, strides and sharing
in their new place, nothing left holding the old copies (the compiled layer stack rebuilt on the
new tensors), the same tokens, and pages the kernel really backs with huge ones where it offers them."""
import gc
import weakref

import pytest
import torch
from torch import nn

from specengine import Engine, huge_pages
from conftest import save_tiny
from helpers.gguf_files import write_gguf


class Tied(nn.Module):
    """A tied pair of linears, a buffer and a view of it, a transposed (non-contiguous) parameter."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a, self.b = nn.Linear(1024, 2048), nn.Linear(1024, 2048)
        self.b.weight = self.a.weight
        self.register_buffer("q", torch.randint(0, 255, (3000, 1000), dtype=torch.uint8, generator=g))
        self.part = nn.Module()
        self.part.register_buffer("v", self.q[10:20, 3:7])
        self.t = nn.Parameter(torch.randn(64, 32, generator=g).t(), requires_grad=False)


@pytest.fixture
def enabled():
    before = huge_pages._enabled
    huge_pages.enable(True)
    yield
    huge_pages.enable(before)


def test_held_weights_keep_their_values_strides_and_sharing(enabled):
    m = Tied()
    x = torch.randn(3, 1024)
    before = {n: t.clone() for n, t in list(m.named_parameters()) + list(m.named_buffers())}
    strides = {n: t.stride() for n, t in list(m.named_parameters()) + list(m.named_buffers())}
    ya, yb = m.a(x), m.b(x)
    if huge_pages.support() is not None:  # a kernel without THP: nothing moves, and the plan says why
        assert huge_pages.hold(m) is None and "why_not" in huge_pages.report(m)
        return
    moved = huge_pages.hold(m)
    assert moved["bytes"] >= sum(t.nbytes for t in before.values()) - m.part.v.nbytes - m.b.weight.nbytes
    assert huge_pages.held(m) and huge_pages.report(m)["bytes"] == moved["bytes"]
    now = dict(list(m.named_parameters()) + list(m.named_buffers()))
    for name, t in before.items():
        assert torch.equal(now[name], t) and now[name].stride() == strides[name], name
    assert m.b.weight is m.a.weight and isinstance(m.a.weight, nn.Parameter)
    assert m.part.v.untyped_storage().data_ptr() == m.q.untyped_storage().data_ptr()  # still a view of q
    assert torch.equal(m.a(x), ya) and torch.equal(m.b(x), yb)
    assert huge_pages.hold(m) is None  # held already


def test_the_kernel_backs_held_weights_with_huge_pages(enabled):
    if huge_pages.support() is not None:
        assert huge_pages.hold(Tied()) is None
        return
    for _ in range(3):  # large frees raise glibc's mmap threshold: its next blocks reuse touched small pages
        x = torch.ones(30 << 20, dtype=torch.uint8)
        del x
    m = Tied()
    base = huge_pages.huge_bytes()
    huge_pages.hold(m)
    assert huge_pages.huge_bytes() > base  # THP may fall back on fragmented memory, but not for every span


def test_a_refused_block_leaves_the_weights_where_they_are(enabled, monkeypatch):
    def refuse(nbytes):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(huge_pages, "_block", refuse)
    m = Tied()
    before = m.a.weight
    assert huge_pages.hold(m) is None and m.a.weight is before and not huge_pages.held(m)
    if huge_pages.support() is None:
        assert huge_pages.report(m)["why_not"].startswith("the kernel refused huge pages")
        assert not huge_pages.pending(m)
        monkeypatch.undo()  # the next model's hold is tried afresh: one refusal is not the process's
        other = Tied()
        assert huge_pages.pending(other) and huge_pages.hold(other) is not None and huge_pages.held(other)
        assert huge_pages.refused(other) is None and huge_pages.refused(m) is not None


def test_off_or_small_moves_nothing(enabled):
    huge_pages.enable(False)
    m = Tied()
    assert huge_pages.hold(m) is None and huge_pages.report(m) == {"why_not": "huge_pages=False"}
    huge_pages.enable(True)
    small = nn.Linear(64, 64)
    assert huge_pages.hold(small) is None and not huge_pages.held(small)


@pytest.fixture(scope="module")
def gguf_model(tmp_path_factory):
    """A Qwen3 of ~5 MB of Q8_0 blocks, loaded from its GGUF as blocks (the compiled layer stack runs it)."""
    pytest.importorskip("gguf")
    from specengine.models.config import ModelConfig
    from specengine.models.decoder import Transformer
    from specengine.models.gguf_weights import load_quantized

    path = tmp_path_factory.mktemp("huge")
    hf = save_tiny(path, "qwen3", seed=3, vocab_size=4096, hidden_size=256, intermediate_size=512,
                   num_hidden_layers=2, head_dim=32, tie_word_embeddings=False)
    write_gguf(hf, path / "m.gguf", "qwen3")
    with torch.device("meta"):
        skeleton = Transformer(ModelConfig.from_hf(hf.config))
    return load_quantized(skeleton, path / "m.gguf", torch.float32)


def test_an_engine_held_later_decodes_the_same_and_keeps_no_old_copy(gguf_model, tokenizer, enabled):
    """An engine built in small pages, then held (`set_cpu_matmul`, which every engine's start runs):
    its greedy tokens do not move, and no cache (the compiled layer stack) keeps the old tensors alive."""
    from specengine.models import cpu_stack

    eng = Engine(gguf_model, tokenizer, huge_pages=False)
    model = eng.target.model
    assert cpu_stack.stack_for(model) is not None  # the compiled stack runs it, holding its tensors
    assert "why_not" in eng.plan.pages["target"]
    want = eng.generate([5, 9, 2, 7], max_new_tokens=12, ignore_eos=True, method="ar").token_ids
    old = [weakref.ref(t.untyped_storage()) for t in list(model.parameters()) + list(model.buffers())]
    huge_pages.enable(True)
    eng.set_cpu_matmul("auto")
    gc.collect()
    assert huge_pages.held(model) and eng.plan.pages["target"]["bytes"] > 3 << 20
    assert not [r for r in old if r() is not None]  # every old copy freed
    got = eng.generate([5, 9, 2, 7], max_new_tokens=12, ignore_eos=True, method="ar").token_ids
    assert got == want
