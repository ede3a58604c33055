"""What a method may use during one generation: handed to it by the driver at `begin`.

Methods never reach the Engine. Everything a round needs comes in here, resolved by the API
(heads and drafters load lazily, on the first generation that asks, so a method that never
needs one never pays for it, and a missing one is an error of that call only):

- `target`, `draft`: runners with the entry points `decode`, `verify`, `drafter_forward`,
  `chain_graphs` and a `cache` whose lengths the round reads and sets (runtime/runner.py;
  tests pass stand-ins with the same entry points);
- `ops`: the engine's ops table (kernels/ops.py): `ops.rejection_sample`, `ops.commit_tokens`,
  and the draft sampler behind `sample_draft` (the call's filter, then `ops.draft_sample`);
- `step_costs(state, max_width)`: measured draft step and target forward costs, cached per
  batch size (runtime/step_costs.py);
- `acceptance_head(mode)`, `parallel_drafter()`: SpecDec++'s head, ParallelSpec's drafter;
- `side_stream()`: the second CUDA stream PEARL drafts on (None off CUDA);
- `acceptance`: what the engine's earlier calls learned of acceptance, so that γ auto starts
  from it rather than from a prior: the draft's rate per decoding mode (`CallInputs.mode`), and the n-gram
  methods' curves per match length (ngram_policy.py) per method and mode;
- `replay`: None, except in a benchmark replaying the real pair's decisions on random weights
  (specengine/replay): the round steps then take the draft's tokens from it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from ..kernels.ops import TORCH, Ops
from .sampling import sample_draft


def _missing(what: str):
    def fail(*_):
        raise RuntimeError(f"this method context has no {what}")
    return fail


@dataclass
class MethodContext:
    target: object
    draft: object | None
    device: torch.device
    ops: Ops = TORCH
    step_costs: Callable = _missing("step costs")
    acceptance_head: Callable = _missing("acceptance head")
    parallel_drafter: Callable = _missing("parallel drafter")
    side_stream: Callable = lambda: None  # noqa: E731 - no second stream unless on CUDA
    acceptance: dict = field(default_factory=dict)
    replay: object = None  # a benchmark's acceptance replay (specengine/replay), never set otherwise
    suffix_caches: object = None  # suffix decoding: earlier responses per key (methods/suffix_cache.py)

    def sample_draft(self, logits, params, seed, offset, pos: int):
        """One draft token per row (methods/sampling.py `sample_draft`, on this table's sampler)."""
        return sample_draft(logits, params, seed, offset, pos, self.ops.draft_sample)
