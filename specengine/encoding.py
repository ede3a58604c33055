"""Prompts to token ids: a string, token ids, chat messages (the tokenizer's chat template), or a
batch of them; each checked (non-empty, ids inside the vocabulary)."""
from __future__ import annotations

import torch

from .errors import SpecEngineError


def encode(tokenizer, vocab_size: int, prompt) -> tuple[list[list[int]], bool]:
    """Token ids of each prompt and whether the input was a batch."""
    if isinstance(prompt, torch.Tensor):
        prompt = prompt.tolist()
    if isinstance(prompt, str):
        return [_encode_one(tokenizer, vocab_size, prompt)], False
    if isinstance(prompt, (list, tuple)):
        if not prompt:
            raise SpecEngineError("prompt is empty", "prompt")
        if all(isinstance(t, int) for t in prompt):
            return [_encode_one(tokenizer, vocab_size, list(prompt))], False
        if _is_chat(prompt):
            return [_encode_one(tokenizer, vocab_size, _chat(tokenizer, prompt))], False
        return [_encode_one(tokenizer, vocab_size, _chat(tokenizer, p) if _is_chat(p) else p) for p in prompt], True
    raise SpecEngineError(f"unsupported prompt type {type(prompt).__name__}: pass a string, a list of "
                          "strings, token ids, or chat messages", "prompt")


def _chat(tokenizer, messages) -> list[int]:
    for m in messages:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise SpecEngineError("chat messages must be dicts with 'role' and 'content'", "prompt")
    if not getattr(tokenizer, "chat_template", None):
        raise SpecEngineError("this tokenizer has no chat template; pass a plain string prompt", "prompt")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False).input_ids  # the template has them


def _encode_one(tokenizer, vocab_size: int, p) -> list[int]:
    if isinstance(p, str):
        ids = tokenizer(p).input_ids if p else []
    elif isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p):
        ids = list(p)
    else:
        raise SpecEngineError(f"unsupported prompt element {type(p).__name__}", "prompt")
    if not ids:
        raise SpecEngineError("prompt is empty", "prompt")
    V = vocab_size
    bad = [t for t in ids if not 0 <= t < V]
    if bad:
        raise SpecEngineError(f"prompt token id {bad[0]} is outside the vocabulary [0, {V})", "prompt")
    return ids


def _is_chat(p) -> bool:
    return isinstance(p, (list, tuple)) and bool(p) and all(isinstance(m, dict) for m in p)


def check_capacity(prompts: list[list[int]], max_new_tokens: int, max_seq_len: int, room: int) -> None:
    longest = max(len(p) for p in prompts)
    if longest >= max_seq_len:
        raise SpecEngineError(f"prompt has {longest} tokens but the cache holds max_seq_len={max_seq_len}", "prompt")
    need = longest + max_new_tokens + room
    if need > max_seq_len:
        raise SpecEngineError(
            f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) + speculation headroom "
            f"({room}) = {need} exceeds max_seq_len={max_seq_len}; raise max_seq_len or lower max_new_tokens",
            "max_new_tokens")
