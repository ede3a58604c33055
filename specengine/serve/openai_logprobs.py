"""OpenAI's log-probability formats, from the serving core's TokenLogprob entries (server.py):
completions' legacy `{tokens, token_logprobs, top_logprobs, text_offset}` (with `echo`, the
prompt's tokens first, the first of them without a value) and chat's `{content: [{token,
logprob, bytes, top_logprobs}]}`. Tokens are shown as their own decoded text; a value too small
for JSON (-inf) is written as -9999.0, as OpenAI does."""
from __future__ import annotations

FLOOR = -9999.0


def _value(v: float) -> float:
    return max(v, FLOOR)


class LogprobFormatter:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def completion(self, ids: list[int], entries: list, offset: int = 0) -> dict:
        """ids and their entries (None: no value, a prompt's first token); text offsets from `offset`."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, e in zip(ids, entries):
            s = self.text(t)
            out["tokens"].append(s)
            out["text_offset"].append(offset)
            offset += len(s)
            out["token_logprobs"].append(None if e is None else _value(e.logprob))
            out["top_logprobs"].append(None if e is None else {self.text(i): _value(v) for i, v in e.top.items()})
        return out

    def chat(self, entries: list) -> dict:
        def item(token_id: int, v: float) -> dict:
            s = self.text(token_id)
            return {"token": s, "logprob": _value(v), "bytes": list(s.encode("utf-8"))}
        return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(i, v) for i, v in e.top.items()]}
                            for e in entries]}


class AnswerLogprobs:
    """What one request's answer shows of its prompt (`echo`) and log-probabilities, piece by piece:
    a stream's chunks, or the whole answer as one piece. score_only (completions' max_tokens 0):
    the one token generated to run the request is dropped, text and log-probability alike."""

    def __init__(self, formatter: LogprobFormatter, chat: bool, wanted: bool, echo_ids=None, echo_text: str = "",
                 score_only: bool = False):
        self.fmt, self.chat, self.wanted, self.score_only = formatter, chat, wanted, score_only
        self.echo_ids, self.echo_text = echo_ids, echo_text
        self.pending, self.prompt, self.started, self.offset = [], None, False, 0

    @property
    def echo_due(self) -> bool:
        return self.echo_ids is not None and not self.started

    def take(self, out) -> None:
        """A RequestOutput of the serving core."""
        if out.prompt_logprobs is not None:
            self.prompt = out.prompt_logprobs
        if out.logprobs and not self.score_only:
            self.pending += zip(out.new_token_ids, out.logprobs)

    def piece(self, text: str):
        """(text, logprobs or None) of the next piece: the echo first, then what was taken since."""
        text, ids, entries = "" if self.score_only else text, [], []
        if self.echo_due:
            text = self.echo_text + text
            ids, entries = list(self.echo_ids), list(self.prompt or [None] * len(self.echo_ids))
        self.started = True
        ids += [t for t, _ in self.pending]
        entries += [e for _, e in self.pending]
        self.pending = []
        if not self.wanted:
            return text, None
        if self.chat:
            return text, self.fmt.chat(entries)
        lp = self.fmt.completion(ids, entries, self.offset)
        self.offset += sum(len(t) for t in lp["tokens"])
        return text, lp
