"""Structured output on the real pair (issue 66; `make bench-structured`): schema extraction and tool
calls, whole replies (up to EOS), every provider prompt by prompt in one run, greedy.

Providers: transformers `generate` with xgrammar's own logits processor (fp32 float weights: the
independent reference), and ours in the engine's default setting, constrained: `ar`, `sd` γ auto,
`ngram` auto and `hybrid` auto, the speculative ones with and without grammar drafting (`:nogd`),
and `sd` / `hybrid` unconstrained on the same prompts (what the grammar adds). Every constrained
output is parsed and validated against its schema (jsonschema); ours must equal constrained `ar`
token for token. The mask time is the host's seconds in the matchers per generated token, and as a
share of the decode time. With --llamacpp, llama.cpp (built by bench/peers/llamacpp.py from the
registry's llama-cpp-python source) runs the same GGUF target with `--json-schema`, its own
timers giving its decode time (its prefill apart; ours: decode_tokens_per_s for that ratio).

    python bench/structured.py --out bench/results/cpu_structured.json [--prompts 6] [--max-new-tokens 192] [--llamacpp]
"""
from __future__ import annotations

import argparse
import json
import sys
import time

PROMPTS = [  # (task, schema): extraction and tool calls, none taken from an evaluation set
    ("Extract the person from this note as JSON: 'Met Dana Whitfield (41) from Leeds at the rust meetup; "
     "she maintains a parser crate and prefers email.'",
     {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                       "city": {"type": "string"}, "contact": {"enum": ["email", "phone", "none"]}},
      "required": ["name", "age", "city", "contact"], "additionalProperties": False}),
    ("Turn this order into JSON: 'Two large margherita pizzas, one garlic bread, deliver to 12 Elm Road at 7pm, "
     "pay by card.'",
     {"type": "object", "properties": {
         "items": {"type": "array", "items": {"type": "object", "properties": {
             "name": {"type": "string"}, "quantity": {"type": "integer"}, "size": {"enum": ["small", "medium", "large",
                                                                                           "n/a"]}},
             "required": ["name", "quantity", "size"], "additionalProperties": False}},
         "address": {"type": "string"}, "time": {"type": "string"}, "payment": {"enum": ["card", "cash"]}},
      "required": ["items", "address", "time", "payment"], "additionalProperties": False}),
    ("Call the right tool for: 'What will the weather be in Osaka tomorrow, in celsius?' Answer with the call as JSON.",
     {"type": "object", "properties": {
         "tool": {"enum": ["get_weather", "search_web", "send_email"]},
         "arguments": {"type": "object", "properties": {"location": {"type": "string"}, "date": {"type": "string"},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["location", "date", "unit"], "additionalProperties": False}},
      "required": ["tool", "arguments"], "additionalProperties": False}),
    ("Classify this bug report as JSON: 'App crashes on startup after the 2.3 update when offline; stack trace "
     "points to the sync module.'",
     {"type": "object", "properties": {"component": {"enum": ["ui", "sync", "auth", "storage"]},
                                       "severity": {"enum": ["low", "medium", "high", "critical"]},
                                       "regression": {"type": "boolean"}, "summary": {"type": "string"}},
      "required": ["component", "severity", "regression", "summary"], "additionalProperties": False}),
    ("Call the right tool for: 'Email Priya that the design review moved to Thursday 3pm.' Answer with the call "
     "as JSON.",
     {"type": "object", "properties": {
         "tool": {"enum": ["get_weather", "search_web", "send_email"]},
         "arguments": {"type": "object", "properties": {"to": {"type": "string"}, "subject": {"type": "string"},
                                                        "body": {"type": "string"}},
                       "required": ["to", "subject", "body"], "additionalProperties": False}},
      "required": ["tool", "arguments"], "additionalProperties": False}),
    ("List the functions in this code as JSON: 'def load(path): ...\\ndef save(obj, path, overwrite=False): ...\\n"
     "def _tmp(): ...'",
     {"type": "object", "properties": {"functions": {"type": "array", "items": {"type": "object", "properties": {
         "name": {"type": "string"}, "parameters": {"type": "array", "items": {"type": "string"}},
         "private": {"type": "boolean"}}, "required": ["name", "parameters", "private"],
         "additionalProperties": False}}}, "required": ["functions"], "additionalProperties": False}),
]
OURS = ["ar", "sd", "sd:nogd", "ngram", "ngram:nogd", "hybrid", "hybrid:nogd"]
FREE = ["sd:free", "hybrid:free"]  # unconstrained, same prompts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/cpu_structured.json")
    ap.add_argument("--prompts", type=int, default=len(PROMPTS))
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--no-hf", action="store_true", help="leave transformers out (its fp32 1.5B is the slowest)")
    ap.add_argument("--llamacpp", action="store_true", help="llama.cpp --json-schema on the target's GGUF too "
                    "(builds it first: ~8 minutes on 2 cores)")
    args = ap.parse_args(argv)

    import jsonschema
    import torch
    import xgrammar as xgr
    from tqdm import tqdm

    from specengine import Engine
    from specengine.benchmark import environment, save
    from specengine.models.fetch import DEFAULT_DRAFT, DEFAULT_TARGET, fetch

    engine = Engine.from_pretrained(DEFAULT_TARGET, draft=DEFAULT_DRAFT, max_seq_len=1024)
    engine.warmup()
    prompts = [([{"role": "user", "content": task}], schema) for task, schema in PROMPTS[: args.prompts]]
    hf = None
    if not args.no_hf:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(fetch(DEFAULT_TARGET, float_weights=True),
                                                  dtype=torch.float32).eval()
        info = xgr.TokenizerInfo.from_huggingface(engine.tokenizer, vocab_size=hf.config.vocab_size,
                                                  stop_token_ids=sorted(engine.eos_ids))
        hf_compiler = xgr.GrammarCompiler(info)

    def ours(spec: str, messages, schema):
        method, _, mode = spec.partition(":")
        opts = {} if mode == "free" else {"json_schema": schema, "grammar_draft": mode != "nogd"}
        r = engine.generate(messages, max_new_tokens=args.max_new_tokens, method=method, **opts)
        return r.token_ids, r.text, r.stats

    def reference(messages, schema):
        ids = torch.tensor([engine.encode(messages)[0][0]])
        proc = xgr.contrib.hf.LogitsProcessor(hf_compiler.compile_json_schema(json.dumps(schema),
                                                                             any_whitespace=False))
        with torch.inference_mode():
            out = hf.generate(ids, max_new_tokens=args.max_new_tokens, do_sample=False, logits_processor=[proc],
                              eos_token_id=sorted(engine.eos_ids), pad_token_id=0)[0, ids.shape[1]:].tolist()
        return out, engine.decode(out), None

    providers = {p: (lambda m, s, p=p: ours(p, m, s)) for p in OURS + FREE}
    if hf is not None:
        providers["hf+xgrammar"] = reference
    if args.llamacpp:
        from peers import llamacpp
        from specengine.models.fetch import cache_dir

        llamacpp.build()
        gguf, threads = cache_dir() / "gguf" / f"{DEFAULT_TARGET}.gguf", torch.get_num_threads()

        def llama(messages, schema):
            text = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            r = llamacpp.constrained(gguf, text, schema, args.max_new_tokens, threads)
            return [0] * r["new_tokens"], r["text"], {"llamacpp_decode_s": r["decode_s"], "prefill_s": r["prefill_s"]}

        providers["llama.cpp+json-schema"] = llama
    for run in providers.values():  # warm-up: first-call allocations, the grammar compiler
        run(*prompts[0])
    timed = {p: [] for p in providers}
    for messages, schema in tqdm(prompts, desc="structured", leave=False):
        for p, run in providers.items():  # prompt by prompt: a drifting machine weighs on every provider alike
            t = time.perf_counter()
            toks, text, stats = run(messages, schema)
            timed[p].append((time.perf_counter() - t, toks, text, stats))

    rows = []
    for p, runs in timed.items():
        wall, new = sum(w for w, *_ in runs), sum(len(t) for _, t, _, _ in runs)
        row = {"provider": p, "new_tokens": new, "wall_time_s": wall, "tokens_per_s": new / wall}
        if not p.endswith(":free"):
            valid = 0
            for (_, _, text, _), (_, schema) in zip(runs, prompts):
                try:
                    jsonschema.validate(json.loads(text), schema)
                    valid += 1
                except (ValueError, jsonschema.ValidationError):
                    pass
            row["valid_outputs"] = f"{valid}/{len(runs)}"
            if p in OURS:  # the peers run other numerics (fp32 float weights; llama.cpp's kernels)
                row["same_tokens_as_constrained_ar"] = all(t == a[1] for (_, t, _, _), a in zip(runs, timed["ar"]))
        stats = [s for *_, s in runs if s]
        if stats and "llamacpp_decode_s" in stats[0]:  # its own timers: decode apart from prefill and start-up
            row["decode_tokens_per_s"] = new / sum(s["llamacpp_decode_s"] for s in stats)
            row["note"] = "wall time includes llama.cpp's process start and model load per prompt"
        elif stats:
            decode_s = sum(w - s["prefill_s"] for (w, *_), s in zip(runs, stats))
            row["decode_tokens_per_s"] = new / decode_s
            row["tokens_per_target_forward"] = new / max(sum(s["target_forwards"] for s in stats), 1)
            if stats[0].get("grammar_mask_s") is not None:
                mask = sum(s["grammar_mask_s"] for s in stats)
                row["mask_ms_per_token"] = 1e3 * mask / max(new, 1)
                row["mask_share_of_decode"] = mask / decode_s
                row["grammar_tokens"] = sum(s["grammar_tokens"] for s in stats)
        rows.append(row)
    rate = {r["provider"]: r["tokens_per_s"] for r in rows}
    dec = {r["provider"]: r.get("decode_tokens_per_s") for r in rows}
    best = max((p for p in OURS if p != "ar"), key=rate.get)
    report = {"benchmark": "structured", "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
              "greedy": True, "whole_replies": True, "environment": environment(), "results": rows,
              "goals": {"best_constrained": best,
                        "best_constrained_vs_constrained_ar": rate[best] / rate["ar"],
                        "best_constrained_vs_constrained_ar_decode": dec[best] / dec["ar"],  # prefill apart
                        "best_constrained_vs_best_unconstrained": rate[best] / max(rate[p] for p in FREE),
                        **({"constrained_ar_vs_hf_xgrammar": rate["ar"] / rate["hf+xgrammar"]} if hf else {}),
                        **({"best_constrained_vs_llamacpp_decode": dec[best] / dec["llama.cpp+json-schema"]}
                           if args.llamacpp else {})},
              "outputs": {p: [text for _, _, text, _ in runs] for p, runs in timed.items()
                          if p in ("ar", "hf+xgrammar")}}
    save(report, args.out)
    for r in rows:
        print(f"{r['provider']:14s} {r['tokens_per_s']:7.2f} tok/s  valid {r.get('valid_outputs', '-'):5s}  "
              f"same as ar {r.get('same_tokens_as_constrained_ar', '-')!s:5s}  "
              f"mask {r.get('mask_ms_per_token', 0):.3f} ms/token ({100 * r.get('mask_share_of_decode', 0):.2f}%)  "
              f"grammar tokens {r.get('grammar_tokens', '-')}")
    print(json.dumps(report["goals"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
