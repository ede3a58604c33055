"""Untrained stand-ins for the shipped artifacts: an acceptance head and a parallel drafter
with random weights, for tests that need the machinery, not a good prediction."""
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
