"""N-gram drafting, ours against llama.cpp's, on the same GGUF file, prompts and threads (issue 39:
llama.cpp's `lookup` is one of the peers a user compares with). CPU, real target, greedy.

- ours: `ar` and `ngram:auto` through run_benchmark, whole replies (stop at EOS, up to 512 tokens);
- llama.cpp: `llama-completion` (ar) and `llama-speculative-simple --spec-type ngram-simple`, with
  its defaults (a 12-token lookup) and with our sizes (a 3-token lookup, at most 10 drafted as
  transformers' prompt lookup), each prompt decoded to our reply's length with EOS ignored (its
  own timers; prefill apart).
Each family's n-gram / ar ratio comes from its own side-by-side runs; ours run first, then
llama.cpp's, prompt by prompt (every llama.cpp provider on a prompt before the next).

    python bench/llamacpp.py build
    python bench/ngram_llamacpp.py --out bench/results/cpu_ngram_llamacpp.json
"""
from __future__ import annotations

import argparse
import sys

import torch

from llamacpp import ar, build, speculative, version
from ngram_prompts import COPY_PROMPTS
from specengine import Engine
from specengine.benchmark import environment, run_benchmark, save
from specengine.models.fetch import DEFAULT_TARGET
from specengine.models.gguf_weights import gguf_file
from specengine.prompts import humaneval

LLAMA = {  # provider -> llama-speculative-simple n-gram options (None: plain decoding)
    "llama.cpp ar": None,
    "llama.cpp ngram-simple (defaults)": [],
    "llama.cpp ngram-simple (n 3, draft 10)": ["--spec-ngram-simple-size-n", "3", "--spec-draft-n-max", "10"],
}
NGRAMS = [k for k, opts in LLAMA.items() if opts is not None]


def llama_set(model: str, texts: list[str], lengths: list[int], threads: int) -> dict:
    """Decode tokens/s of every llama.cpp provider over the set (tokens / seconds, summed)."""
    tokens, seconds = {k: 0 for k in LLAMA}, {k: 0.0 for k in LLAMA}
    for text, n in zip(texts, lengths):
        for name, opts in LLAMA.items():
            if opts is None:
                got = ar(model, text, n, threads)
            else:
                got = speculative(model, None, text, n, threads, "ngram-simple", 0, extra=opts)
            tokens[name] += n
            seconds[name] += n / got["decode_tokens_per_s"]
        print(f"  {n} tokens; running tok/s: " + ", ".join(f"{k} {tokens[k] / seconds[k]:.2f}" for k in LLAMA), flush=True)
    return {k: tokens[k] / seconds[k] for k in LLAMA}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--humaneval", type=int, default=2)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--out", default="bench/results/cpu_ngram_llamacpp.json")
    args = ap.parse_args(argv)
    build()
    eng = Engine.from_pretrained(DEFAULT_TARGET, max_seq_len=2048)
    model = str(gguf_file(DEFAULT_TARGET))
    sets = {"copy": ("input-grounded (bench/ngram_prompts.py)", [p for _, p in COPY_PROMPTS]),
            "humaneval": ("HumanEval[:%d]" % args.humaneval, [p["prompt"] for p in humaneval(args.humaneval)])}
    report = {"benchmark": "ngram_llamacpp", "command": " ".join(["python"] + sys.argv), "llama_cpp": version(),
              "environment": environment(),
              "threads": args.threads, "sets": {}}
    for name, (label, prompts) in sets.items():
        ours = run_benchmark(eng, ["ar", "ngram:auto"], prompts=(label, prompts), max_new_tokens=512,
                             stop_at_eos=True, baseline="ar")
        lengths = [len(o) for o in ours["reference_outputs"]]
        texts = [eng.tokenizer.decode(ids) for ids in ours["prompt_ids"]]
        decode = {r["provider"]: r["decode_tokens_per_s"] for r in ours["results"]}
        decode.update(llama_set(model, texts, lengths, args.threads))
        report["sets"][name] = {
            "ours": ours, "decode_tokens_per_s": decode, "reply_tokens": lengths,
            "ngram_over_ar": {"ours": decode["ngram:auto"] / decode["ar"],
                              **{k: decode[k] / decode["llama.cpp ar"] for k in NGRAMS}},
            "ours_over_llama_cpp": {"ar": decode["ar"] / decode["llama.cpp ar"],
                                    "best ngram": decode["ngram:auto"] / max(decode[k] for k in NGRAMS)},
        }
        print(name, {k: round(v, 2) for k, v in decode.items()}, flush=True)
        print(name, "ngram / ar:", {k: round(v, 2) for k, v in report["sets"][name]["ngram_over_ar"].items()},
              "ours / llama.cpp:", {k: round(v, 2) for k, v in report["sets"][name]["ours_over_llama_cpp"].items()},
              flush=True)
    print(f"wrote {save(report, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
