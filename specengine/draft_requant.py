"""The grid's "gguf-q4_0" option for a draft (precision.py): its cost from the Q4_0 kernels' measured
table and its acceptance from how often it agrees with the target (docs/design.md, "A draft in fewer
bits"). The requantization itself is models/requant.py."""
from __future__ import annotations

import torch
from tqdm.auto import tqdm

from .models import cpu_matmul, quant_plan
from .models.quant_linear import quant_layers
from .models.requant import CALIBRATION_TOKENS, FORMAT, fingerprint, formats_after, requantized
from .runtime.kv_cache import KVCache


@torch.inference_mode()
def _greedy(model, ids: torch.Tensor) -> torch.Tensor:
    cache = KVCache.for_model(model, 1, ids.shape[0])
    return model(ids[None], cache)[0].argmax(-1)


def agreement(target, draft, requant, ids, progress: bool = True) -> dict:
    """{"file": a, "requantized": a'}: how often each draft's greedy next token equals the target's
    over `ids` (teacher-forced; a tensor, or a callable making it: a tokenizer is loaded only when
    measuring), measured once per pair of models and machine (the machine table)."""
    key = f"requant:{FORMAT}:agreement:{fingerprint(target)}:{fingerprint(draft)}"
    table = cpu_matmul._load_table()
    if key in table:
        return {k: table[key][k] for k in ("file", "requantized", "tokens")}
    ids = (ids() if callable(ids) else ids)[:CALIBRATION_TOKENS]
    with tqdm(total=3, desc="measuring the requantized draft's agreement (once per machine)",
              disable=not progress, leave=False) as bar:
        want = _greedy(target, ids)
        bar.update(1)
        got = {}
        for name, model in (("file", draft), ("requantized", requant())):
            got[name] = (_greedy(model, ids) == want).float().mean().item()
            bar.update(1)
    got["tokens"] = int(ids.shape[0])
    cpu_matmul._save_table({key: dict(got)})
    return got


class Candidate:
    """The grid's "gguf-q4_0" option for one draft: its requantized model, built on first need (a
    cached cost and agreement need none)."""

    def __init__(self, blocks, progress: bool = True):
        self.blocks, self.progress, self._model = blocks, progress, None

    def model(self):
        if self._model is None:
            self._model = requantized(self.blocks, self.progress)
        return self._model

    def step_seconds(self, rows, progress: bool = True) -> dict[int, float]:
        """rows -> seconds of one forward's matmuls in Q4_0: from the machine table where every group
        was measured (by its formats and shape, as quant_plan files them), else measured on the model."""
        counts: dict[str, int] = {}
        for layer in quant_layers(self.blocks):
            key = quant_plan.group_key(formats_after(layer), layer)
            counts[key] = counts.get(key, 0) + 1
        table = cpu_matmul._load_table()
        if not all(str(r) in table.get(k, {}).get("ms", {}) for k in counts for r in rows):
            return quant_plan.step_seconds(self.model(), rows, progress)
        return quant_plan.seconds_of(counts, table, self.blocks, rows, progress)


def calibration_ids(tokenizer) -> torch.Tensor:
    """The calibration text's token ids: this engine's own speculative loop (methods/sd.py), code
    like the coding models' work and no benchmark's prompt."""
    from pathlib import Path

    text = (Path(__file__).resolve().parent / "methods" / "sd.py").read_text()
    return torch.tensor(tokenizer(text)["input_ids"][:CALIBRATION_TOKENS], dtype=torch.int64)
