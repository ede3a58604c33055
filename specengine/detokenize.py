"""Incremental detokenization: the text of a growing token list at O(new tokens) per round.

Decoding a token depends on its neighbours (SentencePiece drops a leading space at the
start of a decode, byte-level BPE splits a character across tokens), so a token is never
decoded alone. The window [prefix_offset, read_offset) holds a few already-emitted tokens
as context: the new text is decode(window + new) minus decode(window), and is held back
while it ends in an incomplete UTF-8 sequence (U+FFFD). The same scheme as Hugging Face
TGI's and vLLM's streaming detokenizers.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # everything emitted so far
        self.prefix_offset = self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def push(self, new_ids: list[int]) -> str:
        """Append tokens; returns the text they completed ("" while a character is split)."""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset: self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """The held-back tail at the end of generation (may hold U+FFFD, as a full decode would)."""
        prefix = self._decode(self.ids[self.prefix_offset: self.read_offset])
        delta = self._decode(self.ids[self.prefix_offset:])[len(prefix):]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta


def find_stop(text: str, stops: list[str], searched: int) -> int | None:
    """Earliest start of any stop string in `text` that ends after position `searched`
    (everything before was searched already): looks only at the new tail."""
    if not stops:
        return None
    start = max(0, searched - max(len(s) for s in stops) + 1)
    hits = [i for i in (text.find(s, start) for s in stops) if i >= 0]
    return min(hits) if hits else None


def partial_stop(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string: what a
    stream must hold back until the next tokens show whether the stop string completes."""
    return max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])),
               default=0)
