"""Each memory pool's graphs are captured on a stream of their own (runtime/graphs.py,
`capture_stream`). torch keys the cuBLAS workspace a captured GEMM embeds by the capture
stream; PEARL replays the draft's graphs beside the target's, and with one shared capture
stream the two shared a workspace and the first concurrent round hung on an H200
(docs/design.md, "Experiments"). The CPU test stands in for the CUDA calls and
checks which stream each capture names; the CUDA test runs PEARL's concurrent rounds at widths
where cuBLAS splits K."""
import contextlib

import pytest
import torch

from specengine.runtime import graphs


class FakeStream:
    """torch.cuda.Stream's pool: POOL streams a priority, handed out round robin."""
    POOL, made = 4, 0

    def __init__(self, device=None, priority=0):
        FakeStream.made += 1
        self.id = FakeStream.made
        self.cuda_stream = (priority, FakeStream.made % FakeStream.POOL)  # the raw handle repeats

    def wait_stream(self, other):
        pass


def test_each_pool_captures_on_its_own_stream(monkeypatch):
    captures = []

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, stream=None, **kw):
        captures.append((pool, stream))
        yield

    monkeypatch.setattr(graphs, "_CAPTURE_STREAMS", {})
    monkeypatch.setattr(graphs, "_RESERVED", {})
    cuda = torch.cuda
    for name, value in [("Stream", FakeStream), ("current_stream", lambda device=None: FakeStream()),
                        ("stream", lambda s: contextlib.nullcontext()), ("device", lambda d: contextlib.nullcontext()),
                        ("CUDAGraph", lambda: object()), ("graph", fake_graph)]:
        monkeypatch.setattr(cuda, name, value)
    calls = []
    for pool in ("target", "draft", "target", "chain", "draft"):
        graphs.cuda_capture(lambda: calls.append(1), pool, "cuda:0")
    assert len(calls) == 5 * 3  # two warm-up calls and the capture, per graph
    stream_of = {}
    for pool, stream in captures:
        assert stream is not None, "a capture on torch's shared default capture stream"
        assert stream_of.setdefault(pool, stream) is stream  # a pool keeps its stream
    # and no two pools share one, though every capture's warm-up draws a stream from the same
    # round-robin pool in between (a stream object is new, its raw handle may not be)
    assert len({s.cuda_stream for s in stream_of.values()}) == 3
    side = graphs.dedicated_stream("cuda:0")  # PEARL's side stream: none of theirs either
    assert side.cuda_stream not in {s.cuda_stream for s in stream_of.values()}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pearl_concurrent_graph_rounds_finish_with_ar_tokens():
    """Two layers at the 1.5B/0.5B widths (skinny GEMMs with a long K, where cuBLAS splits K
    through its workspace): PEARL's concurrent graphed rounds end and give `ar`'s tokens. fp32:
    verifies of other widths give the same tokens only there (or in batch-invariant mode)."""
    from transformers import Qwen2Config

    from specengine import Engine
    from specengine.models.config import ModelConfig
    from specengine.models.decoder import Transformer

    def model(hidden, inter, heads, kv, seed):
        hf = Qwen2Config(vocab_size=32000, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=2,
                         num_attention_heads=heads, num_key_value_heads=kv, rms_norm_eps=1e-6, rope_theta=1e6)
        torch.manual_seed(seed)
        with torch.device("cuda"):
            m = Transformer(ModelConfig.from_hf(hf))
        with torch.no_grad():
            for p in m.parameters():
                p.normal_(0, 0.02)
        return m.to(torch.float32).eval()

    class NoTokenizer:
        eos_token_id, chat_template = None, None

        def decode(self, ids, **kw):
            return ""

    eng = Engine(model(1536, 8960, 12, 2, 0), NoTokenizer(), model(896, 4864, 14, 2, 1), max_seq_len=1024,
                 max_batch=1, batch_invariant=False)
    eng.set_cuda_graphs(True)
    prompt = torch.randint(100, 31000, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    kw = dict(max_new_tokens=48, ignore_eos=True)
    ref = eng.generate(prompt, method="ar", **kw).token_ids
    out = eng.generate(prompt, method="pearl", gamma=4, **kw)
    assert out.token_ids == ref and out.stats["concurrent"] and eng.draft._chain.replays > 0
