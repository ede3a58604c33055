"""Multi-turn chat on `specengine serve`: time to first token of each turn, with and without
prefix reuse, side by side in one run (issue 41's goal: turn 2 >= 3x faster, same tokens).

Conversations are MT-bench's two-turn questions (we never train on them). Each conversation
sends its first question, then, once the answer has streamed in, the whole history plus the
second question, as a chat client does. Greedy, EOS honoured, so both settings do the same
work. The engine is loaded once and served twice per repeat, with reuse on and off, in
alternating order, each after one untimed warm-up request. Per turn: TTFT (request sent -> first text), prompt tokens, and the
cached ones (usage.prompt_tokens_details.cached_tokens).

  python bench/serve_multiturn.py --concurrency 1,2 --out bench/results/cpu_serve_multiturn.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time

import httpx
from tqdm.auto import tqdm

from serve_load import serving, sse_chunks  # a sibling: bench/ is the script's folder

from specengine import Engine
from specengine.benchmark import environment
from specengine.models.fetch import DEFAULT_DRAFT, DEFAULT_TARGET
from specengine.prompts import mtbench
from specengine.serve.server import create_app


async def turn(client, url, messages, max_tokens):
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0, first, text, usage = time.perf_counter(), None, "", None
    async for chunk in sse_chunks(client, url, body):
        if chunk.get("usage"):
            usage = chunk["usage"]
        elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
            first = first or time.perf_counter()
            text += chunk["choices"][0]["delta"]["content"]
    return {"ttft_s": (first or time.perf_counter()) - t0, "latency_s": time.perf_counter() - t0, "text": text,
            "prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]}


async def conversations(url, questions, concurrency, max_tokens, bar):
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient() as client:
        async def one(q):
            async with sem:
                messages, turns = [], []
                for ask in q["turns"]:
                    messages.append({"role": "user", "content": ask})
                    turns.append(await turn(client, url, messages, max_tokens))
                    messages.append({"role": "assistant", "content": turns[-1]["text"]})
                bar.update(1)
                return turns
        return await asyncio.gather(*(one(q) for q in questions))


def summary(runs: list[list[list[dict]]], t: int) -> dict:
    """Turn t over every repeat: median TTFT and token counts."""
    rows = [conv[t] for run in runs for conv in run]
    return {"ttft_median_s": statistics.median(r["ttft_s"] for r in rows),
            "ttft_mean_s": statistics.mean(r["ttft_s"] for r in rows),
            "prompt_tokens_mean": statistics.mean(r["prompt_tokens"] for r in rows),
            "cached_tokens_mean": statistics.mean(r["cached_tokens"] for r in rows)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--method", default="sd")
    ap.add_argument("--conversations", type=int, default=4, help="MT-bench questions (the first n)")
    ap.add_argument("--concurrency", default="1,2", help="conversations at once, one level after another")
    ap.add_argument("--max-tokens", type=int, default=256, help="per answer (a chat answer's usual length)")
    ap.add_argument("--repeats", type=int, default=2, help="each repeat serves with reuse on and off")
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    questions = mtbench(args.conversations)
    engine = Engine.from_pretrained(args.target, draft=args.draft, max_seq_len=2048, max_batch=args.max_batch)
    result = {"benchmark": "serve_multiturn", "target": args.target, "draft": args.draft, "method": args.method,
              "conversations": len(questions), "max_tokens": args.max_tokens, "repeats": args.repeats,
              "environment": environment(), "command": " ".join(sys.argv), "levels": []}
    for c in (int(x) for x in args.concurrency.split(",")):
        runs = {True: [], False: []}
        for r in range(args.repeats):
            for reuse in ((True, False) if r % 2 == 0 else (False, True)):
                app = create_app(engine, "m", max_batch=args.max_batch, method=args.method, prefix_reuse=reuse)
                with serving(app) as base, tqdm(total=len(questions), desc=f"c={c} repeat {r} reuse={reuse}") as bar:
                    httpx.post(base + "/v1/completions", json={"model": "m", "prompt": "warm up", "max_tokens": 4},
                               timeout=None).raise_for_status()  # a first round's one-time costs stay out of TTFT
                    runs[reuse].append(asyncio.run(conversations(base + "/v1/chat/completions", questions, c,
                                                                 args.max_tokens, bar)))
        texts = {reuse: [[t["text"] for t in conv] for run in runs[reuse] for conv in run] for reuse in runs}
        level = {"concurrency": c, "same_text_with_and_without_reuse": texts[True] == texts[False]}
        for t in (0, 1):
            turn = level[f"turn{t + 1}"] = {"reuse": summary(runs[True], t), "cold": summary(runs[False], t)}
            turn["ttft_speedup"] = turn["cold"]["ttft_median_s"] / turn["reuse"]["ttft_median_s"]
        print(json.dumps(level, indent=1), flush=True)
        level["runs"] = {("reuse" if k else "cold"): v for k, v in runs.items()}
        result["levels"].append(level)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
