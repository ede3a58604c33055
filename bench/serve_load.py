"""Load generator for `specengine serve`: throughput and latency at fixed concurrency levels.

Starts the server in-process on 127.0.0.1 (the real pair by default), then for each method
and each concurrency c sends `--requests` streamed completions (HumanEval prompts, greedy,
fixed max_tokens, EOS ignored so every request does the same work) from c concurrent
clients, and stops by itself. Per request: time to first token (TTFT), inter-token latency
(ITL = (t_last - t_first) / (tokens - 1); speculative rounds deliver several tokens at once)
and the gaps between streamed chunks. Writes JSON with the environment.

  python bench/serve_load.py --methods ar,sd:4 --concurrency 1,2,4,8 --out bench/results/cpu_serve_load.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import sys
import threading
import time
from contextlib import contextmanager

import httpx
import uvicorn
from tqdm.auto import tqdm

from specengine import Engine
from specengine.benchmark import environment
from specengine.models.fetch import DEFAULT_DRAFT, DEFAULT_TARGET
from specengine.prompts import humaneval
from specengine.serve.server import create_app


@contextmanager
def serving(app):
    """A `create_app` server on a free loopback port, in a thread of this process (the engine is
    loaded once and served under several settings in one run). Yields the base URL; on exit stops
    the server and the app's engine loop."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise RuntimeError("the server thread died while starting (see its log above)")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        app.state.engine.shutdown()


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else None


async def sse_chunks(client, url, body):
    """The JSON chunks of one streamed OpenAI response."""
    async with client.stream("POST", url, json=body, timeout=None) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                yield json.loads(line[6:])


async def one(client, url, model, prompt, max_tokens):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0, times, tokens, text = time.perf_counter(), [], 0, ""
    async for chunk in sse_chunks(client, url, body):
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
        elif chunk["choices"] and chunk["choices"][0]["text"]:
            times.append(time.perf_counter())
            text += chunk["choices"][0]["text"]
    end = time.perf_counter()
    return {"ttft_s": times[0] - t0 if times else None, "latency_s": end - t0, "tokens": tokens,
            "itl_s": (times[-1] - times[0]) / max(tokens - 1, 1) if times else None,
            "chunk_gaps_s": [b - a for a, b in zip(times, times[1:])], "text": text}


async def level(url, model, prompts, c, max_tokens, bar):
    sem = asyncio.Semaphore(c)
    async with httpx.AsyncClient() as client:
        async def run(p):
            async with sem:
                r = await one(client, url, model, p, max_tokens)
                bar.update(1)
                return r
        t0 = time.perf_counter()
        results = await asyncio.gather(*(run(p) for p in prompts))
        return results, time.perf_counter() - t0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--methods", default="ar,sd:4", help="ar | sd:γ | pearl | parallelspec:k, comma-separated")
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--requests", type=int, default=8, help="requests per concurrency level")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-batch", type=int, default=8)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    prompts = [p["prompt"] for p in humaneval(args.requests)]
    engine = Engine.from_pretrained(args.target, draft=args.draft, dtype=args.dtype, max_seq_len=1024,
                                    max_batch=args.max_batch)
    result = {"benchmark": "serve_load", "target": args.target, "draft": args.draft, "dtype": args.dtype,
              "max_tokens": args.max_tokens, "requests_per_level": args.requests, "environment": environment(),
              "rows": []}
    for spec in args.methods.split(","):
        method, _, gamma = spec.partition(":")
        app = create_app(engine, "m", max_batch=args.max_batch, max_waiting=1024, method=method,
                         gamma=int(gamma) if gamma else None)
        with serving(app) as base:
            url = base + "/v1/completions"
            texts = None
            for c in levels:
                with tqdm(total=len(prompts), desc=f"{spec} c={c}") as bar:
                    res, wall = asyncio.run(level(url, "m", prompts, c, args.max_tokens, bar))
                same = texts is None or [r["text"] for r in res] == texts  # batching never changes greedy output
                texts = texts or [r["text"] for r in res]
                gaps = [g for r in res for g in r["chunk_gaps_s"]]
                ttft, itl = [r["ttft_s"] for r in res], [r["itl_s"] for r in res]
                row = {"method": spec, "concurrency": c, "requests": len(res), "wall_s": wall,
                       "tokens": sum(r["tokens"] for r in res), "tokens_per_s": sum(r["tokens"] for r in res) / wall,
                       "requests_per_s": len(res) / wall,
                       "ttft_p50_s": pct(ttft, 0.5), "ttft_p99_s": pct(ttft, 0.99),
                       "itl_p50_s": pct(itl, 0.5), "itl_p99_s": pct(itl, 0.99),
                       "chunk_gap_p50_s": pct(gaps, 0.5), "chunk_gap_p99_s": pct(gaps, 0.99),
                       "latency_mean_s": statistics.mean(r["latency_s"] for r in res),
                       "same_text_as_concurrency_1": same}
                result["rows"].append(row)
                print(json.dumps({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
