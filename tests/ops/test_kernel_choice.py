"""`Engine.warmup()`'s timed choice between cuBLAS and the fused few-row linears
(runtime/kernel_choice.py): what is measured, when, what the runner then runs, and that the choice
changes no token (the reference: an engine on the torch ops alone). On a GPU the timer is a graphed
step; here a stand-in timer decides, and the real timer runs eagerly on CPU tensors (Triton's
interpreter)."""
import copy
import functools
import types

import pytest
import torch

from specengine import Engine, api
from specengine.kernels import fused_linear as fl
from specengine.runtime import kernel_choice
from specengine.runtime.runner import ModelRunner

pytestmark = pytest.mark.interpreter  # the kernel on CPU tensors (conftest.py)
pytest.importorskip("triton")


def timer(kernel_share: float, calls: list | None = None):
    """A stand-in for `time_steps`: cuBLAS's step 1 ms, the kernel's `kernel_share` of it."""
    def time(runner, tables):
        assert set(tables) == {"torch", "triton"} and tables["triton"]["gemv"] == "triton"
        if calls is not None:
            calls.append(runner)
        return {"torch": 1e-3, "triton": kernel_share * 1e-3}
    return time


@pytest.fixture()
def runner(tiny_pair):
    return ModelRunner(copy.deepcopy(tiny_pair[2]), "torch", cuda_graphs=False)


def replaying(fn, pool, device):
    """A graph stand-in that runs its step again at each replay (the step writes the static outputs)."""
    return types.SimpleNamespace(replay=fn)


def test_only_gemv_left_to_auto_is_measured():
    assert kernel_choice.tables("torch") is None  # a bare choice names every op's, gemv's too
    both = kernel_choice.tables("torch,gemv=auto")
    assert both["torch"]["gemv"] == "torch" and both["triton"]["gemv"] == "triton"
    assert both["triton"]["attention"] == "torch"  # the rest of the spec as given
    assert kernel_choice.tables("auto")["triton"]["attention"] == "auto"
    assert kernel_choice.tables("auto,gemv=triton") is None and kernel_choice.tables("auto,gemv=torch") is None


@pytest.mark.parametrize("share,chosen", [(0.5, "triton"), (0.97, "triton"), (0.99, "torch"), (1.3, "torch")])
def test_the_runner_keeps_the_faster_by_the_margin(runner, share, chosen):
    got = kernel_choice.choose_gemv(runner, "torch,gemv=auto", timer=timer(share))
    assert got == {"chosen": chosen, "ms": {"torch": pytest.approx(1.0), "triton": pytest.approx(share)}}
    assert runner.ops.names["gemv"] == chosen and runner.ops.kernel("gemv") == (chosen == "triton")
    assert runner.ops.names["attention"] == "torch"


def test_nothing_is_measured_on_a_cpu_runner_or_where_gemv_is_named(runner):
    calls = []
    assert kernel_choice.choose_gemv(runner, "torch,gemv=auto") is None  # CPU, no timer: the kernel is Triton's
    assert kernel_choice.choose_gemv(runner, "torch,gemv=torch", timer=timer(0.1, calls)) is None
    assert kernel_choice.choose_gemv(runner, "torch,gemv=triton", timer=timer(9.0, calls)) is None
    assert calls == [] and runner.ops.names["gemv"] == "torch"


def test_a_kernel_that_fails_here_leaves_cublas_and_says_why(runner):
    def failing(runner, tables):
        raise RuntimeError("PTX .version 8.4 does not support .target sm_75\nmore")
    got = kernel_choice.choose_gemv(runner, "torch,gemv=auto", timer=failing)
    assert got["chosen"] == "torch" and runner.ops.names["gemv"] == "torch" and got["ms"] == {}
    assert got["why"] == "the timing failed: RuntimeError: PTX .version 8.4 does not support .target sm_75"


def test_a_switch_drops_the_graphs_captured_with_the_other_table(tiny_pair):
    runner = ModelRunner(copy.deepcopy(tiny_pair[2]), "torch", capture=replaying)
    runner.allocate(1, 64)
    assert runner.graphs is not None
    kernel_choice.choose_gemv(runner, "torch,gemv=auto", timer=timer(1.5))  # cuBLAS stays: its graphs too
    assert runner.graphs is not None
    kernel_choice.choose_gemv(runner, "torch,gemv=auto", timer=timer(0.5))
    assert runner.graphs is None and runner.ops.kernel("gemv")


def test_the_real_timer_times_both_tables_and_leaves_the_runner_as_it_was(tiny_pair):
    """Each table on a runner of its own, its step from a (stand-in) graph captured on first use."""
    runner = ModelRunner(copy.deepcopy(tiny_pair[2]), "torch", capture=replaying)
    runner.allocate(1, 64)
    buffer, before = runner._buffer, runner.ops
    seconds = kernel_choice.time_steps(runner, kernel_choice.tables("torch,gemv=auto"), rounds=1)
    assert set(seconds) == {"torch", "triton"} and all(0 < s < 60 for s in seconds.values())
    assert runner._buffer is buffer and runner.ops is before


@pytest.mark.slow
def test_warmup_chooses_per_model_and_the_tokens_stay_the_references(tiny_pair, tokenizer, monkeypatch):
    """Through the engine: warmup times both models (target first), the plan says what each runs, and
    sd / sampled sd / ar give the tokens of an engine on the torch ops alone."""
    prompts = ["def add(a, b):\n", "x = [1, 2"]
    calls = [dict(method="ar"), dict(method="sd", gamma=3), dict(method="sd", gamma=2, temperature=0.8, seed=3)]
    ref = Engine(copy.deepcopy(tiny_pair[0]), tokenizer, copy.deepcopy(tiny_pair[2]), max_seq_len=256,
                 kernels="torch", cpu_matmul="linear")
    want = [[r.token_ids for r in ref.generate(prompts, max_new_tokens=8, ignore_eos=True, **kw)] for kw in calls]
    engine = Engine(copy.deepcopy(tiny_pair[0]), tokenizer, copy.deepcopy(tiny_pair[2]), max_seq_len=256,
                    kernels="torch,gemv=auto", cpu_matmul="linear")
    engine.warmup()
    assert engine.kernel_choice == {} and engine.ops.names["gemv"] == "torch"  # a CPU engine: nothing timed
    timed = []
    monkeypatch.setattr(api, "choose_kernels", functools.partial(kernel_choice.choose_kernels, timer=timer(0.5, timed)))
    engine.warmup()
    assert timed == [engine.target, engine.draft]
    assert {role: c["chosen"] for role, c in engine.kernel_choice.items()} == {"target": "triton", "draft": "triton"}
    assert engine.plan.gemv == engine.kernel_choice and "few-row linears: fused kernel" in str(engine.plan)
    launched, real = [], fl._launch
    monkeypatch.setattr(fl, "_launch", lambda x2, *a, **k: launched.append(x2.shape[0]) or real(x2, *a, **k))
    got = [[r.token_ids for r in engine.generate(prompts, max_new_tokens=8, ignore_eos=True, **kw)] for kw in calls]
    assert launched and got == want
    engine.set_kernels("torch,gemv=auto")  # a new switch forgets the timed choice: cuBLAS until the next warmup
    assert engine.kernel_choice == {} and engine.ops.names["gemv"] == "torch"
