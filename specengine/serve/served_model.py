"""What the HTTP layer needs of the model it serves: text in and out, and the limits its schema
states. An engine gives it (`ServedModel.of`); a replicated backend ships it from a replica to
the ingress (serve/ray_app.py), which then needs no weights of its own."""
from __future__ import annotations

from dataclasses import dataclass

from ..encoding import encode


@dataclass
class ServedModel:
    tokenizer: object
    vocab_size: int
    max_seq_len: int
    headroom: int  # KV positions a round may write past a row's length

    @classmethod
    def of(cls, engine, headroom: int) -> "ServedModel":
        return cls(engine.tokenizer, engine.target.config.vocab_size, engine.max_seq_len, headroom)

    def encode(self, prompt) -> tuple[list[list[int]], bool]:
        return encode(self.tokenizer, self.vocab_size, prompt)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def has_chat(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))
