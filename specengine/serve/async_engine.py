"""AsyncEngine: `await generate(...)` and `async for out in stream(...)` over one EngineCore
driven by a background thread (the only thread that touches the engine).

Callers on any thread or event loop validate and tokenize their request themselves
(errors and Overloaded raise in the caller), then drop it into an inbox the loop drains
before each round; only the loop thread touches the core, so a caller never waits for a
round to finish. Outputs come back through an asyncio queue fed with
`loop.call_soon_threadsafe`. Leaving a stream early (break, cancellation, a client that
disconnected) aborts the request, which frees its row.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
from typing import AsyncIterator

from .core import EngineCore, RequestOutput, RequestParams
from .metrics import engine_lines
from .served_model import ServedModel


class AsyncEngine:
    def __init__(self, engine, **core_kw):
        self.engine = engine
        self.core = EngineCore(engine, **core_kw)
        self.model = ServedModel.of(engine, self.core.headroom)
        self._lock = threading.Lock()  # guards the inbox only (held for microseconds)
        self._inbox: list = []  # ("add", request) | ("abort", id)
        self._ids = itertools.count()
        self._wake = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stop = False
        self.error: BaseException | None = None
        self.metrics = {"requests": 0, "finished": 0, "aborted": 0, "failed": 0, "tokens": 0, "rounds": 0,
                        "prompt_tokens": 0, "cached_prompt_tokens": 0}
        self._thread = threading.Thread(target=self._loop, name="specengine-core", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public
    def submit(self, prompt, params: RequestParams | None = None, cache_key: str = "") -> tuple[str, asyncio.Queue]:
        """Queue a request from the running event loop; returns (id, its output queue).
        cache_key: whose earlier responses suffix decoding may propose to it (EngineCore.add_request)."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        if self.error is not None:
            raise RuntimeError(f"the engine loop stopped: {self.error!r}")
        req = self.core.prepare(prompt, params, f"req-{next(self._ids)}", cache_key)  # raises on bad input
        with self._lock:
            if len(self.core.waiting) + sum(k == "add" for k, _ in self._inbox) >= self.core.max_waiting:
                raise self.core.overloaded()
            self._inbox.append(("add", req))
            self._queues[req.rid] = (loop, queue)
            self.metrics["requests"] += 1
        self._wake.set()
        return req.rid, queue

    async def open(self, prompt, params: RequestParams | None = None, retry: bool = False,
                   cache_key: str = "") -> tuple[str, asyncio.Queue]:
        """The server's entry (the same as a replicated backend's, serve/ray_app.py): submit.
        retry: whether a request may run again elsewhere if its replica dies (one process: never)."""
        return self.submit(prompt, params, cache_key)

    async def engine_lines(self, model_name: str) -> list[str]:
        """This engine's part of /metrics (a replicated backend gathers every replica's)."""
        return engine_lines(self, model_name)

    async def stream(self, prompt, params: RequestParams | None = None) -> AsyncIterator[RequestOutput]:
        rid, queue = self.submit(prompt, params)
        done = False
        try:
            while not done:
                out = await queue.get()
                if isinstance(out, BaseException):
                    raise out
                if out.error is not None:
                    done = True
                    raise out.error
                done = out.finished
                yield out
        finally:
            if not done:
                self.abort(rid)

    async def generate(self, prompt, params: RequestParams | None = None) -> RequestOutput:
        last = None
        async for out in self.stream(prompt, params):
            last = out
        return last

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._inbox.append(("abort", request_id))
        self._wake.set()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        core = self.core
        while not self._stop:
            with self._lock:
                inbox, self._inbox = self._inbox, []
            for kind, item in inbox:
                if kind == "add":
                    core.waiting.append(item)
                else:
                    core.abort(item)
            if not core.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            t0 = time.perf_counter()
            try:  # a request's or a round's failure comes back as that request's output
                outs = core.step()
            except Exception as e:  # noqa: BLE001 - the core's own bookkeeping: fail what it held, go on
                outs = core.fail_all(e)
            except BaseException as e:  # the process is going down: tell every caller
                self.error = e
                for loop, queue in list(self._queues.values()):
                    loop.call_soon_threadsafe(queue.put_nowait, e)
                self._queues.clear()
                return
            self.metrics["rounds"] += 1
            self.metrics["last_round_s"] = time.perf_counter() - t0
            for out in outs:
                self._deliver(out)

    def _deliver(self, out: RequestOutput) -> None:
        self.metrics["tokens"] += len(out.new_token_ids)
        if out.finished:
            kind = {"abort": "aborted", "error": "failed"}.get(out.finish_reason, "finished")
            self.metrics[kind] += 1
            self.metrics["prompt_tokens"] += out.prompt_tokens
            self.metrics["cached_prompt_tokens"] += out.cached_tokens  # prefix reuse
        with self._lock:
            target = self._queues.pop(out.request_id, None) if out.finished else self._queues.get(out.request_id)
        if target is None:
            return
        loop, queue = target
        try:
            loop.call_soon_threadsafe(queue.put_nowait, out)
        except RuntimeError:  # the caller's loop is closed: nobody is listening
            pass
