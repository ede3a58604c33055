"""Engine backends: torch and Triton give identical tokens (greedy and seeded sampling)."""
import pytest
import torch

from specengine import Engine, SpecEngineError

pytest.importorskip("triton")
PROMPTS = ["def add(a, b):\n", "x = [1"]


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), max_seq_len=128, dtype="float32")


def run(engine, attention, sampler, **kw):
    engine.set_backends(attention, sampler)
    try:
        return [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=12, ignore_eos=True, **kw)]
    finally:
        engine.set_backends("torch", "torch")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_triton_on_cpu_needs_the_interpreter(engine, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SpecEngineError, match="needs a CUDA device"):
        engine.set_backends("triton", "torch")


@pytest.mark.parametrize("method", ["ar", "sd"])
def test_identical_tokens_across_backends_greedy(engine, method):
    ref = run(engine, "torch", "torch", method=method, gamma=3)
    assert run(engine, "triton", "triton", method=method, gamma=3) == ref
    assert run(engine, "triton", "torch", method=method, gamma=3) == ref


def test_identical_tokens_across_backends_seeded_sampling(engine):
    kw = dict(method="sd", gamma=2, temperature=0.9, top_k=30, seed=17)
    assert run(engine, "torch", "triton", **kw) == run(engine, "torch", "torch", **kw)


def test_backend_choice_and_errors(engine):
    engine.set_backends("auto", "auto")
    expected = "triton" if torch.cuda.is_available() else "torch"
    assert engine.attention_backend == expected and engine.sampler_backend == expected
    with pytest.raises(SpecEngineError, match="unknown attention backend"):
        engine.set_backends("flash", "torch")
    with pytest.raises(SpecEngineError, match="unknown sampler backend"):
        engine.set_backends("torch", "cuda")
    engine.set_backends("torch", "torch")
