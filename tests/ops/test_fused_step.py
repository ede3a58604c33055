"""The fused step: a launch budget per layer that cannot silently regress, the fused path's
tokens equal the reference path's (fp32, every method), bf16 within the kernels'
tolerance, batch-invariant mode still exact, and merged checkpoints loading by HF names.

The GPU op selection is forced on CPU (the engine's `kernels` switch set to "triton"): the
Triton kernels run under the interpreter, and the aten ops are the ones a CUDA step would
launch."""
import copy
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specengine import Engine
from specengine.runtime.runner import ModelRunner

pytestmark = pytest.mark.interpreter  # kernels on CPU tensors (conftest.py)

pytest.importorskip("triton")

from helpers.launches import NO_KERNEL  # noqa: E402

LAYER_BUDGET, REST_BUDGET = 10, 12
STEP_OPS = "add_rms_norm={0},rope_kv_write={0},silu_and_mul={0}"
FUSED = "torch," + STEP_OPS.format("triton")  # the fused step's kernels, everything else as on a CPU


class LaunchCounter(TorchDispatchMode):
    """Counts device kernels by where they run (a decoder layer, or the rest of the step):
    every aten op that is not a view/allocation, plus every Triton launch (the ops the
    interpreter itself runs inside a launch are not counted)."""

    def __init__(self, model):
        super().__init__()
        self.where, self.in_triton = "rest", False
        self.counts: Counter = Counter()
        self.ops: dict[str, list[str]] = {}
        self.hooks = []
        for i, layer in enumerate(model.layers):
            self.hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: self._enter(f"layer{i}")))
            self.hooks.append(layer.register_forward_hook(lambda m, a, o: self._enter("rest")))

    def _enter(self, where):
        self.where = where

    def count(self, name):
        self.counts[self.where] += 1
        self.ops.setdefault(self.where, []).append(name)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.in_triton and func.overloadpacket.__name__ not in NO_KERNEL:
            self.count(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def __exit__(self, *exc):
        for h in self.hooks:
            h.remove()
        return super().__exit__(*exc)


@pytest.fixture()
def count_triton(monkeypatch):
    """Route Triton launches through the active LaunchCounter."""
    from helpers.launches import launch_class

    InterpretedFunction = launch_class()  # noqa: N806 - the class whose `run` launches a kernel here

    state = {"counter": None}
    real = InterpretedFunction.run

    def run(self, *a, **k):
        counter = state["counter"]
        if counter is None or counter.in_triton:
            return real(self, *a, **k)
        counter.count("triton:" + self.fn.__name__)
        counter.in_triton = True
        try:
            return real(self, *a, **k)
        finally:
            counter.in_triton = False
    monkeypatch.setattr(InterpretedFunction, "run", run)
    return state


def step_launches(model, state, tokens, kernels="triton", prefill=20):
    # a plain copy: an engine built earlier on the shared model may have left a measured CPU plan on its
    # linears, and one that multiplies as (W xᵀ)ᵀ (cpu_matmul's wxt) returns a transposed output that
    # costs a copy no GPU step makes (an 11th launch in layer0, depending on which tests ran before)
    model = copy.deepcopy(model)
    runner = ModelRunner(model, kernels, cuda_graphs=False)
    runner.allocate(tokens.shape[0], 128)
    g = torch.Generator().manual_seed(0)
    runner.prefill(torch.randint(0, model.config.vocab_size, (tokens.shape[0], prefill), generator=g),
                   torch.full((tokens.shape[0],), prefill))
    with torch.no_grad(), LaunchCounter(model) as counter:
        state["counter"] = counter
        try:
            runner.verify(tokens, attn_len=64)
        finally:
            state["counter"] = None
    return counter


@pytest.mark.parametrize("Q", [1, 4])  # a decode step, a verify step
def test_launch_budget_per_layer(tiny_pair, count_triton, Q):
    model = tiny_pair[0]
    counter = step_launches(model, count_triton, torch.zeros(1, Q, dtype=torch.int64))
    per_layer = [counter.counts[f"layer{i}"] for i in range(len(model.layers))]
    assert max(per_layer) <= LAYER_BUDGET, counter.ops["layer0"]
    assert counter.counts["rest"] <= REST_BUDGET, counter.ops["rest"]
    assert per_layer[0] >= 6  # it counts: a layer launches at least its GEMMs and fused ops


@pytest.mark.parametrize("Q", [1, 4])
def test_the_fused_linears_take_a_layer_to_six_launches(tiny_pair, count_triton, Q):
    """gemv=triton (kernels/fused_linear.py): norm + qkv, RoPE + KV write, attention, o, norm + gate/up,
    silu-mul + down; the final norm rides in the LM head's launch."""
    model = tiny_pair[0]  # (step_launches counts a plain copy: an engine's CPU plans keep the unfused path)
    counter = step_launches(model, count_triton, torch.zeros(1, Q, dtype=torch.int64))
    assert [counter.counts[f"layer{i}"] for i in range(len(model.layers))] == [6] * len(model.layers), counter.ops
    assert counter.ops["layer0"].count("triton:_fused_linear_kernel") == 4
    unfused = step_launches(model, count_triton, torch.zeros(1, Q, dtype=torch.int64), kernels="triton,gemv=torch")
    assert unfused.counts["layer0"] == 9 and unfused.counts["rest"] == counter.counts["rest"] + 1


def test_the_unfused_reference_path_is_over_budget(tiny_pair, count_triton):
    """The counter can fail: the torch reference ops (the CPU path) launch far more."""
    model = tiny_pair[0]
    counter = step_launches(model, count_triton, torch.zeros(1, 1, dtype=torch.int64),
                            kernels="triton," + STEP_OPS.format("torch"))
    assert counter.counts["layer0"] > LAYER_BUDGET, counter.ops["layer0"]


PROMPTS = ["def add(a, b):\n", "x = [1, 2", "q"]
CALLS = [dict(method="ar"), dict(method="sd", gamma=3), dict(method="pearl", gamma=3), dict(method="sd", tree="2x3:5"),
         dict(method="parallelspec", gamma=3), dict(method="parallelspec", tree="2x2"),
         dict(method="sd", gamma=3, temperature=0.9, top_k=20, seed=5)]


@pytest.fixture(scope="module")
def engine(tiny_pair, tokenizer):
    from helpers.fakes import random_drafter

    target, _, draft = tiny_pair
    return Engine(target, tokenizer, draft, max_seq_len=256, parallel_drafter=random_drafter(draft, k_max=3))


@pytest.mark.parametrize("kw", CALLS, ids=[f"{c['method']}-{c.get('tree', c.get('temperature', ''))}" for c in CALLS])
def test_fused_path_gives_the_reference_paths_tokens_in_fp32(engine, kw):
    engine.set_kernels("torch")
    want = [r.token_ids for r in engine.generate(PROMPTS[:2], max_new_tokens=12, ignore_eos=True, **kw)]
    engine.set_kernels(FUSED)
    got = [r.token_ids for r in engine.generate(PROMPTS[:2], max_new_tokens=12, ignore_eos=True, **kw)]
    assert got == want


def test_bf16_fused_logits_within_tolerance(tiny_pair):
    model = copy.deepcopy(tiny_pair[0]).to(torch.bfloat16)
    tokens = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    out = {}
    for fused in (False, True):
        runner = ModelRunner(model, FUSED if fused else "torch", cuda_graphs=False)
        runner.allocate(2, 64)
        with torch.inference_mode():
            out[fused] = runner.verify(tokens)
    assert out[True].dtype == torch.float32
    torch.testing.assert_close(out[True], out[False], atol=0.1, rtol=0.05)
    assert (out[True].argmax(-1) == out[False].argmax(-1)).float().mean() > 0.9


def test_batch_invariant_mode_stays_exact_on_the_fused_path(tiny_pair, tokenizer):
    """bf16, fused ops (row-wise, so the probe still passes): sd == ar bit for bit."""
    target, _, draft = (copy.deepcopy(m).to(torch.bfloat16) for m in tiny_pair)
    eng = Engine(target, tokenizer, draft, max_seq_len=256, batch_invariant=True, invariant_width=8, kernels=FUSED)
    assert eng.ops.kernel("add_rms_norm") and eng.draft.ops.kernel("silu_and_mul")
    # one prompt, 16 tokens (a few rounds, accepted and rejected drafts): the interpreter makes each token costly
    ar = eng.generate(PROMPTS[0], max_new_tokens=16, method="ar", ignore_eos=True).token_ids
    sd = eng.generate(PROMPTS[0], max_new_tokens=16, method="sd", gamma=4, ignore_eos=True)
    assert sd.token_ids == ar and 0 < sd.stats["acceptance_rate"] < 1


def test_checkpoints_load_by_hf_names_into_merged_projections(tiny_dir):
    from safetensors.torch import load_file

    from specengine.models.loading import load_model

    model = load_model(tiny_dir)[0]
    hf = {k.removeprefix("model."): v for k, v in load_file(str(next(tiny_dir.glob("*.safetensors")))).items()}
    attn, mlp = model.layers[1].self_attn, model.layers[1].mlp
    assert torch.equal(attn.qkv_proj.weight, torch.cat([hf[f"layers.1.self_attn.{p}_proj.weight"] for p in "qkv"]))
    assert torch.equal(mlp.gate_up_proj.weight, torch.cat([hf["layers.1.mlp.gate_proj.weight"],
                                                           hf["layers.1.mlp.up_proj.weight"]]))
    assert [name for name, _ in attn.qkv_proj.parts] == ["q_proj", "k_proj", "v_proj"]


def test_split_checkpoint_hands_transformers_the_same_weights(tiny_dir):
    """split_checkpoint is the load's inverse (merged_homes): transformers loaded from it gives our
    logits (the benchmark's HF peers run the engine's own random weights this way)."""
    from transformers import AutoModelForCausalLM

    from specengine.models.loading import load_model
    from specengine.models.decoder import merged_homes, split_checkpoint

    model = load_model(tiny_dir)[0]
    hf = AutoModelForCausalLM.from_config(model.config.hf_config).eval()
    state = split_checkpoint(model)
    lm_head = state.pop("lm_head.weight")
    missing, unexpected = hf.model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    hf.lm_head.weight = torch.nn.Parameter(lm_head.clone())
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(2))
    runner = ModelRunner(model, cuda_graphs=False)
    runner.allocate(1, 32)
    with torch.inference_mode():
        torch.testing.assert_close(runner.verify(ids)[0], hf(ids).logits[0], atol=1e-4, rtol=1e-4)
    ours, homes = model.state_dict(), merged_homes(model)
    assert homes and all(torch.equal(state[part], ours[name][start:start + rows])
                         for part, (name, start, rows) in homes.items())
