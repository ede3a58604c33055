"""Methods run against stand-in runners and a MethodContext alone: no Engine, no model, no
runtime. Each stand-in is a bigram table (logits of the next token given the last one), so
the target's greedy text is a plain loop over its table, the independent reference here."""
from types import SimpleNamespace

import pytest
import torch

from specengine.methods import METHODS
from specengine.methods.base import CallInputs
from specengine.methods.context import MethodContext
from specengine.methods.sampling import SamplingParams
from specengine.methods.state import DecodeState
from specengine.timing import PhaseTimer

V, S = 16, 96
# the step-cost contract (runtime/step_costs.StepCosts): a draft step at a tenth of a decode, a flat verify
COSTS = SimpleNamespace(cost_ratio=0.1, draft_s=0.1, verify_s=lambda width: 1.0, draft_read_s=lambda width: 0.1)


class Cache:
    def __init__(self, rows: int):
        self.lens = torch.zeros(rows, dtype=torch.int32)

    def set_lens(self, lens):
        self.lens.copy_(lens)


class BigramRunner:
    """The runner entry points a method uses (verify, decode, cache), over a [V,V] table."""

    def __init__(self, table: torch.Tensor, rows: int = 1):
        self.table, self.cache, self.forwards = table, Cache(rows), 0

    def verify(self, tokens, tree_mask=None, attn_len=None, return_hidden=False):
        self.forwards += 1
        return self.table[tokens]

    def decode(self, token, attn_len=None, return_hidden=False):
        return self.verify(token[:, None])[:, 0]

    def prefill(self, tokens, lens, attn_len=None):  # a bigram keeps no state: its cache is its lengths
        self.cache.set_lens(lens)


def bigram(seed: int) -> torch.Tensor:
    return torch.randn(V, V, generator=torch.Generator().manual_seed(seed)) * 4


def greedy_text(table, prompt: list[int], n: int) -> list[int]:
    out = list(prompt)
    for _ in range(n):
        out.append(int(table[out[-1]].argmax()))
    return out[len(prompt):]


def run(method, target, draft, prompt: list[int], n: int) -> list[int]:
    """The driver's part, by hand: state, caches at n - 1 (the draft's where the method does not read the
    prompt into it itself), rounds, lengths set after each."""
    ctx = MethodContext(target, draft, torch.device("cpu"), step_costs=lambda state, width: COSTS)
    tokens = torch.zeros(1, S, dtype=torch.int64)
    tokens[0, : len(prompt)] = torch.tensor(prompt)
    state = DecodeState(tokens, torch.tensor([len(prompt)]), torch.ones(1, dtype=torch.bool), SamplingParams(),
                        torch.zeros(1), torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64))
    for runner in (target, draft) if not method.defers_draft_prefill else (target,):
        runner.prefill(state.tokens[:, : len(prompt) - 1], state.n - 1)
    row = SimpleNamespace(max_new=n, cache_key=None, ids=[], finish_reason=None, prompt_len=len(prompt), stops=[],
                          stop_ids=set())
    method.begin(ctx, CallInputs(state, [prompt], [row], prefill_s=0.0))
    timer = PhaseTimer(torch.device("cpu"))
    while int(state.n) < len(prompt) + n:
        out = method.round(state, timer)
        target.cache.set_lens(state.n - 1)
        if out.draft_lens is not None:
            draft.cache.set_lens(out.draft_lens)
        method.after_round(out.n_acc.tolist(), out.num_draft.tolist())
    return state.tokens[0, len(prompt): len(prompt) + n].tolist()


@pytest.mark.parametrize("name,kw", [("ar", {}), ("sd", {"gamma": 3}), ("sd", {"gamma": 1}), ("pearl", {"gamma": 2}),
                                     ("pearl", {})])
def test_a_method_needs_only_its_context(name, kw):
    target_table = bigram(0)
    draft_table = target_table.clone()
    draft_table[3] = bigram(1)[3]  # the draft disagrees after token 3: rejections happen
    prompt = [1, 2, 3]
    expected = greedy_text(target_table, prompt, 24)
    target, draft = BigramRunner(target_table), BigramRunner(draft_table)
    assert run(METHODS[name](**kw), target, draft, prompt, 24) == expected
    if name != "ar":
        assert target.forwards < 24  # speculation verified several tokens per target forward


def test_a_draft_that_always_agrees_is_always_accepted():
    table = bigram(2)
    target, draft = BigramRunner(table), BigramRunner(table.clone())
    method = METHODS["sd"](gamma=4)
    assert run(method, target, draft, [5], 25) == greedy_text(table, [5], 25)
    assert target.forwards == 5  # 5 tokens per round: 4 accepted drafts and the bonus
