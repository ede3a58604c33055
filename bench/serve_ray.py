"""Replicas on Ray Serve against one plain server, the same bounded load (`make bench-ray`).

Providers, one after another in one run on one local Ray head: `plain` (create_app in this
process, no Ray), `ray1` (one replica behind Ray's proxy and our ingress, prefix routing), and two
replicas with Ray's default power-of-two-choices (`ray2-pow2`) and with our prefix-affinity
router (`ray2-prefix`). The load: MT-bench's two-turn chats (we never train on them), `--concurrency`
requests at once, every chat's first turn and then every chat's second (users come back after
reading), each answer `--max-tokens` long, greedy, streamed. Per provider:
tokens/s, request latency p50 / p99, time to first token p50, the prefix-cache hit rate of second
turns (cached / prompt tokens, as the server reports them in `usage`), and whether every answer
equals the plain server's. Ray's overhead per request is `ray1`'s p50 latency over `plain`'s.

    python bench/serve_ray.py --out bench/results/cpu_serve_ray.json
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import sys
import time

import httpx
from tqdm.auto import tqdm

from serve_load import pct, serving  # siblings: bench/ is the script's folder
from serve_multiturn import turn

from specengine import Engine, EngineConfig
from specengine.benchmark import environment
from specengine.prompts import mtbench
from specengine.serve.server import create_app


async def two_waves(url: str, questions: list, concurrency: int, max_tokens: int, bar) -> list[list[dict]]:
    """Every chat's first turn, then every chat's second (users come back after reading, while
    the others are served): a second turn finds its prefix only where its first turn ran."""
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient() as client:
        async def ask(messages):
            async with sem:
                out = await turn(client, url, messages, max_tokens)
                bar.update(1)
                return out
        first = await asyncio.gather(*(ask([{"role": "user", "content": q["turns"][0]}]) for q in questions))
        second = await asyncio.gather(*(ask([{"role": "user", "content": q["turns"][0]},
                                              {"role": "assistant", "content": a["text"]},
                                              {"role": "user", "content": q["turns"][1]}])
                                        for q, a in zip(questions, first)))
    return [[a, b] for a, b in zip(first, second)]


def measure(url: str, questions: list, concurrency: int, max_tokens: int) -> dict:
    httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "warm up", "max_tokens": 4},
               timeout=None).raise_for_status()  # first-round costs stay out of the figures
    with tqdm(total=2 * len(questions), desc=url, leave=False) as bar:
        t0 = time.perf_counter()
        convs = asyncio.run(two_waves(url + "/v1/chat/completions", questions, concurrency, max_tokens, bar))
        wall = time.perf_counter() - t0
    turns = [t for conv in convs for t in conv]
    lat = [t["latency_s"] for t in turns]
    second = [conv[1] for conv in convs if len(conv) > 1]
    return {"tokens_per_s": sum(t["completion_tokens"] for t in turns) / wall,
            "latency_p50_s": statistics.median(lat), "latency_p99_s": pct(lat, 0.99),
            "ttft_p50_s": statistics.median(t["ttft_s"] for t in turns),
            "second_turn_prefix_hit_rate": sum(t["cached_tokens"] for t in second)
            / max(sum(t["prompt_tokens"] for t in second), 1),
            "second_turns_cached_of_prompt": [[t["cached_tokens"], t["prompt_tokens"]] for t in second],
            "texts": [[t["text"] for t in conv] for conv in convs]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen2.5-coder-0.5b-instruct", help="a small model: the overhead shows")
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-batch", type=int, default=4)
    ap.add_argument("--providers", default="plain,ray1,ray2-pow2,ray2-prefix")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    import ray
    from ray import serve

    from specengine.serve.ray_app import ReplicaSpec, application

    questions = mtbench(args.conversations)
    config = EngineConfig(method="ar", max_seq_len=2048, max_batch=args.max_batch)
    core = {"max_batch": args.max_batch}
    cpus = os.cpu_count() or 2
    result = {"benchmark": "serve_ray", "target": args.target, "conversations": len(questions),
              "concurrency": args.concurrency, "max_tokens": args.max_tokens, "environment": environment(),
              "ray": ray.__version__, "command": " ".join(["python"] + sys.argv), "providers": {}}
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        for name in args.providers.split(","):
            if name == "plain":
                engine = Engine.from_pretrained(args.target, config=config)
                engine.warmup(batch=args.max_batch)
                with serving(create_app(engine, "m", **core)) as url:
                    row = measure(url, questions, args.concurrency, args.max_tokens)
                del engine
            else:
                n, router = (1, "prefix") if name == "ray1" else (2, name.split("-")[1])
                spec = ReplicaSpec(args.target, None, config, core, replicas=n, cpus=cpus / n, router=router)
                serve.run(application(spec, "m"), name="bench", route_prefix="/")
                row = measure(f"http://127.0.0.1:{port}", questions, args.concurrency, args.max_tokens)
                serve.delete("bench")
            result["providers"][name] = row
            print(name, {k: round(v, 3) for k, v in row.items() if isinstance(v, float)}, flush=True)
    finally:
        serve.shutdown()
        ray.shutdown()
    rows = result["providers"]
    base = rows.get("plain")
    for row in rows.values():
        row["same_text_as_plain"] = base is not None and row["texts"] == base["texts"]
    if base and "ray1" in rows:
        result["ray_overhead_p50"] = rows["ray1"]["latency_p50_s"] / base["latency_p50_s"] - 1
    if "ray2-pow2" in rows and "ray2-prefix" in rows:
        result["prefix_vs_pow2_hit_rate"] = (rows["ray2-prefix"]["second_turn_prefix_hit_rate"]
                                             / max(rows["ray2-pow2"]["second_turn_prefix_hit_rate"], 1e-9))
    print({k: round(v, 3) for k, v in result.items() if k in ("ray_overhead_p50", "prefix_vs_pow2_hit_rate")})
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
