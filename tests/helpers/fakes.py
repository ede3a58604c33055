"""Untrained stand-ins for the shipped artifacts: an acceptance head and a parallel drafter
with random weights, for tests that need the machinery, not a good prediction; and pinned step
costs that steer a method's cost-driven choices."""
import torch

from specengine.drafting.acceptance_head import AcceptanceHead, HeadMeta, model_fingerprint
from specengine.drafting.parallel_drafter import DrafterMeta, ParallelDrafter


def random_head(draft_model, seed=0, bias=0.0):
    torch.manual_seed(seed)
    cfg = draft_model.config
    head = AcceptanceHead(HeadMeta(cfg.hidden_size, cfg.own_vocab_size, model_fingerprint(cfg), "greedy", 2, "test"))
    with torch.no_grad():
        head.out.bias.fill_(bias)
    return head


def random_drafter(model, k_max=4, seed=0):
    torch.manual_seed(seed)
    cfg = model.config
    d = ParallelDrafter(model, DrafterMeta(cfg.hidden_size, cfg.own_vocab_size, model_fingerprint(cfg), k_max, 4, "t"))
    with torch.no_grad():  # non-zero adapters: mask rows really differ from the plain draft
        for lora in d.adapters.values():
            lora.lora_b.normal_(std=0.05)
    return d


def flushing_costs(state, width, draft=True):
    """Pinned step costs (an engine's `step_costs`) under which PEARL's window is 2 (draft 0.5 of a step),
    a pre-verify round wins at the prior's acceptance and a post-verify round loses to a plain step (every
    width costs one step): the round after an accepted window verifies its pending draft alone
    (`pearl_round.flush_pending`)."""
    from specengine.runtime.step_costs import StepCosts

    return StepCosts(state.batch, 0.5, tuple(1.0 for _ in range(width)))
