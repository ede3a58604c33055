"""Graph runner logic on CPU with a stand-in capture that freezes what a CUDA graph freezes;
real CUDA-graph replay vs eager is a `gpu` test.

The stand-in records the captured function once with `make_fx` (the aten ops it runs) and
replays the recording, never the Python closure. So, as in a real capture: every Python
value the function read (a length, a flag, a loop count) is frozen at capture; tensors it
did not allocate are read and written in place by identity (a tensor replaced after the
capture is not seen); a host sync (`.item()`, a tensor in an `if`) refuses to capture."""
import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from specengine import Engine
from specengine.runtime.graphs import batch_buckets, len_bucket, len_buckets, padded_width, q_bucket
from specengine.runtime.runner import ModelRunner


class FakeGraph:
    def __init__(self, fn):
        for _ in range(2):  # the warm-up passes cuda_capture runs before capturing
            fn()
        self.recording = make_fx(fn)()

    def replay(self):
        self.recording()


def fake_capture(fn, pool, device):
    return FakeGraph(fn)


def test_the_stand_in_freezes_what_a_cuda_graph_freezes():
    """The classic graph bugs show up on CPU: a host value read at capture, a tensor swapped
    after it, a host sync inside it."""
    state = {"scale": 2.0, "src": torch.ones(3)}
    out = torch.zeros(3)
    graph = fake_capture(lambda: out.copy_(state["src"] * state["scale"]), None, "cpu")
    state["scale"], state["src"] = 5.0, torch.full((3,), 7.0)  # a new value, a new tensor
    graph.replay()
    assert torch.equal(out, torch.full((3,), 2.0))  # the replay saw neither
    static = torch.ones(3)
    graph = fake_capture(lambda: out.copy_(static * 3), None, "cpu")
    static.fill_(4.0)  # written in place: the replay reads it
    graph.replay()
    assert torch.equal(out, torch.full((3,), 12.0))
    with pytest.raises(RuntimeError, match="_local_scalar_dense"):
        fake_capture(lambda: out.fill_(static.sum().item()), None, "cpu")


def test_buckets():
    assert [q_bucket(q) for q in (1, 2, 3, 5, 8, 9, 32)] == [1, 2, 4, 8, 8, 16, 32]
    assert q_bucket(33) is None and padded_width(33) == 33 and padded_width(5) == 8
    assert len_bucket(10, 4096) == 256 and len_bucket(300, 4096) == 512 and len_bucket(5000, 4096) == 4096
    assert batch_buckets(1) == (1,) and batch_buckets(6) == (1, 2, 4, 6)
    assert len_buckets(1000) == (256, 512, 1000) and len_buckets(128) == (128,)


@pytest.fixture()
def model(tiny_dir):
    from specengine.models.loading import load_model

    return load_model(tiny_dir)[0]


@pytest.mark.parametrize("Q", [1, 3, 5, 7, 16])
def test_padded_replay_equals_eager_and_leaves_committed_kv_alone(model, Q):
    g = torch.Generator().manual_seed(Q)
    prompt = torch.randint(0, model.config.vocab_size, (3, 20), generator=g)
    tokens = torch.randint(0, model.config.vocab_size, (3, Q), generator=g)
    eager_runner = ModelRunner(model, cuda_graphs=False)
    eager_runner.allocate(3, 128)
    eager_runner.prefill(prompt, torch.tensor([20, 7, 13]))
    lens = eager_runner.cache.lens.clone()
    eager = eager_runner.verify(tokens, attn_len=64)
    kv_eager = eager_runner.cache.kv.clone()

    runner = ModelRunner(model, max_batch=4, capture=fake_capture)  # batch 3 pads to the bucket 4
    runner.allocate(3, 128)
    graphs = runner.graphs
    assert graphs is not None and len(graphs.graphs) == 3 * 6 * 1  # batch 1,2,4 x Q buckets x one length
    assert runner.cache.batch == 3 and runner._buffer.batch == 4
    runner.prefill(prompt, torch.tensor([20, 7, 13]))
    got = runner.verify(tokens, attn_len=64)
    got2 = runner.verify(tokens, attn_len=64)  # a replay of the same graph
    assert graphs.replays == 2
    assert torch.allclose(got, eager, atol=1e-5) and torch.equal(got, got2)
    assert got.data_ptr() == graphs.logits.data_ptr()  # one shared logits buffer serves every graph
    for b in range(3):  # every position a real token wrote or the prefix holds: identical
        n = int(lens[b]) + Q
        assert torch.allclose(runner.cache.kv[:, :, b, :n], kv_eager[:, :, b, :n], atol=1e-6)


def test_fallbacks_run_eagerly(model):
    runner = ModelRunner(model, max_batch=2, capture=fake_capture)
    runner.allocate(1, 128)
    graphs, tokens = runner.graphs, torch.zeros(1, 3, dtype=torch.long)
    assert graphs.usable(tokens, None, False)
    tree = graphs.usable(tokens, torch.ones(1, 3, 3, dtype=torch.bool), False)  # trees: a graph of their own
    hidden = graphs.usable(tokens, None, True)  # hidden states too, captured on first use
    assert tree[3] and not tree[4] and hidden[4] and not hidden[3] and {tree, hidden} <= set(graphs.graphs)
    assert not graphs.usable(torch.zeros(1, 40, dtype=torch.long), None, False)  # above the buckets
    assert not graphs.usable(torch.zeros(3, 1, dtype=torch.long), None, False)  # above max_batch
    assert ModelRunner(model, cuda_graphs=False, capture=fake_capture).graphs is None
    assert not ModelRunner(model).use_graphs  # real capture needs CUDA


def test_graph_memory_is_bounded(model):
    V = model.config.vocab_size
    runner = ModelRunner(model, max_batch=2, capture=fake_capture, graph_memory_limit=2 * 2 * 4 * V * 4)
    runner.allocate(1, 64)
    # logits of (2 rows x 4 queries) fit the limit; 2 x 8 and above do not and run eagerly
    captured = {(b, q) for b, q, *_ in runner.graphs.graphs}
    assert (2, 4) in captured and (2, 8) not in captured and (1, 8) in captured
    assert all(b * q > 8 for b, q, *_ in runner.graphs.skipped)
    assert runner.graphs.memory_bytes >= runner.graphs.logits.nbytes


@pytest.mark.parametrize("method,gamma", [("ar", None), ("sd", 3), ("pearl", 3)])
def test_engine_tokens_identical_with_graph_runner(tiny_dir, method, gamma):
    eng = Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), max_seq_len=256, max_batch=2, dtype="float32")
    prompts = ["def add(a, b):\n", "x = [1"]
    ref = [r.token_ids for r in eng.generate(prompts, max_new_tokens=24, method=method, gamma=gamma, ignore_eos=True)]
    eng.set_cuda_graphs(True, capture=fake_capture)
    out = eng.generate(prompts, max_new_tokens=24, method=method, gamma=gamma, ignore_eos=True)
    assert [r.token_ids for r in out] == ref
    graphs = eng.target.graphs
    assert graphs.replays > 0 and len(graphs.graphs) == 2 * 6 * 1  # captured at the call's start
    eng.generate(prompts, max_new_tokens=4, method=method, gamma=gamma, ignore_eos=True)
    assert eng.target.graphs is graphs  # the same buffer: no new capture
    eng.set_cuda_graphs(False)
    assert eng.target.graphs is None


@pytest.mark.parametrize("method,gamma", [("ar", None), ("sd", 3)])
def test_lazy_graphs_capture_only_the_shapes_a_call_uses(tiny_dir, method, gamma):
    """lazy=True: nothing is captured at warm-up, each bucket when a step first needs it, and
    the tokens are the eager ones."""
    eng = Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), max_seq_len=256, max_batch=2, dtype="float32")
    prompts = ["def add(a, b):\n", "x = [1"]
    ref = [r.token_ids for r in eng.generate(prompts, max_new_tokens=24, method=method, gamma=gamma, ignore_eos=True)]
    eng.set_cuda_graphs(True, capture=fake_capture, lazy=True)
    out = eng.generate(prompts, max_new_tokens=24, method=method, gamma=gamma, ignore_eos=True)
    assert [r.token_ids for r in out] == ref
    graphs = eng.target.graphs
    q = 1 if method == "ar" else 4  # the target's one step shape: decode, or [last, d1..d3]
    assert set(graphs.graphs) == {(2, q, 256, False, False)} and graphs.replays > 0
    eng.set_cuda_graphs(True, capture=fake_capture)  # eager capture again: every bucket at warm-up
    eng.generate(prompts, max_new_tokens=4, method=method, gamma=gamma, ignore_eos=True)
    assert len(eng.target.graphs.graphs) == 2 * 6 * 1


class Counting(torch.nn.Module):
    """A graph model that counts its calls and computes what the model does."""

    def __init__(self, model):
        super().__init__()
        self.model, self.calls = model, 0

    def forward(self, *args, **kw):
        self.calls += 1
        return self.model(*args, **kw)


def replaying_capture(fn, pool, device):  # runs fn at replay: enough where nothing is frozen
    fn(), fn()
    return type("Replay", (), {"replay": staticmethod(fn)})()


def test_graph_model_runs_the_captured_steps_only(tiny_dir):
    """set_graph_model: captured steps run the given module (e.g. torch.compile of the model, the
    gpt-fast recipe inside our graphs), prefill and eager steps the model; tokens unchanged."""
    eng = Engine.from_pretrained(str(tiny_dir), max_seq_len=256, max_batch=1, dtype="float32")
    prompts = ["def add(a, b):\n"]
    ref = eng.generate(prompts, max_new_tokens=12, method="ar", ignore_eos=True)[0].token_ids
    counting = Counting(eng.target.model)
    eng.target.set_graph_model(counting)
    eng.generate(prompts, max_new_tokens=12, method="ar", ignore_eos=True)
    assert counting.calls == 0  # graphs off: every step eager, on the model
    eng.set_cuda_graphs(True, capture=replaying_capture, lazy=True)
    out = eng.generate(prompts, max_new_tokens=12, method="ar", ignore_eos=True)[0].token_ids
    assert out == ref and counting.calls == 2 + 12  # the stand-in capture's two runs, then a replay per token
    eng.target.set_graph_model(None)
    assert eng.target.graph_model is eng.target.model and eng.target.graphs is None


def test_compiled_graph_model_compiles_once_per_shape_used(tiny_dir):
    """The torch.compile peer (bench/gpu_e2e.py): with lazy graphs dynamo compiles one graph per
    shape the call uses, instead of meeting every warm-up bucket and hitting its recompile limit
    (after which it silently runs the model uncompiled). backend="eager": dynamo only, fast."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eng = Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), max_seq_len=256, max_batch=2, dtype="float32")
    prompts = ["def add(a, b):\n", "x = [1"]
    ref = [r.token_ids for r in eng.generate(prompts, max_new_tokens=10, method="sd", gamma=3, ignore_eos=True)]
    eng.target.set_graph_model(torch.compile(eng.target.model, backend="eager", dynamic=False, fullgraph=True))
    eng.set_cuda_graphs(True, capture=replaying_capture, lazy=True)
    out = eng.generate(prompts, max_new_tokens=10, method="sd", gamma=3, ignore_eos=True)
    assert [r.token_ids for r in out] == ref
    assert counters["stats"]["unique_graphs"] == len(eng.target.graphs.graphs) == 1
    assert not counters["unimplemented"] and not counters["graph_break"]
    torch._dynamo.reset()


GRAPHED_CALLS = [  # steps with a tree mask or hidden states: graphs of their own
    ("sd-tree", dict(method="sd", tree="2x3:5")),
    ("specdec++", dict(method="sd", policy="specdec++", gamma=4, threshold=0.5)),
    ("parallelspec-tree", dict(method="parallelspec", tree="2x2")),
    ("parallelspec-sampled", dict(method="parallelspec", gamma=3, temperature=0.8, seed=4)),
    ("pearl-parallel", dict(method="pearl", policy="parallel", gamma=3)),
]


@pytest.mark.parametrize("kw", [c[1] for c in GRAPHED_CALLS], ids=[c[0] for c in GRAPHED_CALLS])
def test_tree_and_hidden_state_steps_replay_graphs_with_eager_tokens(tiny_pair, tokenizer, kw):
    """Tree verification / tree drafting (the mask a static input, padded nodes seeing only
    themselves) and hidden-state forwards (SpecDec++: a static hidden output) run as graphs,
    captured on first use, with the eager tokens; 3 rows padded to the batch bucket 4."""
    from helpers.fakes import random_drafter
    from helpers.fakes import random_head

    target, _, draft = tiny_pair
    eng = Engine(target, tokenizer, draft, max_seq_len=256, max_batch=4,
                 acceptance_head=random_head(draft, seed=3, bias=1.0), parallel_drafter=random_drafter(draft, k_max=3))
    prompts = ["def add(a, b):\n", "x = [1", "for i in range(3"]
    ref = [r.token_ids for r in eng.generate(prompts, max_new_tokens=20, ignore_eos=True, **kw)]
    eng.set_cuda_graphs(True, capture=fake_capture, lazy=True)  # (every bucket at warm-up: tested above)
    out = eng.generate(prompts, max_new_tokens=20, ignore_eos=True, **kw)
    assert [r.token_ids for r in out] == ref
    runner = eng.draft if kw.get("policy") == "specdec++" else eng.target
    special = [k for k in runner.graphs.graphs if k[3] or k[4]]
    if kw["method"] == "parallelspec" or kw.get("policy") == "parallel":  # the drafter's forward too
        assert any(k[0] == "drafter" for k in eng.draft.graphs.graphs), list(eng.draft.graphs.graphs)
        special = special or kw["method"] == "pearl" or "tree" not in kw
    assert special and runner.graphs.replays > 0, list(runner.graphs.graphs)


@pytest.mark.parametrize("method", ["sd", "pearl"])
@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.8, seed=3), dict(temperature=1.0, top_k=5, seed=4)])
def test_whole_chain_draft_graph_gives_eager_tokens(tiny_pair, tokenizer, method, sampling):
    """The draft's whole chain as one (stand-in) graph: the same tokens as eager drafting, for a
    draft that disagrees with the target (rollbacks), 3 rows padded to the batch bucket 4,
    greedy and sampled; one chain graph per (batch, γ, length, sampling) key, replayed."""
    target, _, draft = tiny_pair
    eng = Engine(target, tokenizer, draft, max_seq_len=256, max_batch=4)
    prompts = ["def add(a, b):\n", "x = [1", "for i in range(3"]
    kw = dict(max_new_tokens=30, method=method, gamma=3, ignore_eos=True, **sampling)
    ref = [r.token_ids for r in eng.generate(prompts, **kw)]
    eng.set_cuda_graphs(True, capture=fake_capture, lazy=True)  # the target's verify buckets on first use
    out = eng.generate(prompts, **kw)
    chain = eng.draft._chain
    assert chain is not None and chain.replays > 0 and len(chain.graphs) >= 1
    # 3 rows pad to the batch bucket 4; once the last rows finish, rounds run on the first rows only
    assert (4, 3) in {k[:2] for k in chain.graphs} and all(k[1] == 3 for k in chain.graphs)
    assert [r.token_ids for r in out] == ref
    assert int(eng.draft._buffer.lens[3]) == 0  # the padding row is left at length 0
    eng.draft.chain_graph = False  # a graph per draft step instead: same tokens
    assert [r.token_ids for r in eng.generate(prompts, **kw)] == ref


def test_reallocated_cache_recaptures(model):
    runner = ModelRunner(model, capture=fake_capture)
    runner.allocate(1, 64)
    first = runner.graphs
    runner.allocate(1, 64)
    assert runner.graphs is first  # same buffer, same graphs
    runner.allocate(1, 128)  # new buffers: old graphs would read freed memory
    assert runner.graphs is not first and runner.graphs.max_seq_len == 128


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_compiled_graph_model_gives_eager_tokens(tiny_dir):
    """bench/gpu_e2e.py's torch.compile peer on a real GPU: inductor, fullgraph, torch attention,
    captured lazily in our graphs; the eager tokens, one dynamo graph per shape used."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    eng = Engine.from_pretrained(str(tiny_dir), device="cuda", max_seq_len=512, cuda_graphs=False, max_batch=2,
                                 kernels="auto,attention=torch,add_rms_norm=torch,rope_kv_write=torch,"
                                 "silu_and_mul=torch")
    prompts = ["def add(a, b):\n", "x = [1"]
    ref = [r.token_ids for r in eng.generate(prompts, max_new_tokens=24, method="ar", ignore_eos=True)]
    eng.target.set_graph_model(torch.compile(eng.target.model, dynamic=False, fullgraph=True))
    eng.set_cuda_graphs(True, lazy=True)
    out = eng.generate(prompts, max_new_tokens=24, method="ar", ignore_eos=True)
    assert [r.token_ids for r in out] == ref and eng.target.graphs.replays > 0
    assert counters["stats"]["unique_graphs"] == len(eng.target.graphs.graphs) == 1
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["ar", "sd", "pearl"])
def test_cuda_graph_replay_gives_eager_tokens(tiny_dir, method):
    eng = Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), device="cuda", max_seq_len=512,
                                 cuda_graphs=False, max_batch=2)
    prompts = ["def add(a, b):\n", "x = [1"]
    ref = [r.token_ids for r in eng.generate(prompts, max_new_tokens=40, method=method, gamma=3, ignore_eos=True)]
    eng.set_cuda_graphs(True)
    memory = eng.warmup(batch=2)
    out = eng.generate(prompts, max_new_tokens=40, method=method, gamma=3, ignore_eos=True)
    assert [r.token_ids for r in out] == ref and eng.target.graphs.replays > 0
    assert 0 < memory["target"] < 2 << 30
    if method == "sd":  # the draft ran as whole-chain graphs
        assert eng.draft._chain is not None and eng.draft._chain.replays > 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("sampling", [dict(), dict(temperature=0.8, seed=3)])
def test_cuda_whole_chain_draft_graph_gives_eager_tokens(tiny_pair, tokenizer, sampling):
    """A perturbed draft (rollbacks), 3 rows in the batch bucket 4, bf16: eager vs the chain graph."""
    import copy

    target, _, perturbed = (copy.deepcopy(m).to("cuda", torch.bfloat16) for m in tiny_pair)
    eng = Engine(target, tokenizer, perturbed, max_seq_len=512, max_batch=4, cuda_graphs=False)
    prompts = ["def add(a, b):\n", "x = [1", "for i in range(3"]
    kw = dict(max_new_tokens=40, method="sd", gamma=4, ignore_eos=True, **sampling)
    ref = [r.token_ids for r in eng.generate(prompts, **kw)]
    eng.set_cuda_graphs(True)
    assert [r.token_ids for r in eng.generate(prompts, **kw)] == ref
    assert eng.draft._chain.replays > 0 and int(eng.draft._buffer.lens[3]) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kw", [c[1] for c in GRAPHED_CALLS], ids=[c[0] for c in GRAPHED_CALLS])
def test_cuda_tree_and_hidden_state_graphs_give_eager_tokens(tiny_pair, tokenizer, kw):
    import copy

    from helpers.fakes import random_drafter
    from helpers.fakes import random_head

    target, _, draft = (copy.deepcopy(m).to("cuda") for m in tiny_pair)
    eng = Engine(target, tokenizer, draft, max_seq_len=512, max_batch=4, cuda_graphs=False,
                 acceptance_head=random_head(draft, seed=3, bias=1.0), parallel_drafter=random_drafter(draft, k_max=3))
    prompts = ["def add(a, b):\n", "x = [1", "for i in range(3"]
    ref = [r.token_ids for r in eng.generate(prompts, max_new_tokens=30, ignore_eos=True, **kw)]
    eng.set_cuda_graphs(True)
    assert [r.token_ids for r in eng.generate(prompts, max_new_tokens=30, ignore_eos=True, **kw)] == ref
    runner = eng.draft if kw.get("policy") == "specdec++" else eng.target
    assert runner.graphs.replays > 0
    if kw["method"] == "parallelspec" or kw.get("policy") == "parallel":
        assert any(k[0] == "drafter" for k in eng.draft.graphs.graphs)


def _scaled_sum(x, y, k: int):
    return x * k + y.sum(), (x > 0).sum()


def test_graphed_calls_replay_pure_functions_per_shape_and_key(model):
    """ModelRunner.graphed: captured once per (name, function, shapes, non-tensor args); each
    call sees its own inputs; outputs are copies (the next replay does not change them);
    with graphs off it is a direct call."""
    runner = ModelRunner(model, cuda_graphs=False)
    x = torch.tensor([1.0, -2.0, 3.0])
    assert runner.graphed("f", _scaled_sum, x, torch.ones(2), 2)[1] == 2 and runner._calls is None
    runner.set_cuda_graphs(True, capture=fake_capture, lazy=True)
    first = runner.graphed("f", _scaled_sum, x, torch.ones(2), 2)
    second = runner.graphed("f", _scaled_sum, -x, torch.zeros(2), 2)
    assert torch.equal(first[0], x * 2 + 2) and int(first[1]) == 2  # not overwritten by the replay after it
    assert torch.equal(second[0], -x * 2) and int(second[1]) == 1
    runner.graphed("f", _scaled_sum, x, torch.ones(2), 3)  # a new constant: a new capture
    runner.graphed("f", _scaled_sum, torch.ones(4), torch.ones(2), 2)  # a new shape: a new capture
    assert len(runner._calls.entries) == 3 and runner._calls.replays == 4
    with pytest.raises(RuntimeError, match="_local_scalar_dense"):  # a host sync cannot be captured
        runner.graphed("g", lambda t: t * t.sum().item(), x)


def test_warmup_captures_every_chain_graph_a_greedy_call_replays(tiny_pair, tokenizer):
    """Engine.warmup captures the draft's whole-chain graphs of every γ and length bucket, so a
    greedy call after it captures none mid-round (a probe's captures cost it on an H200); tokens
    stay ar's. The stand-in capture counts."""
    from specengine.runtime import graphs

    target, _, perturbed = tiny_pair[:3]
    eng = Engine(target, tokenizer, draft=perturbed, max_seq_len=512, max_batch=1)
    eng.set_cuda_graphs(True, capture=replaying_capture)
    eng.warmup()
    chain = eng.draft.chain_graphs()
    assert chain is not None and len(chain.graphs) >= 8 * 2  # γ 1..8 at least, both length buckets
    before = graphs.captures()
    prompt = "def add(a, b):\n"
    ar = eng.generate(prompt, max_new_tokens=24, method="ar", ignore_eos=True).token_ids
    for kw in (dict(method="sd", gamma=3), dict(method="sd", gamma="auto"), dict(method="sd", gamma=8),
               dict(method="hybrid", gamma="auto")):
        assert eng.generate(prompt, max_new_tokens=24, ignore_eos=True, **kw).token_ids == ar, kw
    assert graphs.captures() == before
