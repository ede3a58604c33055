"""One row of a generation as the host sees it: its limits, the ids it kept, why it ended, its
text (for stop strings and streaming), log-probabilities, and whose suffix-decoding memory it
drafts from."""
from __future__ import annotations

from dataclasses import dataclass, field

from .detokenize import IncrementalDetokenizer, partial_stop
from .methods.logprobs import TokenLogprob


@dataclass
class RowState:
    prompt_len: int
    max_new: int  # this row's limits: the call's, or its own request's (serving core)
    stops: list[str]
    stop_ids: set[int]
    ids: list[int] = field(default_factory=list)  # generated ids (kept ones)
    finish_reason: str | None = None
    stop_text_end: int | None = None  # where a stop string starts in the text, if one hit
    detok: IncrementalDetokenizer | None = None  # the row's text, kept when stops or streaming need it
    logprobs: list[TokenLogprob] | None = None  # per kept id, when the call asked for them
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token (the first has none)
    cache_key: str | None = ""  # suffix decoding: whose earlier responses it drafts from, and joins (None: none)

    def visible_text(self) -> str:
        """The text a stream may show now: cut at a stop string that hit; while the row runs,
        a tail that may be the start of a stop string (and split UTF-8) is held back."""
        text = self.detok.text if self.detok is not None else ""
        if self.stop_text_end is not None:
            return text[: self.stop_text_end]
        if self.finish_reason is None:
            return text[: len(text) - partial_stop(text, self.stops)]
        return text
