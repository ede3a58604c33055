"""A draft whose vocabulary is a prefix of its target's, extended to the target's size.

Qwen2.5-7B and larger pad their embedding to 152,064 rows; Qwen2.5-0.5B has 151,936. The
tokenizer is the same (api.py checks it over the draft's range), so the draft can speculate
once its ids line up with the target's: `pad_vocab` appends zero rows to its embedding and
LM head, in place, and marks the extra ids as ones it must never emit (`ModelConfig.trained_vocab_size`:
the decoder sets their logits to -inf, so the draft's q is exactly zero there, greedy never picks them and a
sampled draft never proposes them). Every sampler and kernel then sees one vocabulary, and the
target's p over its extra ids still takes part in the residual: sampling stays the target's.
A target token past the draft's range (the target may emit its padded ids) embeds to zeros in
the draft, which only lowers that round's acceptance.
"""
from __future__ import annotations

import torch
from torch import nn

from ..errors import SpecEngineError
from .quant_linear import QuantEmbedding, QuantLinear


def _padded(rows: torch.Tensor, extra: int) -> torch.Tensor:
    return torch.cat([rows, rows.new_zeros(extra, *rows.shape[1:])])


def _pad_head(head, extra: int):
    if isinstance(head, QuantLinear):  # zero bytes are zero blocks (scale 0) in every GGUF format
        segments = head.segments()
        kind, last = segments[-1]
        bias = None if head.bias is None else _padded(head.bias.data, extra)
        padded = QuantLinear(segments[:-1] + [(kind, _padded(last, extra))], bias, head.parts)
        padded.pack(any(n is not None for n in head.packed))  # held as the old head was
        return padded
    head.weight = nn.Parameter(_padded(head.weight.data, extra), requires_grad=False)
    if head.bias is not None:
        head.bias = nn.Parameter(_padded(head.bias.data, extra), requires_grad=False)
    head.out_features += extra
    return head


def pad_vocab(model, size: int):
    """Extend `model` (a decoder.Transformer) to `size` ids in place; a no-op at its own size."""
    old = model.config.vocab_size
    if size == old:
        return model
    if size < old:
        raise SpecEngineError(f"the draft's vocabulary ({old} ids) is larger than the target's ({size}): ids the "
                              "target cannot score would be proposed", "draft")
    extra, emb, head = size - old, model.embed_tokens, model.lm_head
    if not isinstance(head, QuantLinear):
        head.plain()  # planned by an earlier engine (oneDNN-packed): plain weights again
    head_w = head.stored()[0][1] if isinstance(head, QuantLinear) else head.weight
    emb_w = emb.qweight if isinstance(emb, QuantEmbedding) else emb.weight
    tied = head_w.data_ptr() == emb_w.data_ptr()
    if isinstance(emb, QuantEmbedding):
        emb.qweight = _padded(emb.qweight, extra)
        model.lm_head = QuantLinear([(emb.qtype, emb.qweight)]) if tied else _pad_head(model.lm_head, extra)
    else:
        emb.weight = nn.Parameter(_padded(emb.weight.data, extra), requires_grad=False)
        emb.num_embeddings = size
        if tied:
            model.lm_head.weight = emb.weight
            model.lm_head.out_features = size
        else:
            model.lm_head = _pad_head(model.lm_head, extra)
    model.config.trained_vocab_size = model.config.own_vocab_size
    model.config.vocab_size = size
    return model
