"""An acceptance trace: what the real pair decides on one prompt, position by position.

Recorded on a CPU in fp32 (record.py), replayed anywhere (replay.py). Indexed by absolute
position p in the row's token sequence (prompt, then the target's greedy tokens):

- `tokens[p]`: the sequence itself; the target's greedy token at p is tokens[p] for p >= prompt_len.
- `chain[p, d]`: the draft model's greedy chain from the prefix tokens[:p] (d = 0 is its
  proposal for position p), with `conf[p, d]` (the draft's probability of its own token: the
  `confidence` policy) and `head[p, d]` (SpecDec++'s P(accept) of that token). In greedy
  decoding a chain depends only on its prefix, so any draft prefix a method builds is
  "tokens[:m] then chain[m, :d]" for the first position m where it leaves the trace.
- `parallel[p, i]`: the parallel drafter's k proposals from tokens[:p].
- `tree.<kind>.{tokens,parent,depth,source}[p]`: the token tree drafted from tokens[:p]
  (kind "sd": the draft model's beam; "parallelspec": the parallel drafter's), node 0 the root.
Rows outside [prompt_len, prompt_len + new + depth) hold -1: never needed by a run of `new`
tokens. n-gram and suffix drafting need nothing more: they read the committed tokens.

One file holds every prompt's trace: safetensors, with the commit, prompts, pair and
shapes in its metadata (small enough to travel: ~25 KB per 128-token prompt).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import SpecEngineError
from ..methods.token_tree import TreeShape

TREE_PARTS = ("tokens", "parent", "depth", "source")


@dataclass
class Trace:
    name: str  # the prompt's name (HumanEval/0, ...)
    prompt_len: int
    new: int  # the tokens a replayed run generates (max_new_tokens, EOS ignored)
    tokens: torch.Tensor  # [P] int64
    chain: torch.Tensor  # [P,K] int64
    conf: torch.Tensor  # [P,K] float32
    head: torch.Tensor  # [P,K] float32
    parallel: torch.Tensor  # [P,k] int64
    trees: dict = field(default_factory=dict)  # kind -> {part: [P,N+1] int64}

    @property
    def length(self) -> int:
        return self.tokens.shape[0]

    @property
    def prompt(self) -> list[int]:
        return self.tokens[: self.prompt_len].tolist()

    @property
    def target_tokens(self) -> list[int]:
        """The target's greedy reply: what every method's replayed run must commit."""
        return self.tokens[self.prompt_len: self.prompt_len + self.new].tolist()

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {f"{prefix}.{k}": getattr(self, k) for k in ("tokens", "chain", "conf", "head", "parallel")}
        for kind, parts in self.trees.items():
            out.update({f"{prefix}.tree.{kind}.{k}": v for k, v in parts.items()})
        return out


@dataclass
class TraceSet:
    """Every prompt's trace plus what they were recorded with (metadata)."""
    traces: list[Trace]
    meta: dict

    @property
    def trees(self) -> dict[str, TreeShape]:
        return {kind: TreeShape.parse(spec) for kind, spec in self.meta.get("trees", {}).items()}

    def save(self, path) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for i, t in enumerate(self.traces):
            tensors.update({k: v.contiguous() for k, v in t.tensors(f"p{i}").items()})
        rows = [{"name": t.name, "prompt_len": t.prompt_len, "new": t.new} for t in self.traces]
        save_file(tensors, str(path), metadata={"meta": json.dumps(self.meta), "rows": json.dumps(rows)})
        return path

    @classmethod
    def load(cls, path) -> "TraceSet":
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise SpecEngineError(f"no acceptance trace at {path}; record one with `python -m specengine.replay.record`",
                                  "trace")
        try:
            with safe_open(str(path), "pt") as f:
                info = f.metadata() or {}
                tensors = {k: f.get_tensor(k) for k in f.keys()}
            meta, rows = json.loads(info["meta"]), json.loads(info["rows"])
        except Exception as e:  # noqa: BLE001 - any unreadable file gets the same clear message
            raise SpecEngineError(f"{path} is not an acceptance trace file ({type(e).__name__}: {e})", "trace") from e
        traces = []
        for i, row in enumerate(rows):
            pre = f"p{i}."
            trees = {}
            for k, v in tensors.items():
                if k.startswith(pre + "tree."):
                    kind, part = k[len(pre) + 5:].rsplit(".", 1)
                    trees.setdefault(kind, {})[part] = v
            traces.append(Trace(row["name"], row["prompt_len"], row["new"], tensors[pre + "tokens"],
                                tensors[pre + "chain"], tensors[pre + "conf"], tensors[pre + "head"],
                                tensors[pre + "parallel"], trees))
        return cls(traces, meta)
