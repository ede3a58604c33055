"""Record acceptance traces of a real pair on a CPU (trace.py says what a trace holds).

    python -m specengine.replay.record --out bench/results/trace_qwen25coder_1.5b_0.5b.safetensors

For each prompt: the target's greedy reply (`ar`), then for every position p a round could
start at, the round steps the methods use (methods/steps.py) run from the prefix tokens[:p]
exactly as a round would: the draft's chain with its confidences and SpecDec++'s head, the
parallel drafter's proposals and both kinds of token tree. The draft cache is kept two
tokens behind p (the catch-up every round does rewrites those), so one cache serves every p.
About 15 draft forwards per position: ~1 min per 128-token prompt on 2 cores (fp32 GGUF).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time

import torch

from ..errors import SpecEngineError
from ..methods.steps import draft_chain, draft_tree, parallel_draft, parallel_logits, positional_tree
from ..methods.token_tree import TreeShape
from .trace import TREE_PARTS, Trace, TraceSet

CHAIN_DEPTH = 8  # the longest chain the γ policies draft (auto, confidence, specdec++: gamma_max 8)
EXTRA = 17  # target tokens past the reply: a last round may verify up to PEARL's window (16) past it
TREES = {"sd": "4x4:8", "parallelspec": "3x4:8"}  # the best trees on the CPU (bench/results/cpu_e2e_trees.json)


class _HeadTap:
    """A draft-length policy that stops nothing and keeps SpecDec++'s head output per step."""
    wants_hidden = True

    def __init__(self, head):
        self.head, self.probs = head, []

    def begin_round(self, batch, device) -> None:
        self.probs = []

    def observe(self, hidden, j, run) -> bool:
        p = self.head.accept_prob(hidden) if self.head is not None else torch.zeros(hidden.shape[0])
        self.probs.append(p.float().to("cpu"))
        return False


def _optional(fn):
    try:
        return fn()
    except SpecEngineError:
        return None


def record_prompt(engine, name: str, prompt: list[int], new: int, depth: int = CHAIN_DEPTH,
                  trees: dict | None = None, progress=None) -> Trace:
    """One prompt's trace (batch 1, greedy, on the engine's pair)."""
    trees = TREES if trees is None else trees
    shapes = {kind: TreeShape.parse(spec) for kind, spec in trees.items()}
    if len(prompt) < 2:
        raise SpecEngineError("a traced prompt needs at least 2 tokens", "prompt")
    reply = engine.generate(prompt, method="ar", max_new_tokens=new + EXTRA, ignore_eos=True).token_ids
    seq = torch.tensor(prompt + reply)
    P, L0 = len(seq), len(prompt)
    head = _optional(lambda: engine.acceptance_head("greedy"))
    drafter = _optional(engine.parallel_drafter)
    k = drafter.meta.k_max if drafter is not None else 1
    gen, _ = engine._start(prompt, method="sd", gamma=depth, max_new_tokens=new + EXTRA, ignore_eos=True)
    state, ctx, draft = gen.state, gen.ctx, engine.draft
    state.tokens[0, :P] = seq.to(state.tokens.device)
    state.attn_len = engine.max_seq_len
    chain = torch.full((P, depth), -1, dtype=torch.int64)
    conf, hp = torch.zeros(P, depth), torch.zeros(P, depth)
    par = torch.full((P, k), -1, dtype=torch.int64)
    tree_rows = {kind: {part: torch.zeros(P, s.nodes + 1, dtype=torch.int64) for part in TREE_PARTS}
                 for kind, s in shapes.items()}
    tap = _HeadTap(head)

    def at(p):  # a round from tokens[:p]: the draft two behind (its catch-up rewrites p-2, p-1)
        state.n.fill_(p)
        draft.cache.set_lens(torch.full_like(draft.cache.lens, p - 2))

    for p in range(L0, min(L0 + new + depth, P)):
        at(p)
        toks, _, c = draft_chain(ctx, state, depth, policy=tap)
        chain[p], conf[p] = toks[0].cpu(), c[0].float().cpu()
        hp[p] = torch.stack(tap.probs, 1)[0]
        if drafter is not None:
            at(p)
            par[p] = parallel_draft(ctx, drafter, state, k, state.n, real_width=k + 1)[0][0].cpu()
        for kind, shape in shapes.items():
            at(p)
            if kind == "sd":
                tree = draft_tree(ctx, state, shape)
            elif drafter is not None:
                logits = parallel_logits(draft, drafter, state, shape.depth, state.n, shape.depth + 1)
                tree = positional_tree(state.last_tokens(), torch.log_softmax(logits.float(), -1), shape)
            else:
                continue
            for part in TREE_PARTS:
                value = getattr(tree, part)
                tree_rows[kind][part][p] = (value if value is not None else tree.tokens * 0)[0].cpu()
        if progress is not None:
            progress.update(1)
    return Trace(name, L0, new, seq, chain, conf, hp, par, tree_rows)


def commit_id() -> str:
    """This checkout's commit (with -dirty when it has changes), or "unknown"."""
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


@torch.inference_mode()
def record(engine, prompts: list[tuple[str, list[int]]], new: int, depth: int = CHAIN_DEPTH,
           trees: dict | None = None, meta: dict | None = None, show: bool = True) -> TraceSet:
    from tqdm import tqdm

    trees = TREES if trees is None else trees
    commit = commit_id()  # the code that records, read before it runs (the tree may change meanwhile)
    bar = tqdm(total=len(prompts) * (new + depth), desc="recording positions", disable=not show, file=sys.stderr)
    t0 = time.perf_counter()
    traces = [record_prompt(engine, name, ids, new, depth, trees, bar) for name, ids in prompts]
    bar.close()
    info = {"commit": commit, "new": new, "chain_depth": depth, "trees": dict(trees),
            "prompts": [name for name, _ in prompts], "vocab": engine.target.config.vocab_size,
            "record_s": round(time.perf_counter() - t0, 1), "greedy": True, **(meta or {})}
    return TraceSet(traces, info)


def main(argv=None) -> int:
    from ..models.fetch import DEFAULT_DRAFT, DEFAULT_TARGET
    from ..prompts import humaneval
    from .. import Engine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default=DEFAULT_DRAFT)
    ap.add_argument("--n-prompts", type=int, default=4, help="HumanEval prompts (the benchmarks' set), first n")
    ap.add_argument("--new", type=int, default=128, help="tokens per reply (EOS ignored)")
    ap.add_argument("--out", default="bench/results/trace_qwen25coder_1.5b_0.5b.safetensors")
    a = ap.parse_args(argv)
    engine = Engine.from_pretrained(a.target, draft=a.draft, device="cpu", dtype="float32", max_seq_len=2048)
    prompts = [(f"HumanEval/{i}", engine.encode(p["prompt"])[0][0]) for i, p in enumerate(humaneval(a.n_prompts))]
    traces = record(engine, prompts, a.new, meta={"target": a.target, "draft": a.draft, "dtype": "float32",
                                                  "command": " ".join(["python -m specengine.replay.record"] +
                                                                      (argv if argv is not None else sys.argv[1:]))})
    path = traces.save(a.out)
    print(f"wrote {path} ({path.stat().st_size / 1e3:.0f} kB, {len(prompts)} prompts x {a.new} tokens, "
          f"{traces.meta['record_s']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
