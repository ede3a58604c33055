"""Graph runner logic on CPU with a stand-in capture that keeps the CUDA-graph contract
(static input/output buffers, replay recomputes into the same output); real CUDA-graph
replay vs eager is a `gpu` test."""
import pytest
import torch

from specengine import Engine
from specengine.graphs import GraphRunner, len_bucket, padded_width, q_bucket


class FakeGraph:
    def __init__(self, fn, static):
        self.fn, self.static = fn, static
        self.out = fn(static).clone()

    def replay(self):
        self.out.copy_(self.fn(self.static))


def fake_capture(fn, static, pool):
    g = FakeGraph(fn, static)
    return g, g.out


def test_buckets():
    assert [q_bucket(q) for q in (1, 2, 3, 5, 8, 9, 32)] == [1, 2, 4, 8, 8, 16, 32]
    assert q_bucket(33) is None and padded_width(33) == 33 and padded_width(5) == 8
    assert len_bucket(10, 4096) == 256 and len_bucket(300, 4096) == 512 and len_bucket(5000, 4096) == 4096


@pytest.fixture()
def model(tiny_dir):
    from specengine.loading import load_model

    return load_model(tiny_dir)[0]


@pytest.mark.parametrize("Q", [1, 3, 5, 7, 16])
def test_padded_replay_equals_eager_and_leaves_committed_kv_alone(model, Q):
    g = torch.Generator().manual_seed(Q)
    model.setup_cache(3, 128)
    prompt = torch.randint(0, model.config.vocab_size, (3, 20), generator=g)
    model.prefill(prompt, torch.tensor([20, 7, 13]))
    lens = model.cache.lens.clone()
    tokens = torch.randint(0, model.config.vocab_size, (3, Q), generator=g)
    kv_before = model.cache.kv.clone()
    eager = model.verify(tokens, attn_len=64)
    kv_eager = model.cache.kv.clone()
    model.cache.kv.copy_(kv_before)
    runner = GraphRunner(model, capture=fake_capture)
    model.graphs = runner
    try:
        got = model.verify(tokens, attn_len=64)
        got2 = model.verify(tokens, attn_len=64)  # a replay of the same graph
    finally:
        model.graphs = None
    assert runner.replays == 2 and len(runner.graphs) == 1
    assert torch.allclose(got, eager, atol=1e-5) and torch.equal(got, got2)
    for b in range(3):  # every position a real token wrote or the prefix holds: identical
        n = int(lens[b]) + Q
        assert torch.allclose(model.cache.kv[:, :, b, :n], kv_eager[:, :, b, :n], atol=1e-6)


def test_fallbacks_run_eagerly(model):
    model.setup_cache(1, 128)
    runner = GraphRunner(model, capture=fake_capture)
    tokens = torch.zeros(1, 3, dtype=torch.long)
    assert runner.usable(tokens, None, False)
    assert not runner.usable(tokens, torch.ones(1, 3, 3, dtype=torch.bool), False)  # trees: eager
    assert not runner.usable(tokens, None, True)  # hidden states: eager
    assert not runner.usable(torch.zeros(1, 40, dtype=torch.long), None, False)  # above the buckets
    assert not GraphRunner(model, enabled=False, capture=fake_capture).usable(tokens, None, False)
    assert not GraphRunner(model).usable(tokens, None, False)  # real capture needs CUDA tensors


@pytest.mark.parametrize("method,gamma", [("ar", None), ("sd", 3), ("pearl", 3)])
def test_engine_tokens_identical_with_graph_runner(tiny_dir, method, gamma):
    eng = Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), max_seq_len=256)
    prompts = ["def add(a, b):\n", "x = [1"]
    ref = [r.token_ids for r in eng.generate(prompts, max_new_tokens=24, method=method, gamma=gamma, ignore_eos=True)]
    eng.set_cuda_graphs(True, capture=fake_capture)
    out = eng.generate(prompts, max_new_tokens=24, method=method, gamma=gamma, ignore_eos=True)
    assert [r.token_ids for r in out] == ref
    assert eng.target.graphs.replays > 0
    assert len(eng.target.graphs.graphs) <= 4  # a few buckets serve the whole call
    eng.set_cuda_graphs(False)
    assert eng.target.graphs is None


def test_reallocated_cache_drops_graphs(model):
    model.setup_cache(1, 64)
    model.graphs = GraphRunner(model, capture=fake_capture)
    model.verify(torch.zeros(1, 2, dtype=torch.long))
    assert model.graphs.graphs
    model.setup_cache(2, 64)  # new buffers: old graphs would read freed memory
    assert not model.graphs.graphs
    model.graphs = None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["ar", "sd", "pearl"])
def test_cuda_graph_replay_gives_eager_tokens(tiny_dir, method):
    eng = Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), device="cuda", max_seq_len=512,
                                 cuda_graphs=False)
    prompts = ["def add(a, b):\n", "x = [1"]
    ref = [r.token_ids for r in eng.generate(prompts, max_new_tokens=40, method=method, gamma=3, ignore_eos=True)]
    eng.set_cuda_graphs(True)
    out = eng.generate(prompts, max_new_tokens=40, method=method, gamma=3, ignore_eos=True)
    assert [r.token_ids for r in out] == ref and eng.target.graphs.replays > 0
