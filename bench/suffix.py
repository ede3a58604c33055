"""Suffix decoding on work that repeats across requests (issue 67; `make bench-suffix`), real pair,
greedy, whole replies (up to EOS), requests of a set in sequence through one engine so that the
suffix cache grows as a server's would.

Three agent-like sets of our own: an agent's successive edits of one file (each step asks for one
change to the file as the previous reply left it, and the reply rewrites the whole file), tool
calls of one JSON shape, and records put through one template; and HumanEval[:--humaneval]
(text unlike anything the cache holds: suffix decoding must not be slower than `ar` there), after
`make bench-ngram`'s input-grounded prompts (single unrelated requests whose replies copy their own
prompt: `suffix` must keep up with `ngram` there). Providers: `ar`, `ngram` (the
row's own text), `suffix` (chains), `suffix-tree` (tree="auto": Arctic's frequency tree priced by
our costs) and `hybrid-suffix` (each with its own cache, empty when its set starts), `sd` γ auto. Every provider runs request k before any runs request k + 1 (a drifting
machine weighs on all alike); the others neither read nor join a cache. Per set: tokens/s
(prefill included), decode tokens/s, τ (tokens per target forward) and the ratios to `ar`, with
the first request of each set (a cold cache) reported apart. Every provider must give `ar`'s
tokens. With --arctic, Arctic Inference's SuffixDecodingCache drafts inside our engine too
(`arctic-suffix`, bench/peers/arctic.py: built from its source package first), verified by the same
target and policies, its cache fresh for each set.

    python bench/suffix.py --out bench/results/cpu_suffix.json [--max-new-tokens 512] [--arctic]
"""
from __future__ import annotations

import argparse
import re
import sys
import time

FILE = '''import json


class Inventory:
    def __init__(self, path):
        self.path = path
        self.items = {}

    def load(self):
        with open(self.path) as f:
            self.items = json.load(f)

    def save(self):
        with open(self.path, "w") as f:
            json.dump(self.items, f, indent=2)

    def add(self, name, count):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count):
        have = self.items.get(name, 0)
        if count > have:
            raise ValueError(f"only {have} of {name} left")
        self.items[name] = have - count

    def total(self):
        return sum(self.items.values())

    def report(self):
        lines = []
        for name, count in sorted(self.items.items()):
            lines.append(f"{name}: {count}")
        return "\\n".join(lines)
'''
EDITS = ["Make `remove` delete the item when its count reaches zero", "Add a `low_stock(self, limit)` method that "
         "returns the names with fewer than `limit` items", "Make `add` raise ValueError when count is not positive",
         "Add a one-line docstring to `report`", "Make `save` write the items sorted by name", "Add a `__len__` that "
         "returns the number of distinct items"]


def edit_step(edit: str):
    """An agent's step: the edit applied to the file as the previous reply left it (the first: FILE)."""
    def messages(previous: str | None) -> list[dict]:
        code = FILE
        if previous is not None:
            got = re.search(r"```(?:python)?\n(.*?)```", previous, re.S)
            code = got.group(1) if got else previous
        return [{"role": "user", "content": f"{edit}. Reply with the whole file only.\n\n```python\n{code}```"}]
    return messages


TOOLS = ("You can call one tool per turn. Answer with a single JSON object: {\"tool\": \"search_docs\" | \"run_sql\" | "
         "\"send_message\", \"arguments\": {...}} and nothing else.")
CALLS = ["Find the docs page about connection pooling.", "How many orders were placed yesterday? Query the orders "
         "table.", "Tell the on-call channel that the deploy finished.", "Find the docs page about retries and "
         "timeouts.", "What is the average basket size this week? Query the orders table.", "Tell Sam that the "
         "report is ready."]
TEMPLATE = ("Rewrite the record in this exact format, one field per line:\nName: <full name>\nRole: <role>\nTeam: "
            "<team>\nStarted: <YYYY-MM-DD>\nRecord: ")
RECORDS = ["joined 2021-03-14 as backend engineer on payments, Ana Souza", "Lee Min-jun, data analyst, growth team, "
           "since 2019-11-02", "2022-06-30: Priya Nair starts as SRE (infrastructure)", "designer Tom Becker, "
           "mobile team, from 2020-01-07", "Fatima Zahra, support lead for EMEA, started 2018-09-24",
           "QA engineer Jonas Berg (checkout team) joined on 2023-02-01"]
SETS = {
    "file_edits": [edit_step(e) for e in EDITS],
    "tool_calls": [[{"role": "system", "content": TOOLS}, {"role": "user", "content": c}] for c in CALLS],
    "templated_records": [[{"role": "user", "content": TEMPLATE + r}] for r in RECORDS],
}
PROVIDERS = ["ar", "ngram", "suffix", "suffix-tree", "hybrid-suffix", "sd"]
OPTIONS = {"suffix-tree": dict(method="suffix", tree="auto")}  # providers that are a method with options


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="bench/results/cpu_suffix.json")
    ap.add_argument("--max-new-tokens", type=int, default=512)
    ap.add_argument("--arctic", action="store_true", help="Arctic Inference's cache as a peer drafter (builds it)")
    ap.add_argument("--humaneval", type=int, default=4, help="HumanEval prompts run as a last set (0: none)")
    ap.add_argument("--copy", action=argparse.BooleanOptionalAction, default=True,
                    help="bench/ngram's input-grounded prompts as a set of single requests")
    args = ap.parse_args(argv)

    from tqdm import tqdm

    from specengine import Engine
    from specengine.benchmark import environment, save
    from specengine.methods.suffix_cache import SuffixCaches
    from specengine.models.fetch import DEFAULT_DRAFT, DEFAULT_TARGET

    engine = Engine.from_pretrained(DEFAULT_TARGET, draft=DEFAULT_DRAFT, max_seq_len=2048)
    engine.warmup()
    report = {"benchmark": "suffix", "max_new_tokens": args.max_new_tokens, "greedy": True, "whole_replies": True,
              "environment": environment(), "sets": {}}
    providers = PROVIDERS + (["arctic-suffix"] if args.arctic else [])
    sets = dict(SETS)
    if args.copy:  # single, unrelated requests whose replies copy their own prompt (`ngram`'s ground)
        from specengine.prompts import COPY_PROMPTS

        sets["copy_prompts"] = [p for _, p in COPY_PROMPTS]
    if args.humaneval:
        from specengine.prompts import humaneval

        sets["humaneval"] = [p["prompt"] for p in humaneval(args.humaneval)]
    for name, requests in sets.items():
        caches = {p: SuffixCaches(engine.config.suffix_cache_tokens) for p in providers}  # each starts empty
        if args.arctic:
            from peers import arctic

            arctic.install(arctic.cache())  # a fresh Arctic cache for the set
        runs, previous = {p: [] for p in providers}, None
        for request in tqdm(requests, desc=name, leave=False):
            messages = request(previous) if callable(request) else request
            for p in providers:
                engine.suffix_caches = caches[p]
                t = time.perf_counter()
                call = OPTIONS.get(p, dict(method=p))
                r = engine.generate(messages, max_new_tokens=args.max_new_tokens, suffix_cache="suffix" in p, **call)
                runs[p].append((time.perf_counter() - t, r.token_ids, r.stats))
                previous = r.text if p == "ar" else previous  # every provider writes ar's text
        rows = []
        for p, rs in runs.items():
            row = {"provider": p, "same_tokens_as_ar": all(t == a[1] for (_, t, _), a in zip(rs, runs["ar"]))}
            for part, sel in (("all", rs), ("cold", rs[:1]), ("warm", rs[1:])):
                wall, new = sum(w for w, _, _ in sel), sum(len(t) for _, t, _ in sel)
                decode = wall - sum(s["prefill_s"] for _, _, s in sel)
                row[part] = {"new_tokens": new, "tokens_per_s": new / wall, "decode_tokens_per_s": new / decode,
                             "tau": new / max(sum(s["target_forwards"] for _, _, s in sel), 1)}
            rows.append(row)
        ar = next(r for r in rows if r["provider"] == "ar")
        for row in rows:
            for part in ("all", "cold", "warm"):
                row[part]["x_ar"] = row[part]["tokens_per_s"] / ar[part]["tokens_per_s"]
                row[part]["x_ar_decode"] = row[part]["decode_tokens_per_s"] / ar[part]["decode_tokens_per_s"]
        report["sets"][name] = rows
        for row in rows:
            w = row["warm"]
            print(f"{name:18s} {row['provider']:14s} warm {w['tokens_per_s']:6.2f} tok/s  tau {w['tau']:.2f}  "
                  f"x ar {w['x_ar']:.2f} (decode {w['x_ar_decode']:.2f})  cold x ar {row['cold']['x_ar']:.2f}  "
                  f"same as ar {row['same_tokens_as_ar']}")
    save(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
