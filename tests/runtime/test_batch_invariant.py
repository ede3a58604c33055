"""Batch-invariant mode: target forwards padded to one width with fixed-tile attention, so a
token's logits have the same bits however many tokens a forward carries (16-bit exactness)."""
import copy

import pytest
import torch

from specengine import Engine
from specengine.runtime import invariance
from specengine.errors import SpecEngineError
from specengine.kernels import row_attention
from specengine.kernels.verify_attention import verify_attention_ref, verify_attention_tiled
from specengine.runtime.runner import ModelRunner

# the CPU's fastest invariant attention: compiled per row where the extension is built
INVARIANT_CPU = "cpu-rows" if row_attention._EXT is not None else "torch-tiled"
PROMPTS = ["def f(x):", "import os\n", "a = [1, 2", "class B:", "for i in", "x = y +"]


@pytest.fixture()
def bf16_pair(tiny_pair):
    target, _, draft = tiny_pair
    return copy.deepcopy(target).to(torch.bfloat16), copy.deepcopy(draft).to(torch.bfloat16)


@pytest.mark.parametrize("tree", [False, True])
def test_tiled_attention_matches_the_reference_and_ignores_the_read_length(tree):
    g = torch.Generator().manual_seed(0)
    B, Q, Hq, Hkv, D, L = 2, 5, 4, 2, 16, 700
    q, k, v = (torch.randn(*s, generator=g) for s in ((B, Q, Hq, D), (B, L, Hkv, D), (B, L, Hkv, D)))
    lens = torch.tensor([300, 600], dtype=torch.int32)
    tm = None
    if tree:
        tm = torch.zeros(1, Q, Q, dtype=torch.bool)
        for i in range(Q):
            tm[0, i, i] = tm[0, i, 0] = tm[0, i, (i - 1) // 2 if i else 0] = True
    got = verify_attention_tiled(q, k, v, lens, tm, tile=64)
    assert torch.allclose(got, verify_attention_ref(q, k, v, lens, tm), atol=1e-5)
    # reading more of the cache (masked positions) changes no bit
    assert torch.equal(verify_attention_tiled(q, k[:, :610], v[:, :610], lens, tm, tile=64), got)


@pytest.mark.parametrize("padded", [False, True])
def test_a_rows_logits_are_bit_identical_at_every_width_and_position(bf16_pair, padded):
    """Logits of the token at sequence index n+j: decoded alone (width 1) vs verified at
    position j of blocks of width j+1..W; same bits with the mode on, whichever way the probe
    chose, and with padding forced."""
    target, _ = bf16_pair
    W = 6
    runner = ModelRunner(target, cuda_graphs=False)
    runner.invariance.set_width(W)
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(4, target.config.vocab_size, (1, 40), generator=g)
    n = 30

    def prefill():
        runner.allocate(1, 128)
        runner.prefill(seq[:, :n], torch.tensor([n]))

    prefill()
    if padded:
        runner.invariance.pad_width = W  # batch 1 is probed already: allocate keeps it
    alone = []
    for j in range(W):  # one token per forward
        alone.append(runner.decode(seq[:, n + j], attn_len=64)[0])
        runner.cache.set_lens(runner.cache.lens + 1)
    for width in range(1, W + 1):
        prefill()
        block = runner.verify(seq[:, n:n + width], attn_len=64)[0]
        for j in range(width):
            assert torch.equal(block[j], alone[j]), (width, j)
    with pytest.raises(SpecEngineError, match="invariant_width"):
        runner.verify(seq[:, n:n + W + 1])


class RowCountRounding:
    """A stand-in for a backend whose rounding depends on the row count (as oneDNN/AMX paths do
    on some CPUs; exaggerated so near-ties exist in a tiny model): single-row results are
    rounded to a coarser grid."""

    def __init__(self, module):
        self.fwd = module.forward

    def __call__(self, x):
        rows = x.numel() // x.shape[-1]
        y = self.fwd(x)
        return torch.round(y * 2) / 2 if rows == 1 else y


METHODS = [  # every method and drafting shape, with its options
    ("sd-2", dict(method="sd", gamma=2)), ("sd-5", dict(method="sd", gamma=5)), ("pearl", dict(method="pearl", gamma=3)),
    ("sd-tree", dict(method="sd", tree="2x3:5")), ("parallelspec", dict(method="parallelspec", gamma=3)),
    ("parallelspec-tree", dict(method="parallelspec", tree="2x2")),
    ("specdec++", dict(method="sd", policy="specdec++", gamma=4, threshold=0.5)),
]


@pytest.fixture()
def rounding_engines(bf16_pair, tokenizer):
    """(mode on, mode off) over a bf16 target whose lm_head rounds single-row results
    coarsely: a backend that makes speculation drift from ar unless the mode pads forwards."""
    from helpers.fakes import random_drafter
    from helpers.fakes import random_head

    target, draft = bf16_pair
    target.lm_head.forward = RowCountRounding(target.lm_head)
    kw = dict(max_seq_len=256, acceptance_head=random_head(draft, seed=3, bias=1.0),
              parallel_drafter=random_drafter(draft, k_max=3))
    on = Engine(target, tokenizer, draft, batch_invariant=True, invariant_width=8, **kw)
    assert on.target.invariance.pad_width == 8  # the probe found the row-count dependence: every forward padded
    return on, Engine(target, tokenizer, draft, batch_invariant=False, **kw)


@pytest.mark.parametrize("kw", [m[1] for m in METHODS], ids=[m[0] for m in METHODS])
def test_the_mode_makes_every_method_equal_ar_where_row_count_rounding_breaks_it(rounding_engines, kw):
    """With the mode on every method reproduces ar bit for bit; the same engine with the mode
    off drifts from ar on some prompt (so the check can fail)."""
    on, off = rounding_engines
    diverged = 0
    for p in PROMPTS:
        for eng in (on, off):
            ar = eng.generate(p, max_new_tokens=40, method="ar", ignore_eos=True).token_ids
            got = eng.generate(p, max_new_tokens=40, ignore_eos=True, **kw).token_ids
            if eng is on:
                assert got == ar, p
            else:
                diverged += got != ar
    assert diverged > 0  # without the mode the same backend makes the method drift from ar


def test_bad_options_and_capacity(bf16_pair, tokenizer):
    target, draft = bf16_pair
    with pytest.raises(SpecEngineError, match="batch_invariant"):
        Engine(target, tokenizer, draft, batch_invariant="yes")
    with pytest.raises(SpecEngineError, match="invariant_width"):
        Engine(target, tokenizer, draft, batch_invariant=True, invariant_width=0)
    eng = Engine(target, tokenizer, draft, max_seq_len=256, batch_invariant=True, invariant_width=4)
    ar = eng.generate("x", max_new_tokens=20, method="ar", ignore_eos=True).token_ids
    assert eng.generate("x", max_new_tokens=20, method="sd", gamma=6, ignore_eos=True).token_ids == ar
    assert eng.target.invariant_width == 7  # widened to the method's widest forward, and probed there
    eng.target.invariance.pad_width = 7
    with pytest.raises(SpecEngineError, match="invariant_width=7"):  # the runner's own guard
        eng.target.verify(torch.zeros(1, 8, dtype=torch.int64))


def test_auto_needs_no_timing_where_no_padding_is_needed(bf16_pair, tiny_pair, tokenizer, monkeypatch):
    """A backend whose kernels are row-count invariant (the probe passes unpadded) gets the mode
    on with no timing at all: exactness never hangs on a noisy timer."""
    target, draft = bf16_pair
    fp32 = Engine(tiny_pair[0], tokenizer, tiny_pair[2], batch_invariant="auto")
    assert not fp32.batch_invariant and fp32.batch_invariant_info["cost"] is None  # fp32: nothing to fix
    monkeypatch.setattr(invariance, "probe", lambda *a, **k: None)  # stand-in: invariant kernels
    monkeypatch.setattr(invariance.BatchInvariance, "cost", lambda self: pytest.fail("timed"))
    eng = Engine(target, tokenizer, draft, max_seq_len=256)  # "auto" is the default
    info = eng.batch_invariant_info
    assert eng.batch_invariant and info["pad_width"] is None and info["cost"] is None
    assert "no padding needed" in info["why"] and eng.ops.names["attention"] == INVARIANT_CPU


def test_auto_weighs_the_padding_cost_timed_until_stable(bf16_pair, tokenizer, monkeypatch):
    """Where padding is needed (a backend with row-count rounding), a timing decides: repeated
    until three agree, and the decision and its figures are in batch_invariant_info."""
    target, draft = bf16_pair
    target.lm_head.forward = RowCountRounding(target.lm_head)
    monkeypatch.setattr(invariance, "INVARIANT_MAX_COST", 1e9)
    cheap = Engine(target, tokenizer, draft, max_seq_len=256)
    info = cheap.batch_invariant_info
    assert cheap.batch_invariant and info["pad_width"] == 9 and info["cost"] > -1 and len(info["costs"]) >= 3
    assert info["cost"] in info["costs"] and "within" in info["why"]
    assert cheap.generate("x", max_new_tokens=2).stats["batch_invariant"] == info  # and in every call's stats
    with monkeypatch.context() as m:  # filed in the machine's table: the next load of these models reads it
        m.setattr(invariance.BatchInvariance, "cost", lambda self: pytest.fail("timed again"))
        again = Engine(target, tokenizer, draft, max_seq_len=256).batch_invariant_info
    assert (again["cost"], again["costs"]) == (info["cost"], info["costs"])
    monkeypatch.setattr(invariance, "INVARIANT_MAX_COST", -1.0)  # nothing is that cheap
    dear = Engine(target, tokenizer, draft, max_seq_len=256)
    assert not dear.batch_invariant and dear.ops.names["attention"] not in ("torch-tiled", "cpu-rows")
    assert dear.batch_invariant_info["cost"] is not None and "over" in dear.batch_invariant_info["why"]


def test_a_plan_mixing_paths_by_row_count_is_made_invariant_by_one_path_without_padding(bf16_pair, tokenizer,
                                                                                         monkeypatch):
    """bf16 on a CPU whose measured plan takes a BLAS path at one row and our `rows` kernel from two
    (the AVX2 EPYC's; here a stand-in path that rounds its one-row results coarsely): unpadded, a
    row's bits depend on how many rows share the call (the probe says so), so the mode puts every
    Linear on `rows` at every width instead of padding; every method then gives ar's tokens, and
    the mode off gives each Linear its own plan back. A plan set afterwards is probed again."""
    from specengine.models import cpu_matmul
    from specengine.models.cpu_matmul import Plan

    def coarse(x, w):
        return (torch.nn.functional.linear(x.float(), w.float()) * 4).round().div(4).to(x.dtype)

    monkeypatch.setitem(cpu_matmul.PATHS, "coarse", ("plain", coarse))
    target, draft = bf16_pair
    eng = Engine(target, tokenizer, draft, max_seq_len=256, batch_invariant=False)
    mixed = Plan("plain", ("rows", "coarse") + ("rows",) * 15)
    layers = cpu_matmul._linears(eng.target.model)
    for layer in layers:
        layer.use(mixed)
    shadow = eng.target.spawn(invariance.one_layer(eng.target.model))
    ops = eng.target.normal_ops.with_attention(*eng.target.normal_ops.invariant_attentions()[0])
    assert invariance.probe(shadow, (ops, None, None), 1, 8) is not None  # mixed paths: not invariant
    eng.set_batch_invariant(True, 8)
    info = eng.batch_invariant_info
    assert info["on"] and info["path"] == "rows" and info["pad_width"] is None, info
    assert all(layer.plan.by_rows == ("rows",) * 17 for layer in layers)
    assert "every Linear on `rows`" in str(eng.plan)  # what engine.plan says of the mode
    for p in PROMPTS[:3]:
        ar = eng.generate(p, max_new_tokens=24, method="ar", ignore_eos=True).token_ids
        for kw in (dict(method="sd", gamma=3), dict(method="pearl", gamma=3), dict(method="sd", tree="2x3:5")):
            assert eng.generate(p, max_new_tokens=24, ignore_eos=True, **kw).token_ids == ar, (p, kw)
    eng.set_batch_invariant(False)
    assert all(layer.plan is mixed for layer in layers) and eng.batch_invariant_info["path"] is None
    eng.set_batch_invariant(True, 8)  # on again; plain F.linear asked for meanwhile is what the mode off leaves
    probed, real_probe = [], invariance.probe
    monkeypatch.setattr(invariance, "probe", lambda *a, **k: probed.append(a[1]) or real_probe(*a, **k))
    eng.set_cpu_matmul("linear")  # a new plan: the mode decides again on the kernels it takes
    info = eng.batch_invariant_info
    assert probed and info["on"], info
    want = None if info["path"] is None else Plan("plain", ("rows",) * 17).by_rows
    assert all((layer.plan and layer.plan.by_rows) == want for layer in layers), info  # as the verdict says
    ar = eng.generate(PROMPTS[0], max_new_tokens=24, method="ar", ignore_eos=True).token_ids
    assert eng.generate(PROMPTS[0], max_new_tokens=24, method="sd", gamma=3, ignore_eos=True).token_ids == ar
    eng.set_batch_invariant(False)
    assert all(layer.plan is None for layer in layers)


def test_stable_cost_repeats_until_three_timings_agree():
    values = iter([0.30, -0.10, 0.05, 0.04, 0.05, 0.9])
    cost, costs = invariance.stable_cost(lambda: next(values), spread=0.02)
    assert costs == [0.30, -0.10, 0.05, 0.04, 0.05] and cost == 0.05
    noisy = iter([0.0, 1.0] * 10)
    cost, costs = invariance.stable_cost(lambda: next(noisy), spread=0.02, tries=7)
    assert len(costs) == 7 and cost == 0.0  # never stable: the median of the last three (0, 1, 0)


@pytest.mark.invariance_probe
def test_a_refused_probe_is_a_clear_error_or_a_recorded_fallback(bf16_pair, tokenizer):
    """Whatever the probe finds on this machine (CI also runs this with
    SPECENGINE_INVARIANT_PROBE=refuse): mode True either holds (sd == ar) or refuses with an
    error naming the mode; "auto" either holds or falls back off and records the refusal."""
    target, draft = bf16_pair
    try:
        on = Engine(target, tokenizer, draft, max_seq_len=256, batch_invariant=True, invariant_width=6)
    except SpecEngineError as e:
        assert "batch-invariant mode" in str(e) and "batch_invariant=False" in str(e)
        auto = Engine(target, tokenizer, draft, max_seq_len=256)
        assert not auto.batch_invariant and auto.batch_invariant_info["why"] == "the probe refused"
        assert "batch-invariant mode" in auto.batch_invariant_info["refused"]
        return
    ar = on.generate(PROMPTS[:2], max_new_tokens=16, method="ar", ignore_eos=True)
    sd = on.generate(PROMPTS[:2], max_new_tokens=16, method="sd", gamma=4, ignore_eos=True)
    assert [r.token_ids for r in sd] == [r.token_ids for r in ar]


class RowPositionNoise:
    """A backend no padding can fix: each row's result depends on its place in the input."""

    def __init__(self, module):
        self.fwd = module.forward

    def __call__(self, x):
        y = self.fwd(x)
        rows = torch.arange(x.numel() // x.shape[-1], dtype=y.dtype).reshape(*x.shape[:-1], 1)
        return y + 0.01 * rows


def test_a_backend_that_padding_cannot_fix_is_refused(bf16_pair, tokenizer):
    target, draft = bf16_pair
    target.lm_head.forward = RowPositionNoise(target.lm_head)
    with pytest.raises(SpecEngineError, match="even with every forward padded to 8 tokens"):
        Engine(target, tokenizer, draft, max_seq_len=256, batch_invariant=True, invariant_width=8)
    assert not Engine(target, tokenizer, draft, max_seq_len=256, batch_invariant="auto").batch_invariant


def test_each_batch_size_is_probed_once(bf16_pair, tokenizer, monkeypatch):
    target, draft = bf16_pair
    eng = Engine(target, tokenizer, draft, max_seq_len=256, batch_invariant=True, invariant_width=6)
    calls = []
    real = invariance.probe
    monkeypatch.setattr(invariance, "probe", lambda *a, **k: calls.append(a[2]) or real(*a, **k))
    prompts = PROMPTS[:3]
    ar = eng.generate(prompts, max_new_tokens=12, method="ar", ignore_eos=True)
    sd = eng.generate(prompts, max_new_tokens=12, method="sd", gamma=4, ignore_eos=True)
    assert [r.token_ids for r in sd] == [r.token_ids for r in ar]
    assert calls == [3]  # batch 1 was probed at construction, batch 3 on first use


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("graphs", [False, True])
def test_cuda_16bit_speculation_equals_ar_in_the_mode(tiny_pair, tokenizer, dtype, graphs):
    """On CUDA the mode always pads, with the fixed-split Triton attention when the probe passes
    (else the torch one); batch 2, perturbed draft, eager and graphs."""
    target, _, draft = (copy.deepcopy(m).to("cuda", dtype) for m in tiny_pair)
    eng = Engine(target, tokenizer, draft, max_seq_len=512, max_batch=2, cuda_graphs=graphs,
                 batch_invariant=True, invariant_width=8)
    assert eng.target.invariance.pad_width == 8 and eng.ops.names["attention"] in ("triton-fixed", "torch-tiled")
    for prompts in (PROMPTS[:2], PROMPTS[2:4], PROMPTS[4:]):
        ar = [r.token_ids for r in eng.generate(prompts, max_new_tokens=40, method="ar", ignore_eos=True)]
        for method, gamma in (("sd", 2), ("sd", 5), ("pearl", 3)):
            out = eng.generate(prompts, max_new_tokens=40, method=method, gamma=gamma, ignore_eos=True)
            assert [r.token_ids for r in out] == ar, (method, gamma)


def test_auto_covers_16_bit_and_quantized_targets_only():
    """GGUF-block layers quantize their activations to int8: fp32 alone no longer makes a row's
    tokens independent of its forward's width, so "auto" turns the mode on for them too."""
    from types import SimpleNamespace

    from torch import nn

    from specengine.models.quant_linear import QuantLinear
    from specengine.runtime.invariance import auto_reason

    blocks = torch.zeros(4, 34, dtype=torch.uint8)  # 4 rows of one Q8_0 block
    quant = nn.Sequential(nn.Linear(32, 4), QuantLinear([("Q8_0", blocks)]))
    assert auto_reason(SimpleNamespace(dtype=torch.float32, model=quant)) == "quantized weights (int8 activations)"
    assert auto_reason(SimpleNamespace(dtype=torch.bfloat16, model=nn.Linear(2, 2))) == "16-bit target"
    assert auto_reason(SimpleNamespace(dtype=torch.float32, model=nn.Linear(2, 2))) is None


def test_warmup_probes_once_at_the_widest_forward_any_method_runs(bf16_pair, tokenizer, monkeypatch):
    """warmup() runs every cost-driven method; the probe runs once, at the widest of their forwards
    (before: at hybrid's 13, then again at PEARL's 17)."""
    target, draft = bf16_pair
    eng = Engine(target, tokenizer, draft, max_seq_len=256, batch_invariant=True, invariant_width=6)
    widths = []
    real = invariance.probe
    monkeypatch.setattr(invariance, "probe", lambda *a, **k: widths.append(a[3]) or real(*a, **k))
    eng.warmup()
    widest = max(eng.new_method(m, gamma="auto").max_width for m in ("hybrid", "sd", "pearl", "ngram"))
    assert widths == [widest] and eng.target.invariant_width == widest
