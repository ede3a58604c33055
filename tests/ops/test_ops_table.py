"""The one switch (`kernels`, kernels/ops.py): every op of both models and the samplers obeys
it, torch and Triton give identical tokens, bad values are refused naming the option, and
the references work where Triton is not installed."""
import os
import subprocess
import sys
from collections import Counter

import pytest
import torch
from helpers.launches import launch_class

from specengine import Engine, SpecEngineError
from specengine.kernels.ops import CPU_OPS, OPS, parse, resolve

pytest.importorskip("triton")
PROMPTS = ["def add(a, b):\n", "x = [1"]


@pytest.fixture(scope="module")
def engine(tiny_dir):
    return Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), max_seq_len=128, dtype="float32",
                                  kernels="torch")


def run(engine, kernels, **kw):
    engine.set_kernels(kernels)
    try:
        return [r.token_ids for r in engine.generate(PROMPTS, max_new_tokens=12, ignore_eos=True, **kw)]
    finally:
        engine.set_kernels("torch")


@pytest.fixture()
def launches(monkeypatch):
    """Names of the Triton kernels launched in this process (interpreter or JIT)."""
    seen, cls = Counter(), launch_class()
    real = cls.run

    def run_(self, *a, **k):
        seen[self.fn.__name__ if hasattr(self, "fn") else str(self)] += 1
        return real(self, *a, **k)

    monkeypatch.setattr(cls, "run", run_)
    return seen


@pytest.mark.interpreter
@pytest.mark.parametrize("method", ["ar", "sd"])
def test_identical_tokens_whatever_the_switch_greedy(engine, method):
    ref = run(engine, "torch", method=method, gamma=3)
    assert run(engine, "triton", method=method, gamma=3) == ref
    assert run(engine, "triton,attention=torch,rejection_sample=torch", method=method, gamma=3) == ref


@pytest.mark.interpreter
def test_identical_tokens_whatever_the_switch_seeded_sampling(engine):
    kw = dict(method="sd", gamma=2, temperature=0.9, top_k=30, seed=17)
    assert run(engine, "torch,rejection_sample=triton,draft_sample=triton", **kw) == run(engine, "torch", **kw)


@pytest.mark.interpreter
def test_every_op_obeys_the_switch(engine, launches):
    """kernels="torch" launches no Triton kernel at all (the fused-step ops included: the old
    per-backend options never reached them); "triton" launches one for every op."""
    run(engine, "torch", method="sd", gamma=2, temperature=0.9, seed=1)
    assert not launches, launches
    run(engine, "triton,gemv=torch", method="sd", gamma=2, temperature=0.9, seed=1)
    for kernel in ("_verify_attention_kernel", "_add_rms_norm_kernel", "_rope_kv_write_kernel",
                   "_silu_and_mul_kernel", "_draft_sample_kernel", "_commit_tokens_kernel"):
        assert launches[kernel] > 0, (kernel, launches)
    assert launches["_rejection_sample_kernel"] + launches["_split_stats_kernel"] > 0, launches
    assert "_fused_linear_kernel" not in launches, launches  # gemv=triton: test_fused_linear_program.py
    launches.clear()
    run(engine, "torch,silu_and_mul=triton", method="ar")
    assert set(launches) == {"_silu_and_mul_kernel"}, launches


def test_the_config_and_the_ops_say_what_runs(engine):
    engine.set_kernels("auto,attention=torch")
    try:
        expected = "triton" if torch.cuda.is_available() else "cpu"  # CI builds the CPU ops
        assert engine.config.kernels == "auto,attention=torch"
        assert engine.ops.names["attention"] == "torch" and engine.ops.names["add_rms_norm"] == expected
        assert engine.draft.normal_ops.names == engine.target.normal_ops.names
    finally:
        engine.set_kernels("torch")


@pytest.mark.parametrize("value,message", [
    ("flash", "choose from auto, torch, triton, cpu"), ("torch,norm=triton", "unknown op 'norm'"),
    ("torch,attention", "only the first item may be a bare choice"), (3, "kernels must be one of"),
    ({"attention": "cuda"}, "attention='cuda'")])
def test_bad_values_are_refused_naming_the_option(engine, value, message):
    with pytest.raises(SpecEngineError, match=message) as e:
        engine.set_kernels(value)
    assert e.value.param == "kernels"
    assert engine.config.kernels == "torch"


def test_the_old_backend_options_point_at_the_switch(tiny_dir):
    with pytest.raises(SpecEngineError, match="one option now: kernels="):
        Engine.from_pretrained(str(tiny_dir), attention_backend="torch")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only behaviour")
def test_triton_on_cpu_needs_the_interpreter(engine, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SpecEngineError, match="needs a CUDA device"):
        engine.set_kernels("torch,attention=triton")
    assert resolve("auto", "cpu").names == {op: "cpu" if op in CPU_OPS else "torch" for op in OPS}
    assert parse({"default": "triton", "attention": "torch"})["silu_and_mul"] == "triton"


def test_without_triton_the_references_run_and_kernels_are_refused(tmp_path):
    """A fresh process where `import triton` fails: the package and every reference import,
    auto takes torch, "triton" is refused naming what to install, a launcher says so too."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from specengine.kernels.ops import resolve, KernelChoiceError\n"
        "from specengine.kernels.silu_and_mul import silu_and_mul, silu_and_mul_ref\n"
        "assert 'triton' not in set(resolve('auto', 'cpu').names.values())\n"
        "x = torch.randn(2, 8); assert silu_and_mul_ref(x).shape == (2, 4)\n"
        "try:\n    resolve('triton', 'cpu'); print('accepted')\nexcept KernelChoiceError as e:\n    print(e)\n"
        "try:\n    silu_and_mul(x)\nexcept ImportError as e:\n    print(e)\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "needs Triton: pip install 'specengine[triton]'" in proc.stdout
    assert "silu_and_mul is a Triton kernel and Triton is not installed" in proc.stdout
