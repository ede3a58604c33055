"""Soak benchmark for `specengine serve` (a benchmark, not a timed test): N requests on the
loopback at concurrency C against tiny random models, a mixed load, and the server's memory.

The server runs as its own process (`specengine serve`, sd γ 3, 4 rows), so its resident
memory is read from /proc/<pid>/status alone. The mix, by request index: streamed and not,
greedy and sampled, stop strings, clients that hang up mid-stream, and bad requests (wrong
types, out-of-range values, an unknown model). Recorded: server RSS every 100 requests, 5xx
count (must be 0), rows in use at the end (must be 0, from /metrics), and whether every
greedy output equals the same request run alone (each greedy prompt is asked once alone
first, before the load). Goal: RSS after the first 100 requests grows by <= 5% over the rest.

  python bench/serve_soak.py --requests 1000 --concurrency 8 --out bench/results/cpu_serve_soak.json
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from tqdm.auto import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import save_tiny  # noqa: E402  (the test suite's tiny random checkpoints)

from specengine.benchmark import environment  # noqa: E402

MODEL = "tiny"
PROMPTS = ["def add(a, b):\n", "x = [1", "for i in range(3", "import os", "class A:", "while x:", "y = (", "z = {"]
BAD = [{"temperature": "hot"}, {"top_p": 0}, {"max_tokens": 0}, {"n": 2}, {"model": "other"}, {"prompt": ""},
       {"temperature": 1e39}, {"stop": [""]}, {"ignore_eos": 0}]


def rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def metric(url: str, name: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return float("nan")


def job(i: int) -> dict:
    """What request i asks (deterministic in i)."""
    prompt = PROMPTS[i % len(PROMPTS)] + str(i % 7)
    kind = ("bad", "disconnect", "stream", "sampled", "stop", "plain", "stream", "plain")[i % 8]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4 + i % 5, "temperature": 0, "ignore_eos": True}
    if kind == "bad":
        body.update(BAD[(i // 8) % len(BAD)])
    elif kind == "sampled":
        body.update(temperature=0.8, top_p=0.9, seed=i)
    elif kind == "stop":
        body.update(stop=["\n", "0"], max_tokens=12)
    elif kind in ("stream", "disconnect"):
        body.update(stream=True, max_tokens=24 if kind == "disconnect" else body["max_tokens"])
    return dict(i=i, kind=kind, body=body)


def send(client: httpx.Client, url: str, j: dict) -> dict:
    body = j["body"]
    if body.get("stream"):
        text = ""
        with client.stream("POST", url + "/v1/completions", json=body) as r:
            status = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    status = 500
                    break
                text += chunk["choices"][0]["text"]
                if j["kind"] == "disconnect" and text:
                    break  # hang up mid-stream: the server must free the row
        return dict(j, status=status, text=text)
    r = client.post(url + "/v1/completions", json=body)
    text = r.json()["choices"][0]["text"] if r.status_code == 200 else None
    return dict(j, status=r.status_code, text=text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--out", default="bench/results/cpu_serve_soak.json")
    args = ap.parse_args(argv)

    tmp = Path(tempfile.mkdtemp())
    save_tiny(tmp / "target", "llama", seed=0, scale=4.0)
    save_tiny(tmp / "draft", "llama", seed=5, scale=4.0)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "specengine.cli", "serve", "--target", str(tmp / "target"), "--draft", str(tmp / "draft"),
           "--model-name", MODEL, "--method", "sd", "--gamma", "3", "--max-batch", "4", "--max-seq-len", "256",
           "--dtype", "float32", "--port", str(port), "--max-waiting", "256"]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ})
    try:
        for _ in range(600):
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        jobs = [job(i) for i in range(args.requests)]
        with httpx.Client(timeout=120) as client:
            alone = {}  # each greedy non-stream prompt once, alone, before the load
            for j in jobs:
                key = (j["body"]["prompt"], j["body"]["max_tokens"], tuple(j["body"].get("stop") or ()))
                if j["kind"] in ("plain", "stop", "stream") and key not in alone:
                    body = {**j["body"], "stream": False}
                    alone[key] = client.post(url + "/v1/completions", json=body).json()["choices"][0]["text"]
            rss, results = [], []
            with ThreadPoolExecutor(args.concurrency) as pool:
                clients = [httpx.Client(timeout=120) for _ in range(args.concurrency)]
                futures = [pool.submit(send, clients[i % args.concurrency], url, j) for i, j in enumerate(jobs)]
                for n, f in enumerate(tqdm(futures, desc="soak requests"), 1):
                    results.append(f.result())
                    if n % 100 == 0:
                        rss.append(dict(requests=n, rss_mb=rss_kb(server.pid) / 1024))
                for c in clients:
                    c.close()
        time.sleep(0.5)  # the last aborts reach the loop
        five_xx = sum(r["status"] >= 500 for r in results)
        bad_ok = all(400 <= r["status"] < 500 for r in results if r["kind"] == "bad")
        greedy = [r for r in results if r["kind"] in ("plain", "stop", "stream")]
        same = [r["text"] == alone[(r["body"]["prompt"], r["body"]["max_tokens"], tuple(r["body"].get("stop") or ()))]
                for r in greedy]
        growth = (rss[-1]["rss_mb"] - rss[0]["rss_mb"]) / rss[0]["rss_mb"] if len(rss) > 1 else None
        out = dict(environment=environment(), command=" ".join(sys.argv), requests=args.requests,
                   concurrency=args.concurrency, server=" ".join(cmd[2:]), rss_every_100=rss,
                   rss_growth_after_first_100=growth, goal_rss_growth=0.05, five_xx=five_xx,
                   bad_requests_all_4xx=bad_ok, rows_running_at_end=metric(url, "specengine_requests_running"),
                   requests_waiting_at_end=metric(url, "specengine_requests_waiting"),
                   aborted=metric(url, "specengine_requests_aborted_total"),
                   greedy_requests=len(greedy), greedy_equal_alone=sum(same),
                   kinds={k: sum(r["kind"] == k for r in results) for k in {r["kind"] for r in results}})
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(json.dumps({k: v for k, v in out.items() if k != "environment"}, indent=1))
        ok = five_xx == 0 and bad_ok and out["rows_running_at_end"] == 0 and sum(same) == len(same)
        return 0 if ok else 1
    finally:
        server.terminate()
        server.wait(10)


if __name__ == "__main__":
    sys.exit(main())
