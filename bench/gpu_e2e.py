"""The GPU bring-up's end-to-end figures on the real architectures with RANDOM weights (the real
pair's weights cannot travel to the GPU machine): Qwen2.5-Coder-1.5B shape as target, 0.5B shape
as draft, Qwen2.5-7B shape as a second target (vocab 151936 for all), bf16. What each method
gains on the real pair's acceptance is `make gpu-run`'s (bench/gpu_replay.py: a replayed trace);
random weights reject every draft, so no method's speed-up is timed here.

- ar: the target step unfused (torch reference ops), fused (our kernels; eager and CUDA
  graphs) and through torch.compile inside our graphs (the gpt-fast peer), batch 1 and 8,
  contexts 512 and 4096; tokens/s, MBU (weights + KV bytes read per step / step time /
  peak bandwidth) and, at batch 1 with graphs, the per-kernel profile (kernels per layer).
- all-accept bound: every method (sd γ 2-6 and auto, specdec++, parallelspec, the best trees,
  pearl with and without its second stream, n-gram, hybrid) with draft = a copy of the target
  (every draft accepted: pure engine cost): per-round draft / verify (CUDA events), GPU busy
  time per round (torch.profiler, union of kernel intervals), engine overhead = 1 − busy /
  round wall; the multi-step draft as one graph vs a graph per step.
- batch-invariant mode on, off and auto: tokens/s and sd == ar.
Writes JSON: python bench/gpu_e2e.py --out bench/results/gpu_e2e_h100.json
`--smoke` runs every section on the CPU with tiny shapes and a few tokens (torch.compile with
dynamo's "eager" backend: the same tracing and recompiles, no inductor):
a test (tests/repo/test_gpu_check_rehearsal.py) so that a GPU session never loses its minutes to an
error this script would have hit anyway. Its figures mean nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch._dynamo.utils import counters as dynamo_counters

from gpu_kernels import copy_bandwidth
from specengine import Engine, SpecEngineError
from specengine.benchmark import environment
from specengine.models.config import ModelConfig
from specengine.models.decoder import Transformer
from specengine.runtime.invariance import one_layer

SHAPES = {  # Qwen2.5 dims (config.json of each model); vocab 151936 everywhere
    "qwen2.5-1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                         num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                       num_key_value_heads=4, tie_word_embeddings=False),
}
TINY = {name: dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, tie_word_embeddings=dims["tie_word_embeddings"])
        for name, dims in SHAPES.items()}  # --smoke: the same code paths in seconds on a CPU
PEAK_BW = {"H100": 3.35e12, "H200": 4.8e12}  # datasheet HBM bandwidth, bytes/s


@dataclass
class Setup:
    """What one run measures: the real shapes on a GPU, or (`smoke`) tiny ones on the CPU."""
    device: str = "cuda"
    shapes: dict = field(default_factory=lambda: SHAPES)
    vocab: int = 151936
    new: int = 64  # new tokens per generate
    contexts: tuple = (512, 4096)  # the ar section's prompt lengths
    spec_ctx: int = 512  # the prompt length of the all-accept and invariant sections (and gpu_replay's)
    batches: tuple = (1, 8)
    max_seq: int = 4096 + 256
    compile_backend: str = "inductor"  # of the torch.compile providers (ours and HF's)
    dtype: torch.dtype = torch.bfloat16  # smoke: fp32, where "same tokens as ar" must hold against HF too
    capture: object = None  # CUDA graph capture; smoke: a stand-in that replays by calling (graph paths run)
    # one method config of the all-accept section (warm-up, timed and profiled runs): past it the
    # config is recorded in `config_timeouts` and the section goes on (PEARL's first call hung
    # in both H100 runs, 77df1d5 and 644f525, until 14fc5bf, so the 1.5B pair never ran).
    config_limit_s: float = float(os.environ.get("GPU_CONFIG_LIMIT_S", 75))


def replaying_capture(fn, pool, device):
    """--smoke's stand-in for CUDA-graph capture: the warm-up runs, then replay = call."""
    fn(), fn()
    return type("Replay", (), {"replay": staticmethod(fn)})()


SMOKE = Setup(device="cpu", shapes=TINY, vocab=512, new=6, contexts=(24,), spec_ctx=24, batches=(1, 2), max_seq=128,
              compile_backend="eager", dtype=torch.float32, capture=replaying_capture)
S = Setup()  # main() swaps in SMOKE for --smoke
# On a CPU (the rehearsal) every engine multiplies with F.linear, transformers' own path: fp32
# tokens then equal HF's on random weights whatever paths this machine's matmul plan measures.
PINNED = {} if torch.cuda.is_available() else {"cpu_matmul": "linear"}


def sync() -> None:
    if S.device == "cuda":
        torch.cuda.synchronize()


def free_memory() -> None:
    if S.device == "cuda":
        torch.cuda.empty_cache()


class NoTokenizer:
    """Token-id prompts only; the benchmark never needs text."""
    eos_token_id = None
    chat_template = None

    def decode(self, ids, **kw):
        return ""


def random_model(name: str, seed: int) -> Transformer:
    from transformers import Qwen2Config

    hf = Qwen2Config(vocab_size=S.vocab, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=32768,
                     **S.shapes[name])
    torch.manual_seed(seed)
    with torch.device(S.device):
        model = Transformer(ModelConfig.from_hf(hf))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    return model.to(S.dtype).eval()


def weight_bytes(model) -> int:
    """Bytes of weights one decode step reads: every parameter but an untied embedding
    table (a step gathers one of its rows; the LM head is its own matrix). A tied table is
    the LM head, read whole."""
    skip = set() if model.config.tie_word_embeddings else {id(model.embed_tokens.weight)}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in skip)


def kv_bytes_per_token(model) -> int:
    c = model.config
    return c.num_layers * 2 * c.num_kv_heads * c.head_dim * 2


def prompts(batch: int, ctx: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(min(100, S.vocab // 4), S.vocab - S.vocab // 64, (batch, ctx), generator=g).tolist()


def run(eng, batch, ctx, profile=False, **kw) -> dict:
    """One timed generate (after the caller's warm-up): decode wall, rounds, phases."""
    kw = dict(max_new_tokens=S.new, ignore_eos=True, **kw)
    sync()
    with torch.inference_mode():
        gen, _ = eng._start(prompts(batch, ctx), **kw)
        sync()
        t0 = time.perf_counter()
        prof = None
        if profile:
            kinds = torch.profiler.ProfilerActivity
            # on CUDA the host's side too: where a round's idle time goes (the first H100 run saw
            # ~1 ms of it per round at every model size)
            activities = [kinds.CPU, kinds.CUDA] if S.device == "cuda" else [kinds.CPU]
            prof = torch.profiler.profile(activities=activities)
            prof.__enter__()
        for _ in gen.rounds():
            pass
        sync()
        wall = time.perf_counter() - t0
        if prof is not None:
            prof.__exit__(None, None, None)
    stats, phases = gen.stats(), gen.timer.totals()
    out = dict(batch=batch, ctx=ctx, decode_wall_s=wall, rounds=stats.get("rounds", gen.counters.rounds),
               new_tokens=stats["new_tokens"], tokens_per_s=stats["new_tokens"] / wall,
               tokens_per_target_forward=stats["tokens_per_target_forward"],
               acceptance_rate=stats.get("acceptance_rate"), draft_s=phases.get("draft", 0.0),
               target_s=phases.get("target", 0.0), token_ids=[r.ids for r in gen.rows])
    out["round_s"] = wall / max(out["rounds"], 1)
    if prof is not None:
        out.update(gpu_busy(prof, out["rounds"]), **host_time(prof, out["rounds"]))
    return out


def gpu_busy(prof, rounds: int) -> dict:
    """Union of GPU activity intervals (kernels, copies) and time in sampling kernels, per round."""
    spans, sampling, by_name, kernels = [], 0.0, {}, 0
    for e in prof.profiler.kineto_results.events():
        if e.device_type() != torch.autograd.DeviceType.CUDA:
            continue
        s, d = e.start_ns(), e.duration_ns()
        spans.append((s, s + d))
        name = e.name()
        kernels += not is_copy(name)
        by_name[name] = by_name.get(name, 0) + d
        if any(k in name.lower() for k in ("rejection", "sample", "topk", "sort")):
            sampling += d
    spans.sort()
    busy, end = 0, None
    for s, t in spans:
        if end is None or s > end:
            busy += t - s
            end = t
        elif t > end:
            busy += t - end
            end = t
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]  # where the GPU time goes
    return dict(gpu_busy_s_per_round=busy / 1e9 / max(rounds, 1), sampling_s_per_round=sampling / 1e9 / max(rounds, 1),
                gpu_kernels=kernels, gpu_copies=len(spans) - kernels,
                top_kernels_s_per_round={k[:120]: v / 1e9 / max(rounds, 1) for k, v in top})


def host_time(prof, rounds: int) -> dict:
    """The host's ops per round by self time (the profiler's own cost inflates them: a ranking,
    not a timing), and their sum."""
    ops = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    top = sorted(ops, key=lambda e: -e.self_cpu_time_total)[:15]
    n = max(rounds, 1)
    return dict(host_self_s_per_round=sum(e.self_cpu_time_total for e in ops) / 1e6 / n,
                top_host_ops_s_per_round={e.key[:120]: e.self_cpu_time_total / 1e6 / n for e in top},
                host_op_calls_per_round=sum(e.count for e in ops) / n)


def host_fields(profiled: dict) -> dict:
    return {k: profiled[k] for k in ("host_self_s_per_round", "top_host_ops_s_per_round", "host_op_calls_per_round")}


def is_copy(name: str) -> bool:
    """A memcpy / memset in the profiler's list: not a kernel of the step's math."""
    return name.lower().startswith(("memcpy", "memset")) or "memcpy" in name.lower()


STEP_VARIANTS = {  # how the target step runs (docs/design.md, "Fused step")
    "unfused": "the plain-torch reference ops (the CPU path), our CUDA graphs",
    "fused": "our Triton kernels (specengine/kernels/: add+RMSNorm, RoPE+KV write, SiLU-and-mul) and merged projections",
    "fused+gemv": "fused, and each few-row linear in one launch with the norm or SiLU-mul before it "
                  "(kernels/fused_linear.py) in place of cuBLAS",
    "torch.compile": "the reference ops, attention included, through torch.compile (inductor, no cudagraphs "
                     "of its own) inside our graphs, captured lazily so dynamo compiles once per shape used: "
                     "the gpt-fast recipe, the peer to beat",
}


STEP_OPS = "add_rms_norm={0},rope_kv_write={0},silu_and_mul={0}"
VARIANT_KERNELS = {  # the engine's `kernels` switch per variant (the samplers take Triton in each)
    "unfused": "auto," + STEP_OPS.format("torch"),
    "fused": "auto,gemv=torch",  # cuBLAS linears, named: `auto` may take the kernel after warmup()'s timing
    "fused+gemv": "auto,gemv=triton",
    "torch.compile": "auto,attention=torch," + STEP_OPS.format("torch"),  # dynamo does not trace our launchers
}

AR_SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b")  # the draft's step first: speculation leans on it most


def ar_section(rows: list, peak: float, bw: float, only_small: bool, variants=("fused",), batches=None,
               graph_modes=(True,)) -> None:
    """The target step of each shape in each variant (STEP_VARIANTS): tokens/s, step time, MBU
    over the bytes a step reads, and with graphs at batch 1 the profiler's kernel list
    (kernels per layer from a 1-layer twin: (K(L) - K(1)) / (L - 1), so the LM head, the
    sampler and the copies are not counted as layer work)."""
    for name in ("qwen2.5-1.5b",) if only_small else AR_SHAPES:
        model = random_model(name, 0)
        wb, kvt = weight_bytes(model), kv_bytes_per_token(model)
        for variant in variants:
            compiled = variant == "torch.compile"
            for graphs in graph_modes:
                for batch in (S.batches[:1] if compiled else batches or S.batches):
                    for ctx in S.contexts:
                        r = _ar_step(model, variant, graphs, batch, ctx, profile=graphs and batch == 1)
                        step = r["round_s"]
                        nbytes = wb + batch * (ctx + S.new / 2) * kvt
                        r.update(model=name, variant=variant, graphs=graphs, weight_bytes=wb, step_s=step,
                                 bytes_per_step=nbytes, mbu=nbytes / step / peak,
                                 fraction_of_copy_bw=nbytes / step / bw)
                        if "gpu_kernels" in r and not compiled:
                            one = _ar_step(one_layer(model), variant, graphs, batch, ctx, profile=True)
                            k_all, k_one = (x["gpu_kernels"] / max(x["rounds"], 1) for x in (r, one))
                            r["kernels_per_step"] = k_all
                            r["kernels_per_layer"] = (k_all - k_one) / max(model.config.num_layers - 1, 1)
                            r["kernels_outside_layers"] = k_one - r["kernels_per_layer"]
                        print(f"ar {name} {variant:13s} graphs={graphs!s:5} B={batch} ctx={ctx}: "
                              f"{r['tokens_per_s']:8.1f} tok/s  step {step * 1e3:6.2f} ms  MBU {r['mbu']:.2f}  "
                              f"kernels/layer {r.get('kernels_per_layer', float('nan')):.1f}", flush=True)
                        rows.append(r)
        del model
        free_memory()


def _ar_step(model, variant: str, graphs: bool, batch: int, ctx: int, profile: bool) -> dict:
    """One warmed-up, timed `ar` generate of `model` in `variant` (a fresh engine each time)."""
    compiled = variant == "torch.compile"
    eng = Engine(model, NoTokenizer(), None, method="ar", max_seq_len=S.max_seq, max_batch=max(S.batches), **PINNED,
                 batch_invariant=False, kernels=VARIANT_KERNELS[variant])
    if compiled:  # inside our graphs, captured when first needed: one compile per shape used
        torch._dynamo.reset()
        dynamo_counters.clear()
        eng.target.set_graph_model(torch.compile(model, backend=S.compile_backend, dynamic=False, fullgraph=True))
    eng.set_cuda_graphs(graphs, capture=S.capture, lazy=compiled)
    run(eng, batch, ctx)  # warm-up: buffers, autotuning, compiling, graphs
    r = run(eng, batch, ctx)
    if profile:  # a call of its own: a profiled call's wall pays the profiler per launch (H200: a 0.5B
        # step read 2.52 ms for 0.93 ms of GPU work)
        p = run(eng, batch, ctx, profile=True)
        r.update({k: v for k, v in p.items() if k not in r}, profiled_round_s=p["round_s"])
    r.pop("token_ids")
    if compiled:  # what dynamo did: a fallback to the plain model is an error
        r["dynamo_graphs"] = dynamo_counters["stats"]["unique_graphs"]
        fallbacks = {**dynamo_counters["unimplemented"], **dynamo_counters["graph_break"]}
        if fallbacks:
            raise RuntimeError(f"torch.compile fell back to eager: {list(fallbacks)[:2]}")
    del eng
    free_memory()
    return r


_EXTRAS: dict[int, dict] = {}


def random_extras(draft):
    """A random SpecDec++ head and ParallelSpec drafter for a random draft (made once per
    draft: the drafter installs its adapters in place): their costs are what this benchmark
    measures (acceptance comes from the CPU runs with trained ones)."""
    if id(draft) in _EXTRAS:
        return _EXTRAS[id(draft)]
    from specengine.drafting.acceptance_head import AcceptanceHead, HeadMeta, model_fingerprint
    from specengine.drafting.parallel_drafter import DrafterMeta, ParallelDrafter

    cfg = draft.config
    head = AcceptanceHead(HeadMeta(cfg.hidden_size, cfg.vocab_size, model_fingerprint(cfg), "greedy", 2, "random"))
    drafter = ParallelDrafter(draft, DrafterMeta(cfg.hidden_size, cfg.vocab_size, model_fingerprint(cfg), 6, 4,
                                                 "random"))
    _EXTRAS[id(draft)] = dict(acceptance_head=head, parallel_drafter=drafter)
    return _EXTRAS[id(draft)]


# every method at its best CPU setting (bench/README.md), the all-accept section's rows
METHOD_CONFIGS = [("sd:auto", dict(method="sd", gamma="auto"), {})] + [
    (f"sd:{g}", dict(method="sd", gamma=g), {}) for g in (2, 3, 4, 6)] + [
    ("pearl:auto", dict(method="pearl"), {}),
    ("pearl:4", dict(method="pearl", gamma=4), {}),
    ("sd:4 per-step graphs", dict(method="sd", gamma=4), {"chain_graph": False}),
    ("sd:8@specdec++=0.5", dict(method="sd", gamma=8, policy="specdec++", threshold=0.5), {}),
    ("parallelspec:4", dict(method="parallelspec", gamma=4), {}),
    ("sd[tree=4x4]", dict(method="sd", tree="4x4"), {}),
    ("parallelspec[tree=4x4]", dict(method="parallelspec", tree="4x4"), {}),
    ("pearl:4 one stream", dict(method="pearl", gamma=4), {"one_stream": True}),
    ("ngram:auto", dict(method="ngram", gamma="auto"), {}),  # no draft model: proposals from the context
    ("hybrid:auto", dict(method="hybrid", gamma="auto"), {}),  # n-gram or the draft, whichever the costs expect faster
    ("ngram[tree=4x6:16]", dict(method="ngram", tree="4x6:16"), {}),
    # the draft's LM head over the shipped table's 65,536 most frequent ids (draft_vocab "auto" on
    # the real pair; the random models' stand-in tokenizer matches no table, so it is set here)
    ("sd:auto cut head", dict(method="sd", gamma="auto"), {"draft_vocab": 65536}),
]


class RowLog(list):
    """A result list that saves the JSON at every row: both H100 runs lost their `spec` rows
    (printed, never saved) when the part's limit killed the process past its SIGTERM grace."""

    def __init__(self, save):
        super().__init__()
        self._save = save

    def append(self, row) -> None:
        super().append(row)
        self._save()


TIMEOUTS: list[dict] = []  # method configs stopped by S.config_limit_s (main puts them in the JSON)


class ConfigTimeout(Exception):
    pass


@contextmanager
def time_limit(seconds: float):
    """Raise ConfigTimeout in this (the main) thread after `seconds` (SIGALRM): a config stuck in
    Python-level work (captures, autotuning, probes) gives its minutes back to the next ones."""
    def alarm(signum, frame):
        raise ConfigTimeout(f"exceeded its {seconds:.0f} s limit")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def cut_ids(size: int, vocab: int) -> torch.Tensor:
    """The shipped frequency table's `size` most frequent ids below `vocab` (smoke: tiny vocabularies)."""
    from specengine.drafting.frequent_vocab import SHIPPED, read_table

    ids = read_table(SHIPPED / "qwen2.5.safetensors")
    return ids[ids < vocab][:min(size, vocab // 2)].sort().values


def fresh_engine(target, draft) -> Engine:
    eng = Engine(target, NoTokenizer(), draft, max_seq_len=S.max_seq, max_batch=max(S.batches), **PINNED,
                 batch_invariant=False, **random_extras(draft))
    eng.set_cuda_graphs(True, capture=S.capture)
    return eng


def spec_section(rows: list, target, draft, label: str, configs=METHOD_CONFIGS) -> None:
    """Every method (sd γ 2-6 and auto, whole-chain vs per-step draft graphs, specdec++,
    parallelspec, the best trees, pearl ± its second stream): round wall, GPU busy time,
    engine overhead = 1 − busy / round wall, draft / verify split."""
    ctx = S.spec_ctx
    eng = fresh_engine(target, draft)
    run(eng, 1, ctx, method="ar")
    ar = run(eng, 1, ctx, method="ar")
    ar_prof = run(eng, 1, ctx, method="ar", profile=True)
    ar.update(gpu_busy_s_per_round=ar_prof["gpu_busy_s_per_round"], sampling_s_per_round=ar_prof["sampling_s_per_round"],
              top_kernels_s_per_round=ar_prof["top_kernels_s_per_round"], **host_fields(ar_prof))
    ref = ar.pop("token_ids")
    ar_row = dict(ar, pair=label, provider="ar")
    ar_row["engine_overhead"] = 1 - ar_row["gpu_busy_s_per_round"] / ar_row["round_s"]
    rows.append(ar_row)
    for provider, kw, opts in configs:
        eng.draft.chain_graph = opts.get("chain_graph", True)
        one_stream = opts.get("one_stream") and S.device == "cuda"  # a CPU runs them one after the other anyway
        if one_stream:
            eng.side_stream = lambda: torch.cuda.current_stream(eng.device)  # draft and target serialized
        if "draft_vocab" in opts:
            eng.set_draft_head(cut_ids(opts["draft_vocab"], eng.draft.config.vocab_size))
        t0, used = time.perf_counter(), eng
        try:
            with time_limit(S.config_limit_s):
                if S.device == "cpu" and os.environ.get("GPU_SMOKE_STALL_CONFIG") in (provider, f"{label} {provider}"):
                    time.sleep(3600)  # rehearse a config that never finishes its warm-up
                run(eng, 1, ctx, **kw)  # warm-up: graph captures, Triton compiles and autotuning
                r = run(eng, 1, ctx, **kw)
                p = run(eng, 1, ctx, profile=True, **kw)
        except ConfigTimeout as e:
            TIMEOUTS.append(dict(pair=label, provider=provider, error=str(e)))
            print(f"{label} {provider:22s}: {e}; a fresh engine for the rest", flush=True)
            eng = fresh_engine(target, draft)  # a run cut mid-capture leaves the engine in no known state
            continue
        finally:  # on the engine the config ran on (a timeout replaced `eng`)
            if one_stream:
                del used.side_stream
            if "draft_vocab" in opts:
                used.set_draft_head(None)
        r["config_s"] = time.perf_counter() - t0  # warm-up, timed run and profiled run together
        r.update(gpu_busy_s_per_round=p["gpu_busy_s_per_round"], sampling_s_per_round=p["sampling_s_per_round"],
                 gpu_kernels_per_round=p["gpu_kernels"] / max(p["rounds"], 1),
                 top_kernels_s_per_round=p["top_kernels_s_per_round"], **host_fields(p))
        r["engine_overhead"] = 1 - r["gpu_busy_s_per_round"] / r["round_s"]
        r["draft_s_per_round"] = r["draft_s"] / max(r["rounds"], 1)
        r["verify_s_per_round"] = r["target_s"] / max(r["rounds"], 1)
        r["same_tokens_as_ar"] = r.pop("token_ids") == ref
        r["speedup_vs_ar"] = r["tokens_per_s"] / ar["tokens_per_s"]
        rows.append(dict(r, pair=label, provider=provider))
        print(f"{label} {provider:22s}: {r['tokens_per_s']:7.1f} tok/s ({r['speedup_vs_ar']:.2f}x ar)  round "
              f"{r['round_s'] * 1e3:6.2f} ms  draft {r['draft_s_per_round'] * 1e3:5.2f}  verify "
              f"{r['verify_s_per_round'] * 1e3:5.2f}  sampling {r['sampling_s_per_round'] * 1e3:5.2f}  overhead "
              f"{r['engine_overhead']:.1%}  tau {r['tokens_per_target_forward']:.2f}  same {r['same_tokens_as_ar']}  "
              f"({r['config_s']:.0f} s)",
              flush=True)
    eng.draft.chain_graph = True


def invariant_section(rows: list, target, draft) -> None:
    """Batch-invariant mode on vs off (bf16, batch 1 and 8, ctx 512): ar and sd:4 tokens/s, sd
    == ar, what the probe chose and what "auto" measured."""
    for mode in (False, True, "auto"):
        try:
            eng = Engine(target, NoTokenizer(), draft, max_seq_len=S.max_seq, max_batch=max(S.batches), **PINNED,
                         batch_invariant=mode)
        except SpecEngineError as e:  # no padding makes this machine's kernels invariant: a finding
            rows.append(dict(mode=str(mode), refused=str(e)))
            print(f"batch-invariant {mode}: refused: {e}", flush=True)
            continue
        eng.set_cuda_graphs(True, capture=S.capture)
        for batch in S.batches:
            run(eng, batch, S.spec_ctx, method="ar")
            ar = run(eng, batch, S.spec_ctx, method="ar")
            run(eng, batch, S.spec_ctx, method="sd", gamma=4)
            sd = run(eng, batch, S.spec_ctx, method="sd", gamma=4)
            row = dict(mode=str(mode), info=eng.batch_invariant_info, attention=eng.ops.names["attention"], batch=batch,
                       ar_tokens_per_s=ar["tokens_per_s"], sd4_tokens_per_s=sd["tokens_per_s"],
                       sd_same_tokens_as_ar=sd["token_ids"] == ar["token_ids"])
            rows.append(row)
            print(f"batch-invariant {row['mode']:5s} B{batch}: ar {row['ar_tokens_per_s']:7.1f} tok/s  sd:4 "
                  f"{row['sd4_tokens_per_s']:7.1f}  same {row['sd_same_tokens_as_ar']}  {row['attention']} "
                  f"{row['info']}", flush=True)


# in the order they run. The first device command: the step's figures; the second: everything
# else, torch.compile of our model last.
SECTIONS = ("ar", "allaccept", "invariant", "ar-variants", "compile")
FIRST, SECOND = "ar", "allaccept,invariant,ar-variants,compile"
PAIR_SECTIONS = {"allaccept", "invariant"}  # on the 1.5B target / 0.5B draft shapes
KEYS = {"ar": "ar", "ar-variants": "ar", "compile": "ar", "allaccept": "spec",
        "invariant": "invariant"}  # section -> result key


def summary(result: dict) -> str:
    """One screen: the step per shape, each method's all-accept round against ar, what failed."""
    lines = [f"gpu_e2e {result['environment'].get('device')} commit {result['environment'].get('commit')} "
             f"smoke={result['smoke']} sections done: {', '.join(result['done']) or 'none'}"]
    for r in result["ar"]:
        lines.append(f"ar {r['model']:13s} {r['variant']:13s} graphs={r['graphs']!s:5} B{r['batch']} ctx {r['ctx']:5d}: "
                     f"step {r['step_s'] * 1e3:7.3f} ms  GPU busy {r.get('gpu_busy_s_per_round', float('nan')) * 1e3:6.3f} ms  "
                     f"MBU {r['mbu']:.2f}  kernels/layer {r.get('kernels_per_layer', float('nan')):.1f}")
    for r in result["spec"]:
        if r["provider"] != "ar":
            lines.append(f"{r['pair']:28s} {r['provider']:22s} {r['tokens_per_s']:8.1f} tok/s  "
                         f"{r['speedup_vs_ar']:.2f}x ar  tau {r['tokens_per_target_forward']:.2f}  "
                         f"same {r['same_tokens_as_ar']}  round {r['round_s'] * 1e3:.2f} ms, GPU busy "
                         f"{r.get('gpu_busy_s_per_round', float('nan')) * 1e3:.2f}, host ops (profiled) "
                         f"{r.get('host_self_s_per_round', float('nan')) * 1e3:.2f}")
    lines.append("seconds per section: " + ", ".join(f"{k} {v:.0f}" for k, v in result.get("section_s", {}).items()))
    for t in result.get("config_timeouts", []):
        lines.append(f"STOPPED {t['pair']} {t['provider']}: {t['error']}")
    for key, err in result.get("errors", {}).items():
        lines.append(f"ERROR in {key}: {err[:300]}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default=",".join(SECTIONS),
                    help=f"comma-separated sections of {','.join(SECTIONS)}; 'first' = {FIRST}, 'second' = {SECOND}")
    ap.add_argument("--small", action="store_true", help="1.5B only in the ar section (a quick check)")
    ap.add_argument("--smoke", action="store_true", help="every section on the CPU, tiny shapes: checks the script")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    only = args.only.replace("first", FIRST).replace("second", SECOND)
    sections = set(only.split(","))
    if not sections <= set(SECTIONS):
        ap.error(f"unknown section(s) {', '.join(sorted(sections - set(SECTIONS)))}; choose from {','.join(SECTIONS)}")
    global S
    S = SMOKE if args.smoke else Setup()
    if S.device == "cuda" and not torch.cuda.is_available():
        print("gpu_e2e: needs a CUDA device (--smoke checks the script on a CPU)", file=sys.stderr)
        return 2
    if S.device == "cuda":
        name = torch.cuda.get_device_name()
        peak, bw = next((v for k, v in PEAK_BW.items() if k in name), None) or 3.35e12, copy_bandwidth()
    else:
        peak, bw = PEAK_BW["H100"], float("nan")  # smoke: the figures mean nothing
    result = {"environment": environment(), "weights": "random (real architectures; see the docstring)",
              "smoke": args.smoke, "dtype": str(S.dtype).removeprefix("torch."), "new_tokens": S.new,
              "peak_bandwidth_Bps": peak, "copy_bandwidth_Bps": bw, "sections": sorted(sections), "done": [],
              "method_providers": [p for p, _, _ in METHOD_CONFIGS],
              "ar": [], "spec": [], "invariant": [], "section_s": {}}

    def save():
        result["config_timeouts"] = TIMEOUTS
        Path(args.out).write_text(json.dumps(result, indent=1))
        Path(args.out).with_suffix(".summary.txt").write_text(summary(result))

    for key in set(KEYS.values()):  # every row on disk as it lands: a part killed mid-section keeps it
        result[key] = RowLog(save)

    def guarded(section, fn):
        t0 = time.perf_counter()
        try:
            fn(result[KEYS[section]])  # appends row by row
            if section not in result["done"]:
                result["done"].append(section)
        except Exception as e:  # record and go on
            import traceback
            traceback.print_exc()
            result.setdefault("errors", {})[section] = repr(e)
        finally:  # also when a time limit interrupts the run
            took = time.perf_counter() - t0  # where a part's minutes go: the next window is planned from it
            result["section_s"][section] = result["section_s"].get(section, 0.0) + took
            print(f"--- {section}: {took:.1f} s, {time.perf_counter() - start:.0f} s since the start", flush=True)
            save()
        if args.smoke and os.environ.get("GPU_SMOKE_STALL_AFTER") == section:  # rehearse a part killed by its limit
            time.sleep(3600)

    if "ar" in sections:  # first: the fused, graphed step at batch 1 (the figures everything builds on)
        guarded("ar", lambda rows: ar_section(rows, peak, bw, args.small, batches=S.batches[:1]))
    if sections & PAIR_SECTIONS:
        pair_sections(sections, guarded)
    if "ar-variants" in sections:  # unfused, fused eager, batch 8
        guarded("ar-variants", lambda rows: ar_section(rows, peak, bw, args.small, variants=("unfused", "fused"),
                                                       graph_modes=(False, True)))
    if "compile" in sections:  # last: two inductor compiles per shape
        guarded("compile", lambda rows: ar_section(rows, peak, bw, True, variants=("torch.compile",)))
    save()
    return 1 if result.get("errors") else 0


def pair_sections(sections: set, guarded) -> None:
    """The sections on the 1.5B target / 0.5B draft shapes."""
    target, draft = random_model("qwen2.5-1.5b", 0), random_model("qwen2.5-0.5b", 1)
    if "allaccept" in sections:  # draft = the target: pure engine cost
        # a second model from the same seed: the same weights (a deepcopy would also copy what
        # the engine installed on the first, e.g. the CPU matmul plan's packed weights)
        guarded("allaccept", lambda rows: spec_section(rows, target, random_model("qwen2.5-1.5b", 0),
                                                       "all-accept 1.5b/1.5b copy"))
    if "invariant" in sections:
        guarded("invariant", lambda rows: invariant_section(rows, target, draft))
    del target, draft
    free_memory()


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `timeout` -> save what was measured
    sys.exit(main())
