"""GGUF weights kept as blocks vs dequantized, on this CPU, in one run (issue 38's first figures).

1. Kernel: the target's merged gate/up shape (17920 x 1536) per block format, 1 / 5 / 9 rows,
   our compiled kernel (`specengine._quantext`) beside bf16 and fp32 `F.linear` on the same shape.
2. End to end on the real pair (HumanEval prompts, greedy, EOS ignored): `ar`, `sd` γ 3 and
   γ auto (and `pearl` on the blocks) with weights="gguf" (fp32 activations), with the default
   (weights and dtype "auto": the measured plan's choice) and with weights="float" in bf16 and
   fp32; the process's resident memory with each engine loaded and its KV cache allocated
   (the blocks first, so that no freed float model inflates their figure).
3. With --llamacpp (`make bench-gguf`): llama.cpp on the same files, prompts and threads
   (bench/peers/llamacpp.py): its `ar`, its speculative decoding with the 0.5B draft (draft max 3
   and 6) and its n-gram drafting, decode tokens/s from its own timers.

    python bench/gguf_cpu.py --out bench/results/cpu_gguf_first.json [--n-prompts 2 --max-new-tokens 48]
    python bench/gguf_cpu.py --llamacpp --out bench/results/cpu_gguf_vs_llamacpp_<kind>.json
    python bench/gguf_cpu.py --streams [avx2 ...] --out bench/results/cpu_gguf_streams_<kind>.json
    python bench/gguf_cpu.py --first-reply 4 --out bench/results/cpu_gguf_first_reply_<kind>.json
(<kind>: specengine.machine.cpu_kind(), e.g. avx512_zen5; `make bench-gguf` names them so)
"""
from __future__ import annotations

import argparse
import gc
import sys
import time

import torch

from specengine import Engine
from specengine.benchmark import environment, run_benchmark, save
from specengine.machine import last_level_cache_bytes
from specengine.models.fetch import DEFAULT_DRAFT, DEFAULT_TARGET
from specengine.models.quant_linear import EXT_CODES, _quantext, extension_isa
from specengine.models.quant_plan import PREFETCH_LEVELS

N, K = 17920, 1536
SETTINGS = {"gguf (fp32 activations)": dict(weights="gguf"), "auto (measured plan)": {},
            "float bf16": dict(weights="float", dtype="bfloat16"), "float fp32": dict(weights="float", dtype="float32")}
METHODS = {"gguf (fp32 activations)": ["ar", "sd:3", "sd:auto", "pearl"]}  # others: ar, sd:3, sd:auto


def rss_bytes() -> int:
    """Resident memory of this process now (Linux /proc)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def memory(eng, before: int) -> dict:
    """Resident memory with the engine loaded and its KV cache allocated, and what it holds."""
    import os

    from specengine.models.gguf_weights import gguf_file

    held = sum(b.numel() * b.element_size() for r in (eng.target, eng.draft)
               for b in list(r.model.buffers()) + list(r.model.parameters()))
    kv = sum(r.cache.kv.numel() * r.cache.kv.element_size() for r in (eng.target, eng.draft) if r.cache is not None)
    files = sum(os.path.getsize(gguf_file(n)) for n in (DEFAULT_TARGET, DEFAULT_DRAFT))
    now = rss_bytes()
    return {"rss_bytes": now, "rss_before_load_bytes": before, "model_bytes": held, "kv_bytes": kv,
            "gguf_files_bytes": files, "rss_over_files_plus_kv": now / (files + kv),
            "engine_rss_over_files_plus_kv": (now - before) / (files + kv)}


def forward_ms(runner, ids, widths, reps: int, max_len: int) -> dict[int, float]:
    """The runner's forward of w tokens (the last w of ids [1, T]) after the prefill of ids into a
    cache of max_len positions, best of reps, per width; the runner's batch-invariant width covers
    the widest, as a call's does."""
    with torch.inference_mode():
        runner.invariance.ensure(1, max(widths))  # as a call with that widest verify does (generation.py)
        runner.allocate(1, max_len)
        runner.prefill(ids, torch.tensor([ids.shape[1]]))
        attn = int(runner.cache.lens.max())
        return {w: best_ms(lambda: runner.verify(ids[:, -w:], attn_len=attn + w), reps) for w in widths}


def best_ms(fn, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def blocks(qtype: str) -> torch.Tensor:
    """Random rows of `qtype` blocks with finite scales, of the gate/up shape (what the kernel's speed
    depends on: the bytes)."""
    from specengine.kernels.quant_matmul import random_blocks

    return random_blocks(qtype, N, K)


def kernels() -> list[dict]:
    rows = []
    dense = {dt: torch.randn(N, K).to(dt) for dt in (torch.bfloat16, torch.float32)}
    for m in (1, 5, 9):
        x = torch.randn(m, K)
        for dt, w in dense.items():
            name = f"F.linear {str(dt).removeprefix('torch.')}"
            rows.append(dict(provider=name, rows=m, bytes=w.numel() * w.element_size(),
                             ms=best_ms(lambda: torch.nn.functional.linear(x.to(dt), w))))
        for qtype, code in EXT_CODES.items():
            if qtype in ("Q4_0", "Q5_K"):
                continue  # not in the real files
            w = blocks(qtype)
            rows.append(dict(provider=f"ours {qtype}", rows=m, bytes=w.numel(),
                             ms=best_ms(lambda: _quantext.quant_matmul(x, w, code))))
    for r in rows:
        r["GB_per_s"] = r["bytes"] / r["ms"] / 1e6
        print(f"{r['provider']:18s} rows {r['rows']}: {r['ms']:7.2f} ms  {r['GB_per_s']:5.1f} GB/s of weights", flush=True)
    return rows


def read_bandwidth(buf: torch.Tensor, reps: int = 5) -> float:
    """This machine's read bandwidth (bytes/s, all threads): the best of `reps` reads of `buf` (uint8 of
    `stream_bytes()`, in the engine's pages), streamed as the kernels stream weights (`read_stream`;
    torch's own sum reads 25% slower on a 2-core Zen 4). What a one-row matvec can at best reach."""
    return buf.numel() / best_ms(lambda: _quantext.read_stream(buf), reps) * 1e3


def in_engine_pages(t: torch.Tensor) -> torch.Tensor:
    """`t` in the pages an engine holds its weights in (2 MiB where `huge_pages` is on: huge_pages.py)."""
    from specengine import huge_pages

    holder = torch.nn.Module()
    holder.register_buffer("t", t)
    huge_pages.hold(holder)
    return holder.t


def stream_bytes() -> int:
    """Bytes every format's stream weight and the bandwidth probe read: at least twice the last-level
    cache and 512 MiB. Equal for all, so no format runs partly from cache: on a Xeon whose VM reports a
    480 MiB L3, 16 gate/up shapes each (250 MB of Q4_K, 360 MB of Q6_K) put Q4_K at 106% of a 512 MiB
    probe's rate and Q6_K at 74%, a gap mostly of where the bytes came from. At most 2 GiB (packing
    holds ~4x the weight at once; 960 MiB peaked at 4.2 GB resident)."""
    return min(max(2 * last_level_cache_bytes(), 512 << 20), 2 << 30)


def streams(isas: list[str], rows=(1, 2, 4, 5, 8), rounds: int = 5) -> list[dict]:
    """The interleaved (x8) kernel, as decoding runs it, per instruction-set copy, prefetch level (the
    cache the weight stream is prefetched into; the planner sets the faster, `quant_plan.choose_prefetch`)
    and format, on the gate/up shape stacked to `stream_bytes()` (a one-row rate is then a stream rate, for
    every format alike): GB/s of weights, and each width's cost in one-row calls. A shared VM's bandwidth
    drifts by tens of percent within a minute, so the copies and widths take turns, `rounds` times, and
    each keeps its best (`--streams avx2` on an AVX-512 machine checks the AVX2 copy's arithmetic; its
    stream rate says nothing of an AVX2-only CPU). Weights and probe sit in the pages an engine holds its
    weights in (`in_engine_pages`), streamed at the prefetch distance the planner filed for this machine
    (4 KiB where none was).

    Two ratios to the read bandwidth: `of_bandwidth`, the kernel's best one-row call over the best probe
    read of the whole format's run (every prefetch setting, every round: ~8x the kernel's samples, so on a
    drifting VM it leans low), and `of_bandwidth_paired`, the median over rounds of the one-row call over
    the probe read right after it (the probe at the setting it read fastest at first; both best of 2):
    two reads of one moment, what the issue's ">= 90% of the measured read bandwidth" asks."""
    from specengine.kernels.quant_pack import pack_x8

    from specengine import huge_pages

    from specengine.models import quant_plan

    out, widest, level, nbytes = [], _quantext.isa(), quant_plan.prefetch_setting(_quantext), stream_bytes()
    quant_plan.set_prefetch(_quantext, quant_plan.filed_prefetch() or level)  # the distance the planner chose here
    ahead = _quantext.prefetch_distance()
    probe, pages = in_engine_pages(torch.ones(nbytes, dtype=torch.uint8)), "2M" if huge_pages.enabled() else "4K"
    xs = {m: torch.randn(m, K) for m in rows}
    turns = [(isa, lv) for isa in isas for lv in (PREFETCH_LEVELS[:1] if isa == "baseline" else PREFETCH_LEVELS)]  # baseline: no prefetch

    def probe_at(setting: str, reps: int) -> float:
        quant_plan.set_prefetch(_quantext, setting)
        return read_bandwidth(probe, reps=reps)

    try:
        for qtype in ("Q4_K", "Q5_0", "Q6_K", "Q4_0"):
            b = blocks(qtype)
            repeat = -(-nbytes // b.numel())
            w = in_engine_pages(pack_x8(torch.cat([b] * repeat), qtype))
            first = {s: probe_at(s, 3) for s in quant_plan.PREFETCH_SETTINGS}
            fastest = max(first, key=first.get)  # the probe's setting for the paired reads
            best, bw, paired = {}, max(first.values()), {}
            for _ in range(rounds):
                for setting in quant_plan.PREFETCH_SETTINGS:  # beside the kernels' turns: the best of the run
                    bw = max(bw, probe_at(setting, 2))
                for isa, lv in turns:
                    for m in rows:
                        _quantext.set_isa(isa)
                        _quantext.set_prefetch(lv)
                        _quantext.set_prefetch_distance(ahead)
                        ms = best_ms(lambda: _quantext.quant_matmul_x8(xs[m], w, EXT_CODES[qtype], repeat * N), reps=2)
                        best[isa, lv, m] = min(best.get((isa, lv, m), ms), ms)
                        if m == rows[0]:  # the probe's read of the same moment
                            paired.setdefault((isa, lv), []).append(w.numel() / ms * 1e3 / probe_at(fastest, 2))
            for isa, lv in turns:
                ratios = sorted(paired[isa, lv])
                got = [dict(isa=isa, prefetch=lv, prefetch_distance=ahead, pages=pages, qtype=qtype, rows=m, weight_bytes=w.numel(), ms=best[isa, lv, m],
                            GB_per_s=w.numel() / best[isa, lv, m] / 1e6, x_one_row=best[isa, lv, m] / best[isa, lv, rows[0]],
                            read_bandwidth_GB_per_s=bw / 1e9, of_bandwidth=w.numel() / best[isa, lv, m] * 1e3 / bw)
                       for m in rows]
                got[0].update(of_bandwidth_paired=ratios[len(ratios) // 2], paired_ratios=paired[isa, lv],
                              probe_setting=fastest)
                out += got
                print(f"{isa:11s} {lv} {qtype} (read {bw / 1e9:4.1f} GB/s): one row {got[0]['of_bandwidth']:.0%} of it, "
                      f"{got[0]['of_bandwidth_paired']:.0%} paired ({ratios[0]:.0%}-{ratios[-1]:.0%});  "
                      + "  ".join(f"{r['rows']} rows {r['GB_per_s']:5.1f} GB/s x{r['x_one_row']:.2f}" for r in got), flush=True)
            del w
    finally:
        _quantext.set_isa(widest)
        quant_plan.set_prefetch(_quantext, level)
    return out


def llamacpp_providers(n_prompts: int, new: int) -> dict:
    """llama.cpp's providers on our prompts, threads and files: mean decode tokens/s per provider."""
    from peers import llamacpp
    from specengine.models.gguf_weights import gguf_file
    from specengine.prompts import humaneval

    target, draft, threads = gguf_file(DEFAULT_TARGET), gguf_file(DEFAULT_DRAFT), torch.get_num_threads()
    runs = {"ar": lambda p: llamacpp.ar(target, p, new, threads),
            "draft max 3": lambda p: llamacpp.speculative(target, draft, p, new, threads, "draft-simple", 3),
            "draft max 6": lambda p: llamacpp.speculative(target, draft, p, new, threads, "draft-simple", 6),
            "ngram-simple": lambda p: llamacpp.speculative(target, None, p, new, threads, "ngram-simple", 3)}
    out = {"version": llamacpp.version(), "threads": threads}
    for name, run in runs.items():
        rows = [run(p["prompt"]) for p in humaneval(n_prompts)]
        out[name] = {"decode_tokens_per_s": sum(r["decode_tokens_per_s"] for r in rows) / len(rows), "runs": rows}
        print(f"llama.cpp {name:13s}: {out[name]['decode_tokens_per_s']:6.2f} decode tok/s", flush=True)
    return out


def decode_rate(stats: dict) -> float:
    """New tokens over the call's wall time less its prefill: one-time work that lands inside the
    call counts (stats["decode_tokens_per_s"], the plan's measured rate, times rounds only)."""
    return stats["new_tokens"] / max(stats["wall_time_s"] - stats["prefill_s"], 1e-9)


LONG_PARTS = 7  # HumanEval problems a "humaneval-long" prompt joins: ~1,000 tokens


def prompt_texts(eng, prompt_set: str, n: int) -> list[str]:
    """The first n prompts of a set as the text both engines are given. "humaneval-long": a long prompt
    for a short reply (a file of LONG_PARTS functions to go on with; the i-th joins problems 7i..7i+6),
    where the draft's read of the prompt costs more than a short reply's drafting can save."""
    from specengine.prompts import humaneval, mtbench

    if prompt_set == "humaneval":
        return [p["prompt"] for p in humaneval(n)]
    if prompt_set == "humaneval-long":
        parts = [p["prompt"] for p in humaneval(n * LONG_PARTS)]
        return ["\n".join(parts[i * LONG_PARTS:(i + 1) * LONG_PARTS]) for i in range(n)]
    return [eng.tokenizer.apply_chat_template([{"role": "user", "content": q["turns"][0]}], tokenize=False,
                                              add_generation_prompt=True) for q in mtbench(n)]


AR_AFTER = "ours ar, after"  # our `ar` again after our other methods on the prompt (interleaved)


def interleaved(eng, n_prompts: int, new: int, repeats: int, llama: bool, prompt_set: str = "humaneval") -> dict:
    """Providers interleaved prompt by prompt and repeated (a shared VM's speed drifts by +-20%
    within minutes, so providers run one after another compare two moments): per prompt and
    repeat, every provider once, decode tokens/s; each ratio is taken between runs of the same
    prompt and repeat, and its median reported (with the lowest, for ours against `ar`). Our `ar` runs
    before and after our other methods and each is compared with the two's mean time per token, so a
    drift across the prompt's runs moves both sides alike (one `ar` run had read every method of a
    prompt 0.86-0.92x in a fast moment, `pearl` with all rounds plain included). Ours: the
    engine's default plan, every cost-driven method (`sd`, `ngram`, `hybrid`, `pearl`), each checked
    to give `ar`'s tokens. `prompt_set`: "humaneval" (code completions), "mtbench" (MT-bench's first
    turns, chat-templated into one text that both engines read: prose, where the code pair agrees least)
    or "humaneval-long" (~1,000-token prompts: end to end, where the draft's prefill shows)."""
    import statistics

    prompts = prompt_texts(eng, prompt_set, n_prompts)

    def ours(method, **kw):
        def run(prompt):
            out = eng.generate(prompt, max_new_tokens=new, method=method, ignore_eos=True, **kw)
            s = out.stats
            why = {k: s[k] for k in ("gamma_mean", "plain_rounds", "rounds", "acceptance_rate", "round_cost_factors",
                                     "predicted_tokens_per_s", "draft_prefills_deferred")
                   if s.get(k) is not None}  # to read a slow run back (did the draft read the prompt, and when)
            return {"decode_tokens_per_s": decode_rate(s), "prediction_error": s.get("prediction_error"),
                    "end_to_end_tokens_per_s": s["new_tokens"] / s["wall_time_s"], "prefill_s": s["prefill_s"],
                    "token_ids": list(out.token_ids), **why}
        return run

    # every method the issue holds to "never slower than plain decoding" (#64), each against `ar` per prompt
    ours_methods = {"ours ar": ours("ar"), "ours sd:auto": ours("sd", gamma="auto"),
                    "ours ngram:auto": ours("ngram", gamma="auto"), "ours hybrid:auto": ours("hybrid", gamma="auto"),
                    "ours pearl": ours("pearl")}
    providers = dict(ours_methods)
    if llama:
        from peers import llamacpp
        from specengine.models.gguf_weights import gguf_file

        target, draft, threads = gguf_file(DEFAULT_TARGET), gguf_file(DEFAULT_DRAFT), torch.get_num_threads()
        providers = {"llama.cpp ar": lambda p: llamacpp.ar(target, p, new, threads),
                     "llama.cpp ngram-simple": lambda p: llamacpp.speculative(target, None, p, new, threads,
                                                                              "ngram-simple", 3),
                     "llama.cpp draft max 3": lambda p: llamacpp.speculative(target, draft, p, new, threads,
                                                                             "draft-simple", 3),
                     **providers}
    eng.warmup()
    same, ar_ids = True, None  # every method of ours gave `ar`'s tokens on every prompt and repeat
    peer_info = None  # llama.cpp's system_info line: the instruction sets it was built for
    runs = []  # (repeat, prompt, provider, decode tokens/s)
    for rep in range(repeats):
        for i, p in enumerate(prompts):
            for name, run in [*providers.items(), (AR_AFTER, providers["ours ar"])]:
                r = run(p)
                peer_info = r.pop("system_info", None) or peer_info
                if "token_ids" in r:
                    ids = r.pop("token_ids")
                    if name == "ours ar":  # the first of ours on each prompt: the reference
                        ar_ids = ids
                    r["same_tokens_as_ar"] = ids == ar_ids
                    same &= r["same_tokens_as_ar"]
                runs.append({"repeat": rep, "prompt": i, "provider": name, **r})
                print(f"interleaved r{rep} p{i} {name:24s}: {r['decode_tokens_per_s']:6.2f} decode tok/s", flush=True)
    keys = sorted({(r["repeat"], r["prompt"]) for r in runs})

    def bracketed(field: str) -> dict:
        """(repeat, prompt, provider) -> runs' `field`; our `ar` at the mean of its two runs' time per token
        (bracketing the other methods)."""
        got = {(r["repeat"], r["prompt"], r["provider"]): r[field] for r in runs if field in r}
        for k in keys:
            got[k + ("ours ar",)] = 2 / (1 / got[k + ("ours ar",)] + 1 / got.pop(k + (AR_AFTER,)))
        return got

    rate = bracketed("decode_tokens_per_s")
    ratios = {}
    for num, den in [(n, "ours ar") for n in ours_methods if n != "ours ar"] + [("ours ar", "llama.cpp ar"),
                                                                            ("ours sd:auto", "llama.cpp ar")]:
        if all((k + (num,)) in rate and (k + (den,)) in rate for k in keys):
            ratios[f"{num} / {den}"] = statistics.median(rate[k + (num,)] / rate[k + (den,)] for k in keys)
    if llama:  # best of each side, per prompt and repeat
        ours_best = [max(rate[k + (n,)] for n in providers if n.startswith("ours")) for k in keys]
        theirs = [max(rate[k + (n,)] for n in providers if n.startswith("llama.cpp")) for k in keys]
        ratios["ours best / llama.cpp best"] = statistics.median(a / b for a, b in zip(ours_best, theirs))
    errors = {}  # per provider of ours: the plan's predicted / measured decode rate - 1, per run
    for r in runs:
        if r.get("prediction_error") is not None:
            errors.setdefault(r["provider"], []).append(r["prediction_error"])
    errors = {name: statistics.median(e) for name, e in errors.items()}
    lowest = {f"{n} / ours ar": min(rate[k + (n,)] / rate[k + ("ours ar",)] for k in keys)
              for n in ours_methods if n != "ours ar"}  # "never slower": the worst prompt and repeat
    # the control: our `ar` against itself on the same prompt, after / before the other methods (the same
    # work: what a lowest ratio above may owe to the machine alone)
    raw = {(r["repeat"], r["prompt"], r["provider"]): r["decode_tokens_per_s"] for r in runs}
    drift = [raw[k + (AR_AFTER,)] / raw[k + ("ours ar",)] for k in keys]
    control = {"ours ar, after / before": {"median": statistics.median(drift), "lowest": min(drift),
                                           "highest": max(drift)}}
    # the same against our `ar` with each call's prefill counted (the draft's included: `sd` reads the prompt
    # twice, so what its decoding saves on a short reply can go to the draft's prefill)
    e2e = bracketed("end_to_end_tokens_per_s")
    pairs = [(n, "ours ar") for n in ours_methods if n != "ours ar"] + [("ours ar", "llama.cpp ar"),
                                                                        ("ours sd:auto", "llama.cpp ar")]
    end_to_end = {f"{num} / {den}": statistics.median(e2e[k + (num,)] / e2e[k + (den,)] for k in keys)
                  for num, den in pairs if all(e2e.get(k + (num,)) and e2e.get(k + (den,)) for k in keys)}
    lowest.update({f"end to end {n} / ours ar": min(e2e[k + (n,)] / e2e[k + ("ours ar",)] for k in keys)
                   for n in ours_methods if n != "ours ar"})
    for k, v in ratios.items():
        print(f"median {k}: {v:.3f}" + (f" (lowest {lowest[k]:.3f})" if k in lowest else ""), flush=True)
    for k, v in end_to_end.items():
        low = lowest.get(f"end to end {k}")
        print(f"median end to end, prefill counted, {k}: {v:.3f}" + (f" (lowest {low:.3f})" if low else ""), flush=True)
    for name, e in errors.items():
        print(f"median prediction error {name}: {e:+.1%}", flush=True)
    print("control, our ar after / before on the same prompt: median {median:.3f}, lowest {lowest:.3f}, "
          "highest {highest:.3f}".format(**control["ours ar, after / before"]), flush=True)
    print(f"every method of ours gave ar's tokens: {same}", flush=True)
    peer = {"llama.cpp": {"version": llamacpp.version(), "system_info": peer_info}} if llama else {}
    return {"repeats": repeats, "prompts": n_prompts, "prompt_set": prompt_set, "new_tokens": new, **peer, "runs": runs, "median_ratios": ratios,
            "lowest_ratios": lowest, "control_ratios": control, "end_to_end_median_ratios": end_to_end, "prediction_error_median": errors,
            "same_tokens_as_ar": same}


def agreement(eng, llama_runs: list[dict], n_prompts: int, new: int) -> dict:
    """Greedy tokens of our quantized target against llama.cpp's on the same file and prompts:
    per prompt, how many of the first tokens agree before the first difference (llama.cpp's
    text re-tokenized with the model's tokenizer; its last token may be cut mid-word)."""
    from specengine.prompts import humaneval

    per = []
    for p, run in zip(humaneval(n_prompts), llama_runs):
        ours = eng.generate(p["prompt"], max_new_tokens=new, method="ar", ignore_eos=True).token_ids
        theirs = eng.tokenizer(run["text"], add_special_tokens=False).input_ids
        same = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        per.append({"same_first_tokens": same, "ours": len(ours), "theirs": len(theirs)})
    print("greedy agreement with llama.cpp (same first tokens):", [r["same_first_tokens"] for r in per], flush=True)
    return {"per_prompt": per, "tokens": new}


FIRST_REPLY = ("sd", "hybrid", "ngram", "pearl")  # the cost-driven methods, γ auto


def one_first_reply(method: str, new: int) -> dict:
    """In a fresh process: load the default pair, `warmup()`, then the same prompt three times; the
    first reply's decode rate over the second's (issue 64: no request pays one-time work), and as its
    control the second's over the third's: the same work, so its spread is the machine's."""
    from specengine.prompts import humaneval

    eng = Engine.from_pretrained(DEFAULT_TARGET, draft=DEFAULT_DRAFT, max_seq_len=1024)
    eng.warmup()
    prompt, rates, stats = humaneval(2)[1]["prompt"], [], []
    for _ in range(3):
        s = eng.generate(prompt, max_new_tokens=new, method=method, gamma="auto", ignore_eos=True).stats
        rates.append(decode_rate(s))
        stats.append({k: s.get(k) for k in ("draft_rounds", "draft_prefills_deferred", "plain_rounds", "rounds")})
    return {"method": method, "first_decode_tokens_per_s": rates[0], "next_decode_tokens_per_s": rates[1],
            "first_over_next": rates[0] / rates[1], "next_over_third": rates[1] / rates[2],
            "first_stats": stats[0], "next_stats": stats[1]}


def first_replies(processes: int, new: int) -> dict:
    """`processes` fresh processes per method, methods taking turns (the VM drifts): the
    first/next ratio per process and its median and minimum."""
    import json
    import statistics
    import subprocess

    runs = []
    for rep in range(processes):
        for method in FIRST_REPLY:
            proc = subprocess.run([sys.executable, __file__, "--one-first-reply", method, "--max-new-tokens", str(new)],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"first reply {method}, process {rep} failed (exit {proc.returncode}):\n"
                                 f"{proc.stderr[-3000:]}")
            runs.append(dict(json.loads(proc.stdout.strip().splitlines()[-1]), process=rep))
            print(f"first reply {method:7s} process {rep}: {runs[-1]['first_over_next']:.2f}x the next "
                  f"(control: the next {runs[-1]['next_over_third']:.2f}x the third)", flush=True)
    out = {"processes": processes, "new_tokens": new, "runs": runs}
    for key in ("first_over_next", "next_over_third"):
        ratios = {m: [r[key] for r in runs if r["method"] == m] for m in FIRST_REPLY}
        out[f"median_{key}"] = {m: statistics.median(v) for m, v in ratios.items()}
        out[f"min_{key}"] = {m: min(v) for m, v in ratios.items()}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/cpu_gguf_first.json")
    ap.add_argument("--n-prompts", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--llamacpp", action="store_true", help="add llama.cpp's providers (bench/peers/llamacpp.py build first)")
    ap.add_argument("--interleaved", type=int, default=0, metavar="R",
                    help="only the interleaved comparison, R repeats of every prompt (the README's per-CPU row)")
    ap.add_argument("--prompts", choices=["humaneval", "mtbench", "humaneval-long"], default="humaneval",
                    help="the interleaved comparison's prompt set (mtbench: chat prose, its first turns; "
                         "humaneval-long: ~1,000-token prompts, for a short reply's end to end)")
    ap.add_argument("--streams", metavar="ISA", nargs="*",
                    help="only the interleaved kernel's stream rates, per instruction-set copy (default: every one "
                         "this CPU runs), beside the machine's read bandwidth")
    ap.add_argument("--first-reply", type=int, default=0, metavar="P",
                    help="only the first reply after warmup() against the next, P fresh processes per method")
    ap.add_argument("--one-first-reply", metavar="METHOD", help=argparse.SUPPRESS)  # one such process
    args = ap.parse_args(argv)
    if args.llamacpp:
        from peers import llamacpp

        llamacpp.require()  # before the models load
    if args.one_first_reply:
        import json

        print(json.dumps(one_first_reply(args.one_first_reply, args.max_new_tokens)))
        return 0
    if args.first_reply:
        report = {"benchmark": "gguf_cpu_first_reply", "environment": environment(), "kernel_isa": extension_isa(),
                  "first_reply": first_replies(args.first_reply, args.max_new_tokens)}
        print(f"wrote {save(report, args.out)}")
        return 0
    if args.streams is not None:
        if _quantext is None:
            print("the quantized kernel is not built (make install builds it)", file=sys.stderr)
            return 2
        isas = args.streams or _quantext.isas()
        unknown = sorted(set(isas) - set(_quantext.isas()))
        if unknown:
            print(f"this CPU does not run {', '.join(unknown)}; it runs {', '.join(_quantext.isas())}", file=sys.stderr)
            return 2
        report = {"benchmark": "gguf_cpu_streams", "environment": environment(), "kernel_isa": extension_isa(),
                  "stream_bytes": stream_bytes(), "last_level_cache_bytes": last_level_cache_bytes(),
                  "streams": streams(isas)}
        print(f"wrote {save(report, args.out)}")
        return 0
    if args.interleaved:
        eng = Engine.from_pretrained(DEFAULT_TARGET, draft=DEFAULT_DRAFT,
                                     max_seq_len=2048 if args.prompts == "humaneval-long" else 1024)
        report = {"benchmark": "gguf_cpu_interleaved", "environment": environment(), "kernel_isa": extension_isa(),
                  "dtype_choice": {k: eng.dtype_choice.get(k) for k in ("target", "draft")},
                  "interleaved": interleaved(eng, args.n_prompts, args.max_new_tokens, args.interleaved, args.llamacpp,
                                              args.prompts)}
        print(f"wrote {save(report, args.out)}")
        return 0
    if _quantext is None:
        print("the quantized kernel is not built (make install builds it)", file=sys.stderr)
        return 2
    report = {"benchmark": "gguf_cpu", "environment": environment(), "kernel_isa": extension_isa(),
              "kernel_shape": [N, K], "kernels": kernels(), "e2e": {}}
    if args.llamacpp:
        report["llamacpp"] = llamacpp_providers(args.n_prompts, args.max_new_tokens)
    report["memory"] = {}
    for name, kw in SETTINGS.items():
        before = rss_bytes()
        eng = Engine.from_pretrained(DEFAULT_TARGET, draft=DEFAULT_DRAFT, max_seq_len=1024, **kw)
        report["e2e"][name] = run_benchmark(eng, METHODS.get(name, ["ar", "sd:3", "sd:auto"]), args.n_prompts,
                                            args.max_new_tokens)
        report["memory"][name] = memory(eng, before)
        if args.llamacpp and kw.get("weights") == "gguf":
            report["greedy_agreement_with_llamacpp"] = agreement(eng, report["llamacpp"]["ar"]["runs"],
                                                                 args.n_prompts, args.max_new_tokens)
        print(name, {r["provider"]: round(r["decode_tokens_per_s"], 2) for r in report["e2e"][name]["results"]},
              f"rss {report['memory'][name]['rss_bytes'] / 2**30:.2f} GiB", flush=True)
        del eng
        gc.collect()
    print(f"wrote {save(report, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
