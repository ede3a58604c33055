"""The GPU command's sections (scripts/gpu_run.sh): every method on random weights of the real
shapes, REPLAYING the real pair's acceptance (specengine/replay), beside our `ar`, HF `generate`
and a torch.compile'd `ar`, so a GPU that cannot hold the real weights still shows each
method's speed-up on the real pair's rounds.

  python bench/gpu_replay.py step   --out step.json                  ar step per shape (first)
  python bench/gpu_replay.py replay --pair 7b --out replay_7b.json   every method, replayed
  python bench/gpu_replay.py peers  --out peers.json                 HF generate, torch.compile ar
  python bench/gpu_replay.py pearl  --out pearl.json                 PEARL (own process: it once hung)
  python bench/gpu_replay.py table  DIR                              one screen from the JSONs

Each row: tokens/s of whole calls over the trace's prompts (prefill included), x our `ar`, x HF
generate, tau (tokens per target forward), kernels per round (profiled), and whether the tokens
are the trace's (a replay commits exactly the real pair's greedy tokens). The 7B shapes
replay the 1.5B pair's trace (no 7B target was traced). "rejecting" rows replay a trace in
which no draft-model proposal is ever accepted: the "never slower" check.
--smoke: tiny layers with the real vocabulary on the CPU (the real trace still applies): a
rehearsal of the same command, run by the tests. Its figures mean nothing.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from pathlib import Path

import torch

import gpu_e2e as E
from specengine import Engine
from specengine.benchmark import environment
from specengine.replay import Replay, TraceSet
from specengine.runtime import kernel_choice
from specengine.runtime.runner import ModelRunner

TRACE = Path(__file__).parent / "results" / "trace_qwen25coder_1.5b_0.5b.safetensors"
PAIRS = {"7b": "qwen2.5-7b", "1.5b": "qwen2.5-1.5b"}
STEP_SHAPES = ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b")
CUBLAS = "auto,gemv=torch"  # the replays' linears, named (warmup() times cuBLAS against gemv where left to auto)
STEP_VARIANTS = ("fused", "fused+gemv")  # gpu_e2e.STEP_VARIANTS: cuBLAS linears, then ours fused with their inputs
METHODS = [  # (provider, generate options); trees: the CPU's best shapes, as recorded in the trace
    ("sd:2", dict(method="sd", gamma=2)), ("sd:3", dict(method="sd", gamma=3)), ("sd:4", dict(method="sd", gamma=4)),
    ("sd:auto", dict(method="sd", gamma="auto")),
    ("sd:8@specdec++", dict(method="sd", gamma=8, policy="specdec++")),
    ("parallelspec:4", dict(method="parallelspec", gamma=4)),
    ("sd[tree=4x4:8]", dict(method="sd", tree="4x4:8")),
    ("parallelspec[tree=3x4:8]", dict(method="parallelspec", tree="3x4:8")),
    ("ngram:auto", dict(method="ngram", gamma="auto")),
    ("hybrid:auto", dict(method="hybrid", gamma="auto")),
]
REJECTING = [("sd:auto", dict(method="sd", gamma="auto")), ("hybrid:auto", dict(method="hybrid", gamma="auto"))]
PEARL = [("pearl", dict(method="pearl"))]
GEMV = ("sd:auto", "hybrid:auto")  # rerun with the fused few-row linears (trace "real+gemv"), beside ar
SMOKE_SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2)


def setup(smoke: bool, vocab: int) -> None:
    """gpu_e2e's Setup for this run: the real shapes in bf16 on CUDA, or (smoke) tiny layers."""
    if smoke:
        E.S = E.Setup(device="cpu", shapes={k: dict(SMOKE_SHAPE, tie_word_embeddings=v["tie_word_embeddings"])
                                            for k, v in E.SHAPES.items()},
                      vocab=vocab, new=4, contexts=(24,), spec_ctx=24, batches=(1,), max_seq=512,
                      compile_backend="eager", dtype=torch.float32, capture=E.replaying_capture)
    else:
        E.S = E.Setup(vocab=vocab, contexts=(512,), batches=(1,), max_seq=1024)


def load_traces(path, smoke: bool, prompts: int | None) -> TraceSet:
    traces = TraceSet.load(path)
    if prompts:
        traces.traces = traces.traces[:prompts]
    if smoke:  # one prompt's first tokens (each engine still runs it 3 times): the rehearsal checks the command
        traces.traces = traces.traces[:1]
        for t in traces.traces:
            t.new = min(t.new, 12)
    return traces


def rejecting(traces: TraceSet) -> TraceSet:
    """The same prompts and target tokens, but a draft model whose every proposal is wrong:
    chains and parallel proposals empty (the replay then proposes tokens the target never
    takes), trees of a token that no reply holds."""
    out = []
    for t in traces.traces:
        unused = next(i for i in range(len(t.tokens) + 1) if i not in set(t.tokens.tolist()))
        trees = {}
        for kind, parts in t.trees.items():
            tokens = parts["tokens"].clone()
            tokens[:, 1:] = unused
            trees[kind] = dict(parts, tokens=tokens)
        out.append(type(t)(t.name, t.prompt_len, t.new, t.tokens, torch.full_like(t.chain, -1), t.conf * 0,
                           t.head * 0, torch.full_like(t.parallel, -1), trees))
    return TraceSet(out, dict(traces.meta, rejecting=True))


def replay_engine(target, draft, traces: TraceSet, kernels: str = CUBLAS) -> tuple[Engine, Replay]:
    eng = Engine(target, E.NoTokenizer(), draft, max_seq_len=E.S.max_seq, max_batch=1, **E.PINNED,
                 batch_invariant=False, kernels=kernels, **E.random_extras(draft))
    eng.set_cuda_graphs(True, capture=E.S.capture)
    replay = Replay(traces, vocab=target.config.vocab_size, device=E.S.device)
    replay.attach(eng)
    eng.warmup()  # as a server starts: graphs (the draft's chains too), step costs
    return eng, replay


def runs(log) -> str:
    """The last call's rounds as (proposed, accepted) runs: "0/0x16 1/1 0/0x32 ..." (what γ auto chose)."""
    groups = ((key, len(list(same))) for key, same in itertools.groupby(f"{e[0]}/{e[1]}" for e in log))
    return " ".join(key + (f"x{n}" if n > 1 else "") for key, n in groups)


def costs(eng) -> dict:
    """The step costs the engine measured (what γ auto and PEARL chose by), in ms."""
    return {str(b): dict(draft_ms=c.draft_s * 1e3, target_ms=[round(t * 1e3, 3) for t in c.target_s[:9]])
            for b, c in eng.measured_step_costs.items()}


def timed_calls(eng, replay: Replay, kw: dict) -> dict:
    """A warm-up call per prompt (captures for every length bucket the calls reach, autotuning:
    the H200's first run timed `sd` γ 4 at 1.24x or 1.43x `ar` as it ran first or after γ 2 and 3),
    then every trace's prompt once, timed as whole calls; one short profiled call for the kernels
    per round."""
    traces = replay.set.traces
    for i in range(len(traces)):
        replay.generate(eng, i, **kw)
    new = wall = target_forwards = 0
    exact = True
    for i, t in enumerate(traces):
        E.sync()
        t0 = time.perf_counter()
        r = replay.generate(eng, i, **kw)
        E.sync()
        wall += time.perf_counter() - t0
        new += len(r.token_ids)
        target_forwards += r.stats["target_forwards"]
        exact &= r.token_ids == t.target_tokens
    row = dict(tokens_per_s=new / wall, new_tokens=new, wall_s=wall, tokens_per_target_forward=new / target_forwards,
               same_tokens_as_trace=exact, acceptance_rate=r.stats.get("acceptance_rate"),
               gamma_mean=r.stats.get("gamma_mean"), plain_rounds=r.stats.get("plain_rounds"),
               **{k: r.stats.get(k) for k in ("rounds_launched_ahead", "round_cost_factors", "prediction_error")},
               rounds=runs(r.stats.get("round_log") or []), step_costs=costs(eng))
    kinds = torch.profiler.ProfilerActivity
    with torch.profiler.profile(activities=[kinds.CUDA] if E.S.device == "cuda" else [kinds.CPU]) as prof:
        r = replay.generate(eng, 0, **kw)
        E.sync()
    rounds = r.stats.get("rounds") or len(r.stats["round_log"])
    if E.S.device == "cuda":
        busy = E.gpu_busy(prof, rounds)
        row.update(kernels_per_round=busy["gpu_kernels"] / max(rounds, 1), gpu_busy_s_per_round=busy["gpu_busy_s_per_round"])
    return row


def replay_section(pair: str, traces: TraceSet, methods, rows: list, save) -> None:
    draft = E.random_model("qwen2.5-0.5b", 1)
    target = E.random_model(PAIRS[pair], 0)
    kinds = [("real", traces, CUBLAS), ("rejecting", rejecting(traces), CUBLAS)]
    plans = {"real": methods, "rejecting": [m for m in methods if m[0] in dict(REJECTING + PEARL)],
             "real+gemv": [m for m in methods if m[0] in GEMV]}
    if E.S.device == "cuda" and plans["real+gemv"]:  # the fused few-row linears (gemv), both models: item 5's A/B
        kinds.append(("real+gemv", traces, "auto,gemv=triton"))
    for trace_kind, set_, kernels in kinds:
        eng, replay = replay_engine(target, draft, set_, kernels)
        plan = [("ar", dict(method="ar"))] + plans[trace_kind]
        ar = None
        for provider, kw in plan:
            t0 = time.perf_counter()
            try:
                with E.time_limit(E.S.config_limit_s):
                    if E.S.device == "cpu" and os.environ.get("GPU_SMOKE_STALL_CONFIG") == provider:
                        time.sleep(3600)  # rehearse a config that never finishes
                    r = timed_calls(eng, replay, kw)
            except E.ConfigTimeout as e:
                rows.append(dict(pair=pair, trace=trace_kind, provider=provider, error=str(e)))
                save()
                eng, replay = replay_engine(target, draft, set_, kernels)  # a run cut mid-capture: no known state
                continue
            ar = r if provider == "ar" else ar
            r.update(pair=f"{pair}/0.5b", trace=trace_kind, trace_of="1.5B/0.5B real pair" if pair != "1.5b" else
                     "this pair", provider=provider, x_ar=r["tokens_per_s"] / ar["tokens_per_s"] if ar else None,
                     config_s=time.perf_counter() - t0)
            rows.append(r)
            save()
            print(f"{pair}/0.5b {trace_kind:9s} {provider:26s} {r['tokens_per_s']:8.1f} tok/s  x ar "
                  f"{r['x_ar'] or 1:.2f}  tau {r['tokens_per_target_forward']:.2f}  same {r['same_tokens_as_trace']}  "
                  f"({r['config_s']:.0f} s)", flush=True)
            if r.get("round_cost_factors"):  # what a cost-driven choice saw
                print(f"    costs {r['step_costs']} factors {r['round_cost_factors']} ahead "
                      f"{r['rounds_launched_ahead']} rounds {r['rounds'][:200]}", flush=True)
        replay.detach(eng)
        del eng
        E.free_memory()


def step_section(rows: list, save) -> None:
    """The fused, graphed `ar` step of each shape at batch 1, ctx 512, with its kernel count; then
    with the few-row linears fused too (`gemv`: the 0.5B's is the draft step of issue 63's item 5)."""
    for name in STEP_SHAPES:
        model = E.random_model(name, 0)
        for variant in STEP_VARIANTS if E.S.device == "cuda" else STEP_VARIANTS[:1]:  # the smoke: no Triton on CPU
            r = E._ar_step(model, variant, True, 1, E.S.contexts[0], profile=True)
            r.update(model=name, variant=variant, step_s=r["round_s"],
                     kernels_per_step=r.get("gpu_kernels", 0) / max(r["rounds"], 1))
            rows.append(r)
            save()
            print(f"step {name:13s} {variant:10s}: {r['step_s'] * 1e3:7.3f} ms  {r['tokens_per_s']:8.1f} tok/s  "
                  f"kernels/step {r['kernels_per_step']:.0f}", flush=True)
        if E.S.device == "cuda":  # what a user's engine takes: warmup()'s own timing (runtime/kernel_choice.py)
            choice = kernel_choice.choose_gemv(ModelRunner(model, "auto", max_batch=1), "auto")
            rows.append(dict(model=name, variant="timed choice", gemv=choice))
            save()
            print(f"step {name:13s} timed choice: {choice}", flush=True)
        del model
        E.free_memory()


def gpt_fast_ar(model, prompt: list[int], new: int) -> list[int]:
    """The gpt-fast way: our model on the torch reference ops, its one-token step compiled with
    mode="reduce-overhead" (inductor's CUDA graphs), a static KV cache, a greedy loop."""
    from specengine.kernels.ops import TORCH
    from specengine.runtime.kv_cache import KVCache

    step = getattr(model, "_gpt_fast_step", None)
    if step is None:
        def one(tok, cache):
            logits = model(tok, cache, TORCH)
            cache.lens.add_(1)
            return logits[:, -1].argmax(-1, keepdim=True)
        mode = "reduce-overhead" if E.S.compile_backend == "inductor" else None
        step = model._gpt_fast_step = torch.compile(one, backend=E.S.compile_backend, mode=mode, fullgraph=True)
        model._gpt_fast_cache = KVCache.for_model(model, 1, E.S.max_seq)
    cache = model._gpt_fast_cache
    cache.lens.zero_()
    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        tok = model(ids, cache, TORCH)[:, -1].argmax(-1, keepdim=True)
        cache.lens.fill_(len(prompt))
        out = [tok]
        for _ in range(new - 1):
            tok = step(tok.clone(), cache)
            out.append(tok)
    return torch.cat(out, 1)[0].tolist()


def to_hf(model):
    """transformers' model with our model's weights (split back to HF names), same device/dtype."""
    from transformers import AutoModelForCausalLM

    from specengine.models.decoder import split_checkpoint

    w = model.embed_tokens.weight
    with torch.device(w.device):  # built where it runs: a 7B's random init on the CPU outlasted its section (H200)
        hf = AutoModelForCausalLM.from_config(model.config.hf_config, dtype=w.dtype).eval()
    state = split_checkpoint(model)
    lm_head = state.pop("lm_head.weight")
    hf.model.load_state_dict(state, strict=False)
    hf.lm_head.weight = torch.nn.Parameter(lm_head, requires_grad=False)
    return hf


def peers_section(traces: TraceSet, rows: list, save) -> None:
    """HF `generate` (bf16, sdpa, its default cache) on both target shapes, then the gpt-fast-style
    compiled `ar` (its compile takes longest: last), on the replay's prompts and lengths."""
    def hf_generate(model):
        hf = to_hf(model)
        return lambda p, n: hf.generate(torch.tensor([p], device=E.S.device), max_new_tokens=n, min_new_tokens=n,
                                        do_sample=False, pad_token_id=0)[0, len(p):].tolist()

    for provider, make in (("hf generate", hf_generate),
                           ("torch.compile ar (gpt-fast)", lambda model: lambda p, n: gpt_fast_ar(model, p, n))):
        # the compile of the smaller shape first: the 7B's did not finish within the section on the H200
        for pair, name in (PAIRS.items() if provider == "hf generate" else reversed(PAIRS.items())):
            t0 = time.perf_counter()
            print(f"{pair} {provider}: building, warming up", flush=True)  # a stall shows where
            model = E.random_model(name, 0)
            fn = make(model)
            with torch.inference_mode():
                fn(traces.traces[0].prompt, 8)  # warm-up: compile, autotune
                E.sync()
                new = wall = 0
                for t in traces.traces:
                    t1 = time.perf_counter()
                    toks = fn(t.prompt, t.new)
                    E.sync()
                    wall += time.perf_counter() - t1
                    new += len(toks)
            rows.append(dict(pair=f"{pair}/0.5b", provider=provider, tokens_per_s=new / wall, new_tokens=new,
                             wall_s=wall, config_s=time.perf_counter() - t0))
            save()
            print(f"{pair} {provider:28s}: {new / wall:8.1f} tok/s ({time.perf_counter() - t0:.0f} s)", flush=True)
            del fn, model
            E.free_memory()


def table(folder: Path) -> str:
    """One screen: each method's tokens/s, x our ar, x HF generate and tau, per pair."""
    load = lambda n: json.loads((folder / n).read_text()) if (folder / n).exists() else {"rows": []}  # noqa: E731
    hf = {r["pair"]: r["tokens_per_s"] for r in load("peers.json")["rows"] if r["provider"] == "hf generate"}
    lines, steps = [], load("step.json")["rows"]
    cublas = {r["model"]: r["step_s"] for r in steps if r.get("variant", "fused") == "fused"}
    for r in steps:  # the fused few-row linears (gemv) against the same shape's cuBLAS step
        if "gemv" in r:  # warmup()'s timed choice on the same shape
            g = r["gemv"] or {"chosen": "none", "ms": {}}
            lines.append(f"ar step {r['model']:13s} timed choice: {g['chosen']} (" + ", ".join(
                f"{impl} {ms:.3f} ms" for impl, ms in g["ms"].items()) + f")  {r.get('commit', '')}")
            continue
        vs = f"  x cuBLAS {cublas[r['model']] / r['step_s']:.2f}" if r.get("variant") == "fused+gemv" and \
            r["model"] in cublas else ""
        lines.append(f"ar step {r['model']:13s} {r.get('variant', 'fused'):10s} {r['step_s'] * 1e3:7.3f} ms  "
                     f"kernels/step {r['kernels_per_step']:.0f}{vs}  {r.get('commit', '')}")
    for r in load("peers.json")["rows"]:
        lines.append(f"{r['pair']:9s} {'peer':9s} {r['provider']:28s} {r['tokens_per_s']:8.1f} tok/s  {r.get('commit', '')}")
    head = f"{'pair':9s} {'trace':9s} {'provider':28s} {'tok/s':>8s} {'x ar':>6s} {'x HF':>6s} {'tau':>5s} same"
    lines.append(head)
    replays = [load(name)["rows"] for name in ("replay_7b.json", "replay_1.5b.json")]
    rows = [r for part in replays + [load("pearl.json")["rows"]] for r in part]
    real = {(r["pair"], r["provider"]): r["tokens_per_s"] for part in replays  # not pearl's own ar
            for r in part if r["trace"] == "real" and "error" not in r}
    for r in rows:
        if "error" in r:
            lines.append(f"{r['pair']:9s} {r['trace']:9s} {r['provider']:28s} STOPPED: {r['error']}")
            continue
        x_hf = r["tokens_per_s"] / hf[r["pair"]] if r["pair"] in hf else float("nan")
        key = (r["pair"], r["provider"])  # a gemv rerun against the same provider with cuBLAS
        vs = f"  x cuBLAS {r['tokens_per_s'] / real[key]:.2f}" if r["trace"] == "real+gemv" and key in real else ""
        lines.append(f"{r['pair']:9s} {r['trace']:9s} {r['provider']:28s} {r['tokens_per_s']:8.1f} "
                     f"{r['x_ar'] or 1:6.2f} {x_hf:6.2f} {r['tokens_per_target_forward']:5.2f} "
                     f"{r['same_tokens_as_trace']}{vs}  {r.get('commit', '')}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("section", choices=("step", "replay", "peers", "pearl", "table"))
    ap.add_argument("folder", nargs="?", help="table: the folder of the sections' JSON files")
    ap.add_argument("--out")
    ap.add_argument("--pair", choices=tuple(PAIRS), default="1.5b")
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--prompts", type=int, default=2, help="the trace's first n prompts")
    ap.add_argument("--providers", help="replay: only these (comma-separated, as the rows name them), beside ar")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args(argv)
    if a.section == "table":
        text = table(Path(a.folder))
        print(text, end="")
        return 0
    if not a.smoke and not torch.cuda.is_available():
        print("gpu_replay: needs a CUDA device (--smoke rehearses on the CPU)", file=sys.stderr)
        return 2
    traces = load_traces(a.trace, a.smoke, a.prompts)
    setup(a.smoke, max(traces.meta["vocab"], 151936))
    result = {"environment": environment(), "section": a.section, "smoke": a.smoke, "weights": "random",
              "trace": {k: traces.meta.get(k) for k in ("commit", "target", "draft", "prompts", "new", "trees")},
              "dtype": str(E.S.dtype).removeprefix("torch."), "rows": []}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save():
        out.write_text(json.dumps(result, indent=1))

    rows, t0 = result["rows"], time.perf_counter()
    if a.section == "step":
        step_section(rows, save)
    elif a.section == "peers":
        peers_section(traces, rows, save)
    else:
        for pair in ((a.pair,) if a.section == "replay" else ("7b", "1.5b")):
            methods = METHODS if a.section == "replay" else PEARL
            if a.providers:
                wanted = a.providers.split(",")
                methods = [m for m in methods if m[0] in wanted]
            replay_section(pair, traces, methods, rows, save)
    result["section_s"] = time.perf_counter() - t0
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
