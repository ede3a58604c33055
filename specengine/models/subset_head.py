"""A draft's LM head over the frequent part of the vocabulary (FR-Spec, Zhao et al. 2025).

On a CPU the head is a large share of a small draft's step: Qwen2.5-Coder-0.5B's 151,936 rows
of 896 take 2.7 ms of a ~9.5 ms step in Q8_0, and 0.5 ms over the 32,768 most frequent tokens
(2-core Zen 5 VM). `SubsetHead` computes the logits of the ids it keeps and leaves -inf
elsewhere, so every sampler, kernel and graph still sees the full vocabulary: the draft's q
is zero outside the kept ids, greedy never picks them, and a sampled draft never proposes
them. The target verifies every proposal, so greedy output is `ar`'s and sampling keeps the
target's distribution; a token outside the set only lowers that round's acceptance.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import skip_init

from .decoder import Linear
from .quant_linear import QuantLinear


class SubsetHead(nn.Module):
    """logits[..., ids] = head(h), -inf elsewhere; `full` is the head it was cut from."""

    def __init__(self, head: nn.Module, ids: torch.Tensor, full: nn.Module):
        super().__init__()
        self.head = head
        self.register_buffer("ids", ids.to(torch.int64), persistent=False)
        self.full = [full]  # in a list: not a submodule (not planned, moved or counted twice)
        self.in_features, self.out_features = full.in_features, full.out_features

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        sub = self.head(h)
        out = sub.new_full((*sub.shape[:-1], self.out_features), float("-inf"))
        return out.index_copy_(-1, self.ids, sub)


def _rows(head: nn.Module, ids: torch.Tensor) -> nn.Module:
    """A head of the same kind holding rows `ids` of `head` (a copy)."""
    if isinstance(head, QuantLinear):
        if len(head.qtypes) != 1:
            raise ValueError("an LM head of several merged segments cannot be cut")
        (q, w), = head.segments()  # the file's row layout (an interleaved one unpacked)
        bias = None if head.bias is None else head.bias.data[ids]
        small = QuantLinear([(q, w[ids].contiguous())], bias)
        small.pack(any(n is not None for n in head.packed))  # held as the full head was
        return small
    head.plain()  # planned by an earlier engine (oneDNN-packed): plain weights again
    # skip_init: no random initialisation of weights that are replaced at once
    small = skip_init(Linear, head.in_features, len(ids), bias=head.bias is not None,
                      device=head.weight.device, dtype=head.weight.dtype)
    small.weight = nn.Parameter(head.weight.data[ids].clone(), requires_grad=False)
    if head.bias is not None:
        small.bias = nn.Parameter(head.bias.data[ids].clone(), requires_grad=False)
    return small


def set_head_vocab(model, ids: torch.Tensor | None) -> None:
    """Give `model` (a decoder.Transformer) an LM head over `ids` (None: its full head again),
    in place; engines built on the same model object each set what they want."""
    full = model.lm_head.full[0] if isinstance(model.lm_head, SubsetHead) else model.lm_head
    if ids is None:
        model.lm_head = full
        return
    ids = ids.to(device=next(t for t in (*full.parameters(), *full.buffers())).device)
    model.lm_head = SubsetHead(_rows(full, ids), ids, full)
