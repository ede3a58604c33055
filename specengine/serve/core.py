"""A request-level core over the engine's static KV rows (docs/design.md, "Serving").

    core = EngineCore(engine, max_batch=8)
    rid = core.add_request("def f(x):", RequestParams(max_new_tokens=64))
    while core.has_unfinished():
        for out in core.step():       # one speculative round for every running request
            print(out.request_id, out.text_delta, out.finished)
    core.abort(rid)                    # frees its row at the next step

Continuous batching: the KV buffers hold `max_batch` rows; a finished or aborted request
frees its row and the next waiting request is prefilled into that row alone while the
others keep their caches (Generation.admit). Rows run one decoding method and one sampling
class (temperature, top-k, top-p) at a time, because a round's draft sampling and
filtering are per batch; requests of another class wait until the running ones finish
(FIFO, never reordered). Seeds, stop strings and max_new_tokens are per request. Greedy
outputs do not depend on the batch: each row's tokens are those of running it alone.
The waiting queue is bounded: `add_request` raises `Overloaded` when it is full.

Prefix reuse: a freed row keeps its caches. A request whose prompt starts with the tokens
that row held (its previous occupant's prompt and output: the conversation's last turn)
is admitted into that row and prefills only what follows (Generation.admit); a request
that matches no free row takes one that holds nothing, else the one freed longest ago.
Not thread-safe: one thread drives it (AsyncEngine does).
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import torch

from ..errors import SpecEngineError
from ..generation import Generation, headroom
from ..methods.logprobs import LogprobSpec, TokenLogprob
from ..methods.sampling import SamplingParams
from ..request import RequestParams

# what the core's rows compute while any running request wants log-probabilities; each request
# keeps its own top-k of these 20 (OpenAI's most)
CORE_LOGPROBS = LogprobSpec(20, "raw")


class Overloaded(SpecEngineError):
    """The waiting queue is full: retry later (HTTP 503)."""


@dataclass
class RequestOutput:
    request_id: str
    token_ids: list[int]  # every generated id so far
    new_token_ids: list[int]  # ids committed in this step
    text: str  # text so far (a partial stop string or split character held back)
    text_delta: str  # new text since the last output
    finished: bool = False
    finish_reason: str | None = None  # "eos" | "length" | "stop" | "abort" | "error"
    prompt_tokens: int = 0
    error: Exception | None = None  # why the request failed (finish_reason "error"): a
    # SpecEngineError is the request's own bad input, anything else an internal fault
    logprobs: list[TokenLogprob] | None = None  # new_token_ids' (RequestParams.logprobs)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # on a request's first output, when asked
    cached_tokens: int = 0  # prompt tokens whose K/V the row already held (prefix reuse)


@dataclass
class _Request:
    rid: str
    prompt: list[int]
    params: RequestParams
    sampling: SamplingParams
    stops: list[str]
    spec: LogprobSpec | None = None
    slot: int | None = None
    sent: str = ""
    ids: list[int] = field(default_factory=list)
    prompt_sent: bool = False
    cached: int = 0  # prompt positions reused from the row's previous occupant
    constraint: object = None  # the output constraint (structured.Constraint), compiled in prepare
    cache_key: str | None = ""  # suffix decoding's memory it reads and joins (None: opted out)

    @property
    def klass(self):
        s = self.sampling
        return (s.temperature, s.top_k, s.top_p) if not s.greedy else (0.0, 0, 1.0)


class EngineCore:
    def __init__(self, engine, max_batch: int | None = None, max_waiting: int = 64, method: str | None = None,
                 gamma=None, policy: str | None = None, prefix_reuse: bool | None = None):
        """Defaults from the engine's EngineConfig: its method, and its max_batch rows.
        prefix_reuse: admit a request into the free row that holds its prompt's start. None (auto):
        on where the target computes in fp32 (float or GGUF weights), where prefilling a prompt in
        two chunks gives the tokens of one whole prefill; off for 16-bit activations, whose
        rounding depends on how many rows a forward holds (turn it on to trade that for speed)."""
        self.engine = engine
        self.max_batch = max_batch or engine.config.max_batch
        if isinstance(self.max_batch, bool) or not isinstance(self.max_batch, int) or self.max_batch < 1:
            raise SpecEngineError(f"max_batch must be an integer >= 1, got {max_batch!r}", "max_batch")
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 0:
            raise SpecEngineError(f"max_waiting must be an integer >= 0, got {max_waiting!r}", "max_waiting")
        self.max_waiting = max_waiting
        self.method_name, self.gamma, self.policy = method or engine.method, gamma, policy
        self._probe = engine.new_method(self.method_name, gamma, policy)  # validates, gives the headroom
        self.waiting: deque[_Request] = deque()
        self.running: dict[str, _Request] = {}
        self.slots: list[str | None] = [None] * self.max_batch
        self.gen: Generation | None = None
        self._klass = None
        self._aborts: set[str] = set()
        self._ids = itertools.count()
        self.finished_requests = 0
        if prefix_reuse not in (None, True, False):
            raise SpecEngineError(f"prefix_reuse must be True, False or None (auto), got {prefix_reuse!r}",
                                  "prefix_reuse")
        self.prefix_reuse = engine.target.dtype == torch.float32 if prefix_reuse is None else prefix_reuse
        self._held: dict[int, list[int]] = {}  # free row -> the tokens its caches may hold; oldest first

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt, params: RequestParams | None = None, request_id: str | None = None,
                    cache_key: str = "") -> str:
        """Queue a request (a string, token ids or chat messages); raises SpecEngineError on bad
        input and Overloaded when the waiting queue is full. cache_key: whose earlier responses
        suffix decoding may propose to it, and whose it joins (an embedder's user or tenant;
        requests under other keys never see them)."""
        if len(self.waiting) >= self.max_waiting:
            raise self.overloaded()
        req = self.prepare(prompt, params, request_id or f"req-{next(self._ids)}", cache_key)
        if req.rid in self.running or any(r.rid == req.rid for r in self.waiting):
            raise SpecEngineError(f"request id {req.rid!r} is already in use")
        self.waiting.append(req)
        return req.rid

    def prepare(self, prompt, params: RequestParams | None, request_id: str, cache_key: str = "") -> _Request:
        """Validate and tokenize a request without touching the core's state (any thread)."""
        params = params or RequestParams()
        own = [k for k, v in params.method_options().items() if v is not None]
        if own:  # rows of one step share one method: it is the core's, chosen when it starts
            raise SpecEngineError(f"a served request cannot set {own[0]!r}: every row runs the core's method "
                                  f"({self.method_name}), set when the core (or server) starts", own[0])
        spec = LogprobSpec.parse(params.logprobs, params.logprobs_mode)
        if (spec is not None or params.prompt_logprobs) and params.logprobs_mode != "raw":
            raise SpecEngineError("the serving core returns raw log-probabilities only (logprobs_mode='raw')",
                                  "logprobs_mode")
        sampling, stops = params.validate()
        prompts, batched = self.engine.encode(prompt)
        if batched:
            raise SpecEngineError("add_request takes one prompt", "prompt")
        self.engine.check_capacity(prompts, params.max_new_tokens, self._probe)
        constraint = params.constraint()
        if constraint is not None:  # a schema that does not compile: this request's error, now
            self.engine.grammar_compiler.compile(constraint)
        return _Request(request_id, prompts[0], params, sampling, stops, spec, constraint=constraint,
                        cache_key=cache_key if params.suffix_cache else None)

    def overloaded(self) -> Overloaded:
        return Overloaded(f"server overloaded: {len(self.waiting)} requests waiting (max_waiting="
                          f"{self.max_waiting}); retry later")

    def abort(self, request_id: str) -> bool:
        """Cancel a waiting or running request; its row is freed at the next step."""
        if request_id in self.running or any(r.rid == request_id for r in self.waiting):
            self._aborts.add(request_id)
            return True
        return False

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._aborts)

    @property
    def headroom(self) -> int:
        """KV positions a round of this core's method may write past a row's length."""
        return headroom(self._probe, self.engine.target)

    def kv_usage(self) -> float:
        """The fraction of the KV cache's positions (rows x max_seq_len) the running requests hold
        (rows kept for prefix reuse are free to take: not counted)."""
        held = sum(len(r.prompt) + len(r.ids) for r in list(self.running.values()))
        return held / (self.max_batch * self.engine.max_seq_len)

    @property
    def free_slots(self) -> int:
        return self.slots.count(None)

    # ------------------------------------------------------------------ the loop
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Admit waiting requests into free rows, run one round for the running ones, and
        report what each committed (finished, aborted and failed requests included).

        A failure stays with the requests it concerns: a request whose admission raises fails
        alone; a round that raises fails the requests that were in it (their rows' state is
        unknown, so the round's Generation is dropped and the next admission starts afresh).
        Either way the rows are freed and the core keeps serving."""
        outputs = self._apply_aborts()
        outputs += self._admit()
        if not self.running:
            return outputs
        self._logprobs_on(any(r.spec is not None for r in self.running.values()))
        try:
            kept = self.gen.step()
        except Exception as e:  # noqa: BLE001 - reported to each request, never swallowed
            return outputs + self._fail_running(e)
        for slot, rid in enumerate(self.slots):
            if rid is None:
                continue
            req, row = self.running[rid], self.gen.rows[slot]
            req.ids.extend(kept[slot])
            done = row.finish_reason is not None
            outputs.append(self._output(req, row, kept[slot], done))
            if done:
                self._free(req)
        return outputs

    def _apply_aborts(self) -> list[RequestOutput]:
        outs = []
        for rid in list(self._aborts):
            req = self.running.get(rid)
            if req is not None:
                self.gen.release(req.slot, "abort")
                self._free(req)
            else:
                req = next((r for r in self.waiting if r.rid == rid), None)
                if req is None:
                    continue
                self.waiting.remove(req)
            outs.append(RequestOutput(rid, req.ids, [], req.sent, "", True, "abort", len(req.prompt)))
        self._aborts.clear()
        return outs

    def _admit(self) -> list[RequestOutput]:
        failed = []
        while self.waiting and self.free_slots:
            req = self.waiting[0]
            if self.running and req.klass != self._klass:
                break  # another sampling class: it waits for the running rows (FIFO order kept)
            self.waiting.popleft()
            slot = None
            try:
                if self.gen is None or req.klass != self._klass:
                    self._start(req)
                slot, reuse = self._row_for(req.prompt)
                self._logprobs_on(bool(req.params.prompt_logprobs))
                req.cached = self.gen.admit(slot, req.prompt, req.sampling.seed, req.params.max_new_tokens, req.stops,
                                            set() if req.params.ignore_eos else self.engine.eos_ids,
                                            req.spec is not None, bool(req.params.prompt_logprobs), reuse,
                                            constraint=req.constraint, cache_key=req.cache_key)
            except Exception as e:  # noqa: BLE001 - this request fails alone
                if self.gen is not None and slot is not None:
                    self.gen.release(slot, "error")
                failed.append(self._failed(req, e))
                self.finished_requests += 1
                continue
            req.slot, self.slots[slot] = slot, req.rid
            self.running[req.rid] = req
        return failed

    def _row_for(self, prompt: list[int]) -> tuple[int, int]:
        """(free row, prompt tokens it may hold): the row whose held tokens share the longest start
        with the prompt, else an empty row, else the one freed longest ago. While an empty row is
        left, a held row is taken only by a prompt that continues most of it: sharing a system
        prompt is not worth losing a conversation another turn of which may come back."""
        free = [s for s, rid in enumerate(self.slots) if rid is None]
        empty = next((s for s in free if s not in self._held), None)
        if self.prefix_reuse and self._held:
            best, shared = max(((s, common_prefix(self._held[s], prompt)) for s in free if s in self._held),
                               key=lambda x: x[1], default=(None, 0))
            if shared and (empty is None or 2 * shared >= len(self._held[best])):
                del self._held[best]
                return best, shared
        slot = empty
        if slot is None:
            slot = next(s for s in self._held if s in free)
        self._held.pop(slot, None)
        return slot, 0

    def _fail_running(self, error: Exception) -> list[RequestOutput]:
        outs = [self._failed(req, error) for req in list(self.running.values())]
        for req in list(self.running.values()):
            self._free(req)
        self.gen, self._klass = None, None
        self._held.clear()
        return outs

    def fail_all(self, error: Exception) -> list[RequestOutput]:
        """Fail every running and waiting request (the loop's last resort when the core's own
        bookkeeping raised) and start from empty rows."""
        outs = self._fail_running(error) + [self._failed(req, error) for req in self.waiting]
        self.waiting.clear()
        self._aborts.clear()
        self.slots = [None] * self.max_batch
        return outs

    @staticmethod
    def _failed(req: _Request, error: Exception) -> RequestOutput:
        return RequestOutput(req.rid, list(req.ids), [], req.sent, "", True, "error", len(req.prompt), error)

    def _start(self, req: _Request) -> None:
        """A fresh Generation over all rows (empty) for this sampling class."""
        method = self.engine.new_method(self.method_name, self.gamma, self.policy)
        placeholder = [[0]] * self.max_batch
        self.gen = Generation(self.engine, placeholder, req.sampling, 1, method, self.engine.eos_ids, [])
        for slot in range(self.max_batch):
            self.gen.release(slot, "free")
        self.gen.track_text = True
        self._klass = req.klass
        self._held.clear()  # fresh caches

    def _logprobs_on(self, on: bool) -> None:
        """Rounds (and a prefill) compute log-probabilities only while some request wants them."""
        self.gen.logprobs = self.gen.state.logprobs = CORE_LOGPROBS if on else None

    def _free(self, req: _Request) -> None:
        """Free the request's row, which keeps its caches for a request that continues it."""
        self.slots[req.slot] = None
        self._held[req.slot] = req.prompt + req.ids
        del self.running[req.rid]
        self.finished_requests += 1

    def _output(self, req: _Request, row, new: list[int], done: bool) -> RequestOutput:
        text = row.visible_text()
        delta = text[len(req.sent):] if len(text) > len(req.sent) else ""
        req.sent = text if len(text) > len(req.sent) else req.sent
        out = RequestOutput(req.rid, list(req.ids), list(new), req.sent, delta, done, row.finish_reason,
                            len(req.prompt), cached_tokens=req.cached)
        k = req.spec.top if req.spec is not None else 0  # each entry cut to the request's own top-k
        cut = lambda e: e and TokenLogprob(e.token_id, e.logprob, dict(list(e.top.items())[:k]))  # noqa: E731
        if req.spec is not None:  # this step's
            out.logprobs = [cut(e) for e in row.logprobs[len(row.logprobs) - len(new):]]
        if req.params.prompt_logprobs and not req.prompt_sent:
            req.prompt_sent, out.prompt_logprobs = True, [cut(e) for e in row.prompt_logprobs]
        return out


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
