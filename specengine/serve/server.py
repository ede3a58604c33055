"""An OpenAI-compatible HTTP server over AsyncEngine (FastAPI + uvicorn: `pip install
'specengine[serve]'`; `specengine serve`).

Endpoints: POST /v1/completions, POST /v1/chat/completions (only for a tokenizer with a chat
template; `stream: true` sends server-sent events, ending with `data: [DONE]`), GET /v1/models,
GET /health, GET /metrics (Prometheus text). A bad request gets HTTP 400 with an OpenAI-style JSON error naming the
field (`{"error": {"message", "type", "param", "code"}}`); a full queue gets 503; the
server never dies on bad input. A client that disconnects aborts its request (its row is
freed). Differences from OpenAI: `n` must be 1; `top_k` and `ignore_eos` are accepted as
extensions; an unknown or unimplemented parameter is a 400 naming it, never ignored (schema.py); `temperature` defaults to 1 as in OpenAI (0 is greedy: exactly the target's
own greedy output).
"""
from __future__ import annotations

import hmac
import json
import os
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any

from ..errors import SpecEngineError
from ..request import RequestParams, served_fields
from .async_engine import AsyncEngine
from .core import Overloaded
from .openai_logprobs import AnswerLogprobs, LogprobFormatter
from .metrics import Histogram, http_lines

try:
    from fastapi import Depends, FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
    from starlette.exceptions import HTTPException as StarletteHTTPException

    from .schema import (ERRORS, STREAMED, UNSUPPORTED, ChatRequest, CompletionRequest, ErrorBody, Sampling,
                         json_schema_bounds)
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise SpecEngineError("the server needs the serve extra: pip install 'specengine[serve]'") from e



def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
           code: str | None = None, headers: dict | None = None):
    """OpenAI's error body (ErrorBody)."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status,
                        headers=headers)


class _Unauthorized(Exception):
    pass


def create_app(engine, model_name: str, default_max_tokens: int = 256, api_key: str | None = None,
               backend=None, **core_kw) -> FastAPI:
    """The FastAPI app serving `engine` as `model_name` (core_kw: EngineCore options).
    api_key: every /v1 route then wants `Authorization: Bearer <api_key>` (None: the
    SPECENGINE_API_KEY environment variable, if set; /health stays open); several keys, comma
    separated or a list, are tenants whose suffix-decoding caches stay apart. backend: what runs
    the requests instead of an AsyncEngine over `engine` (then None): the replicas of
    serve/ray_app.py, behind the same routes.

    Why long: FastAPI's app-factory pattern. The routes, error handlers and metrics are
    closures over this app's AsyncEngine, key and counters; each is short on its own."""
    api_key = api_key if api_key is not None else os.environ.get("SPECENGINE_API_KEY") or None
    keys = [k.encode() for k in (api_key.split(",") if isinstance(api_key, str) else api_key or ()) if k]
    aeng = backend if backend is not None else AsyncEngine(engine, **core_kw)
    model = aeng.model  # the tokenizer and limits (ServedModel): all the routes need of the engine
    formatter = LogprobFormatter(model.tokenizer)

    @asynccontextmanager
    async def lifespan(app):
        yield
        aeng.shutdown()

    app = FastAPI(title="specengine", version="0.1.0", lifespan=lifespan)
    app.state.engine = aeng
    bearer = HTTPBearer(auto_error=False, description="the server's --api-key / SPECENGINE_API_KEY")
    expected = keys or None

    def authorized(request: Request, credentials: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        """With several keys, each is its own tenant: suffix decoding never proposes one key's
        responses to another (the request's cache key names the key by its position, never by it)."""
        if expected is None:
            return
        given = credentials.credentials.encode() if credentials is not None else b""
        match = [hmac.compare_digest(given, k) for k in expected]  # constant time: leaks neither length nor prefix
        if not any(match):
            raise _Unauthorized()
        request.state.cache_key = f"key-{match.index(True)}"

    # the schema declares the bearer scheme (and the 401) only when a key is required
    v1 = dict(dependencies=[Depends(authorized)] if expected else [],
              responses={k: v for k, v in ERRORS.items() if k != 401 or expected})

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):  # e.g. a body that is not UTF-8: OpenAI's error body too
        counts["bad_requests"] += exc.status_code == 400
        return _error(exc.status_code, str(exc.detail), kind="invalid_request_error" if exc.status_code < 500
                      else "server_error", headers=getattr(exc, "headers", None))  # e.g. 405's Allow

    @app.exception_handler(_Unauthorized)
    async def _unauthorized(request, exc):  # never echoes what was sent
        counts["unauthorized"] += 1
        return _error(401, "missing or invalid API key: send Authorization: Bearer <key>", code="invalid_api_key",
                      headers={"WWW-Authenticate": "Bearer"})
    hist = {"ttft": Histogram(), "latency": Histogram(), "itl": Histogram((0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))}
    counts = {"bad_requests": 0, "overloaded": 0, "unauthorized": 0}

    @app.exception_handler(RequestValidationError)
    async def _invalid(request, exc):  # FastAPI's 422 -> OpenAI's 400, naming the field
        counts["bad_requests"] += 1
        err = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            return _error(400, "request body is not valid JSON", None)
        field = ".".join(loc) or None
        if err.get("type") == "extra_forbidden":
            return _error(400, f"{field}: not a parameter this server knows (it refuses what it would ignore)", field)
        if loc and loc[0] in UNSUPPORTED:
            return _error(400, f"{loc[0]}: {UNSUPPORTED[loc[0]]}", loc[0])
        return _error(400, f"{field or 'body'}: {err.get('msg', 'invalid')}", field)

    @app.get("/health", responses={500: {"model": ErrorBody, "description": "the engine loop stopped"}})
    def health():
        if aeng.error is not None:
            return _error(500, f"engine loop stopped: {aeng.error!r}", kind="server_error")
        return {"status": "ok"}

    @app.get("/v1/models", **v1)
    def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "specengine",
                                            "created": 0}]}

    @app.get("/metrics", response_class=PlainTextResponse,
             responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text format"}})
    async def metrics():
        lines = await aeng.engine_lines(model_name) + http_lines(counts, hist)
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    def _params(req: Sampling) -> RequestParams:
        if req.model != model_name:
            raise _BadField(f"model {req.model!r} is not served here; this server serves {model_name!r}", "model")
        if req.n != 1:
            raise _BadField("only n=1 is supported", "n")
        given = {f.name: getattr(req, f.metadata["served"]) for f in served_fields()}
        newer = getattr(req, "max_completion_tokens", None)  # chat's newer name for max_tokens
        if newer is not None:
            if given["max_new_tokens"] not in (None, newer):
                raise _BadField("max_tokens and max_completion_tokens disagree; send one", "max_completion_tokens")
            given["max_new_tokens"] = newer
        if given["max_new_tokens"] == 0:  # completions' scoring (with echo): one token runs it, then is dropped
            given["max_new_tokens"] = 1
        given["max_new_tokens"] = given["max_new_tokens"] or default_max_tokens
        if isinstance(req, ChatRequest):
            if req.top_logprobs is not None and not req.logprobs:
                raise _BadField("top_logprobs needs logprobs: true", "top_logprobs")
            given["logprobs"] = (req.top_logprobs or 0) if req.logprobs else None
        else:
            given["logprobs"], given["prompt_logprobs"] = req.logprobs, req.echo and req.logprobs is not None
        if req.response_format is not None:  # OpenAI's structured output (json_schema's "schema" by its alias)
            given["response_format"] = req.response_format.model_dump(by_alias=True, exclude_none=True)
        return RequestParams(**{k: v for k, v in given.items() if v is not None})

    async def _serve(request: Request, body: Sampling, prompt, chat: bool):
        """One completion, streamed (server-sent events) or whole, with its metrics.

        Why long: both answer shapes share the request's validation, failure mapping,
        latency metrics and usage; split apart they would repeat them."""
        try:
            params = _params(body)
            rid, queue = await aeng.open(prompt, params, retry=not body.stream,
                                         cache_key=getattr(request.state, "cache_key", ""))
        except _BadField as e:
            counts["bad_requests"] += 1
            return _error(400, str(e), e.param)
        except Overloaded as e:
            counts["overloaded"] += 1
            return _error(503, str(e), kind="overloaded")
        except SpecEngineError as e:  # bad prompt or parameters, too long for the cache, ...
            counts["bad_requests"] += 1
            return _error(400, str(e), _api_param(e, chat))
        echo = not chat and body.echo
        ids = model.encode(prompt)[0][0] if echo else None
        answer = AnswerLogprobs(formatter, chat, body.logprobs is not None and body.logprobs is not False, ids,
                                prompt if isinstance(prompt, str) else model.decode(ids) if echo else "",
                                not chat and body.max_tokens == 0)
        oid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created, t0 = int(time.time()), time.perf_counter()
        kind = "chat.completion" if chat else "text_completion"
        timing = {"first": None, "last": t0}

        def observe(out):
            now = time.perf_counter()
            if out.new_token_ids:
                if timing["first"] is None:
                    timing["first"] = now
                    hist["ttft"].observe(now - t0)
                else:
                    per = (now - timing["last"]) / len(out.new_token_ids)
                    for _ in out.new_token_ids:
                        hist["itl"].observe(per)
                timing["last"] = now
            if out.finished:
                hist["latency"].observe(now - t0)

        def usage(out):
            made = 0 if answer.score_only else len(out.token_ids)
            return {"prompt_tokens": out.prompt_tokens, "completion_tokens": made,
                    "total_tokens": out.prompt_tokens + made,
                    "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}  # prefix reuse

        def choice(text, reason, delta: bool):
            reason = None if reason is None else ("stop" if reason in ("eos", "stop") else reason)
            text, logprobs = answer.piece(text)
            if chat:
                key = "delta" if delta else "message"
                return {"index": 0, key: {"role": "assistant", "content": text}, "logprobs": logprobs,
                        "finish_reason": reason}
            return {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}

        if body.stream:
            async def events():
                done = False
                try:
                    while not done:
                        out = await queue.get()
                        failure = _failure(out, chat)
                        if failure is not None:
                            done = True  # nothing left to abort
                            yield f"data: {json.dumps(failure[1])}\n\n"
                            return
                        observe(out)
                        answer.take(out)
                        done = out.finished
                        if out.text_delta or done or answer.echo_due:
                            chunk = {"id": oid, "object": kind + (".chunk" if chat else ""), "created": created,
                                     "model": model_name, "choices": [choice(out.text_delta, out.finish_reason
                                                                             if done else None, True)]}
                            yield f"data: {json.dumps(chunk)}\n\n"
                    if (body.stream_options or {}).get("include_usage"):
                        last = {"id": oid, "object": kind + (".chunk" if chat else ""), "created": created,
                                "model": model_name, "choices": [], "usage": usage(out)}
                        yield f"data: {json.dumps(last)}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    if not done:  # the client went away (or the server stops): free the row
                        aeng.abort(rid)
            return StreamingResponse(events(), media_type="text/event-stream")

        out, finished = None, False
        try:
            while not finished:
                out = await queue.get()
                failure = _failure(out, chat)
                if failure is not None:
                    finished = True  # the engine already dropped it: nothing to abort
                    return JSONResponse(failure[1], failure[0])
                finished = out.finished
                observe(out)
                answer.take(out)
                if not out.finished and await request.is_disconnected():
                    aeng.abort(rid)
        finally:
            if not finished:
                aeng.abort(rid)
        return {"id": oid, "object": kind, "created": created, "model": model_name,
                "choices": [choice(out.text, out.finish_reason, False)], "usage": usage(out)}

    @app.post("/v1/completions", **{**v1, "responses": {**v1["responses"], **STREAMED}})
    async def completions(request: Request, body: CompletionRequest):
        return await _serve(request, body, body.prompt, chat=False)

    if model.has_chat:  # else every chat request would be a 400: not served
        @app.post("/v1/chat/completions", **{**v1, "responses": {**v1["responses"], **STREAMED}})
        async def chat_completions(request: Request, body: ChatRequest):
            messages = [m.model_dump() for m in body.messages]
            return await _serve(request, body, messages, chat=True)

    def openapi():
        """FastAPI's schema, minus the 422 it adds to every body route: this server answers a
        validation error with OpenAI's 400 (the error model above), never 422."""
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi

            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in schema["paths"].values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            components = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            json_schema_bounds(components)
            _engine_constraints(components, model_name, model.vocab_size, model.max_seq_len - model.headroom - 1)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
    return app


def _engine_constraints(components: dict, model_name: str, vocab: int, max_new: int) -> None:
    """Constraints the engine enforces that pydantic's models do not state: the one model
    served, non-empty prompts and stop strings, token ids in the vocabulary, and the most
    new tokens a one-token prompt leaves room for (a longer prompt leaves less: a 400)."""
    for name in ("CompletionRequest", "ChatRequest"):
        if name not in components:  # no chat route for a tokenizer without a chat template
            continue
        props = components[name]["properties"]
        props["model"] = {"type": "string", "enum": [model_name], "title": "Model"}
        for key in ("max_tokens", "max_completion_tokens") if name == "ChatRequest" else ("max_tokens",):
            least = 0 if name == "CompletionRequest" else 1  # completions: 0 scores the prompt (echo)
            props[key] = {"anyOf": [{"type": "integer", "minimum": least, "maximum": max_new}, {"type": "null"}],
                          "title": key.replace("_", " ").title(), "description": props[key]["description"]}
        props["stop"] = {"anyOf": [{"type": "string", "minLength": 1},
                                   {"type": "array", "items": {"type": "string", "minLength": 1}}, {"type": "null"}],
                         "title": "Stop"}
        if "prompt" in props:
            props["prompt"] = {"anyOf": [{"type": "string", "minLength": 1},
                                         {"type": "array", "minItems": 1,
                                          "items": {"type": "integer", "minimum": 0, "maximum": vocab - 1}}],
                               "title": "Prompt"}


class _BadField(SpecEngineError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def _api_param(error: SpecEngineError, chat: bool) -> str | None:
    """The request field an engine error names, in the API's spelling."""
    param = getattr(error, "param", None)
    if param == "prompt" and chat:
        return "messages"
    return {f.name: f.metadata["served"] for f in served_fields()}.get(param, param)


def _failure(out, chat: bool):
    """(status, OpenAI-style error body) when the engine failed this request, else None: its
    own bad input is a 400 naming the field, anything else a 500 with the fault's message."""
    error = out if isinstance(out, BaseException) else out.error
    if error is None:
        return None
    if isinstance(error, SpecEngineError):
        status, kind, param, msg = 400, "invalid_request_error", _api_param(error, chat), str(error)
    else:
        status, kind, param = 500, "server_error", None
        msg = f"internal error while generating this request: {type(error).__name__}: {error}"
    return status, {"error": {"message": msg, "type": kind, "param": param, "code": None}}


def serve(engine, model_name: str, host: str = "127.0.0.1", port: int = 8000, **kw: Any) -> None:
    """Run the server (kw: create_app's options, api_key included; the key is never logged)."""
    import uvicorn

    uvicorn.run(create_app(engine, model_name, **kw), host=host, port=port, log_level="info")
