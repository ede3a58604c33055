"""Replicas of the engine on Ray Serve, behind our own OpenAI-compatible routes
(`pip install 'specengine[ray]'`):

    specengine serve --ray --replicas 2 [the engine's flags]
    serve run specengine.serve.ray_app:app target=qwen2.5-coder-1.5b-instruct replicas=2

Layout (Ray Serve LLM's, learned from): Ray's HTTP proxy -> `Ingress`, the FastAPI app of
serve/server.py (`serve.ingress`, built at replica start over a `RemoteBackend`: the tokenizer
only, no weights) -> a deployment handle whose request router is ray_router.PrefixAffinityRouter
-> `EngineReplica` x N, each an Engine and its AsyncEngine on its own CPUs or GPU. The router runs
where the request's text is known (the ingress), which Ray's proxy is not (it streams the body).

Faults: Ray replaces a replica that dies. A request it was running fails with a clear error, or
runs again on another replica when nothing of it has reached the client (a non-streamed request).
"""
from __future__ import annotations

import asyncio
import itertools
import os
from dataclasses import dataclass, field

from ..errors import SpecEngineError
from ..request import RequestParams
from .core import Overloaded
from .metrics import with_replicas

try:
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig
except ImportError as e:  # pragma: no cover - exercised only without the extra
    raise SpecEngineError("replicas on Ray Serve need the ray extra: pip install 'specengine[ray]'") from e

ENGINE = "EngineReplica"
ROUTERS = {"prefix": "specengine.serve.ray_router:PrefixAffinityRouter", "pow2": None}  # pow2: Ray's default
RETRIES = 2  # runs of a non-streamed request after its replica died


@dataclass
class GenerateRequest:
    """One request as the router sees it: `prompt` (a completion) or `messages` (a chat), the
    attribute names Ray's prefix-aware routers read."""
    prompt: object = None
    messages: list | None = None
    params: RequestParams | None = None
    cache_key: str = ""  # the API key's tenant: suffix decoding's memory it reads and joins


@dataclass
class ReplicaSpec:
    """How every replica builds its engine, and how many there are."""
    target: str
    draft: str | None = None
    config: object = None  # EngineConfig (None: the engine's defaults)
    core: dict = field(default_factory=dict)  # EngineCore options: max_batch, max_waiting, method, ...
    replicas: int = 1
    autoscaling: dict | None = None  # Ray's autoscaling_config: min_replicas, max_replicas, target_ongoing_requests
    cpus: float = 1.0  # per replica; its torch threads too
    gpus: float = 0.0
    router: str = "prefix"
    warmup: bool = True


class EngineReplica:
    """One engine and its serving loop; what the ingress calls through the handle."""

    def __init__(self, spec: ReplicaSpec):
        import torch

        from ..api import Engine
        from .async_engine import AsyncEngine

        torch.set_num_threads(max(1, int(spec.cpus)))
        engine = Engine.from_pretrained(spec.target, draft=spec.draft, config=spec.config)
        if spec.warmup:
            engine.warmup(batch=spec.core.get("max_batch") or engine.config.max_batch)
        self.aeng = AsyncEngine(engine, **spec.core)
        self.name = serve.get_replica_context().replica_id.unique_id

    def describe(self):
        return self.aeng.model

    async def generate(self, req: GenerateRequest):
        """Yields the replica's id once the request is queued (or its refusal, an exception the
        ingress raises), then its RequestOutputs; a cancelled call aborts the request."""
        try:
            rid, queue = self.aeng.submit(req.messages if req.messages is not None else req.prompt, req.params,
                                          req.cache_key)
        except SpecEngineError as e:  # bad input or a full queue: the ingress answers 400 / 503
            yield e
            return
        yield self.name
        done = False
        try:
            while not done:
                out = await queue.get()
                if isinstance(out, BaseException):  # the engine loop stopped
                    yield RuntimeError(f"the engine loop of replica {self.name} stopped: {out!r}")
                    return
                if out.error is not None and not isinstance(out.error, SpecEngineError):
                    out.error = RuntimeError(f"{type(out.error).__name__}: {out.error}")  # one that pickles
                done = out.finished
                yield out
        finally:
            if not done:
                self.aeng.abort(rid)

    async def engine_lines(self, model_name: str) -> tuple[str, list[str]]:
        return self.name, await self.aeng.engine_lines(model_name)

    def check_health(self) -> None:  # what /health answers, for Ray's health checks
        if self.aeng.error is not None:
            raise RuntimeError(f"engine loop stopped: {self.aeng.error!r}")

    def __del__(self):
        aeng = getattr(self, "aeng", None)
        if aeng is not None:
            aeng.shutdown()


class RemoteBackend:
    """The AsyncEngine surface create_app uses, over the replicas' handle."""

    error = None  # a replica's health is Ray's business (check_health)

    def __init__(self, handle, model):
        self.handle, self.model = handle, model
        self._ids = itertools.count()
        self._live: dict[str, tuple[asyncio.Task, list]] = {}
        self.reruns = 0  # requests run again after their replica went away

    async def open(self, prompt, params: RequestParams | None = None, retry: bool = False, cache_key: str = ""):
        chat = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], dict)
        req = GenerateRequest(None if chat else prompt, prompt if chat else None, params, cache_key)
        stream = await self._start(req)  # raises the replica's refusal
        rid, queue, current = f"ray-{next(self._ids)}", asyncio.Queue(), [stream]
        self._live[rid] = (asyncio.create_task(self._pump(rid, req, current, queue, retry)), current)
        return rid, queue

    async def _start(self, req: GenerateRequest):
        """A replica's stream of the request, once it queued it. Nothing has reached the client
        yet, so a replica that goes away here is simply tried again (the router learns of it)."""
        for attempt in range(RETRIES + 1):
            stream = self.handle.options(stream=True).generate.remote(req)
            try:
                first = await stream.__anext__()
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                gone = e
                await asyncio.sleep(0.2 * (attempt + 1))
                continue
            if isinstance(first, BaseException):
                raise first
            return stream
        raise Overloaded(f"no replica could take the request (the last one went away: {gone}); retry later")

    async def _pump(self, rid: str, req: GenerateRequest, current: list, queue: asyncio.Queue, retry: bool) -> None:
        """Outputs into the server's queue. A non-streamed request's are held until its last, so
        if its replica dies it can run again elsewhere without the client seeing two answers."""
        held = []
        try:
            for attempt in itertools.count():
                try:
                    async for out in current[0]:
                        if isinstance(out, BaseException) or not retry:
                            queue.put_nowait(out)
                        else:
                            held.append(out)
                        if isinstance(out, BaseException) or out.finished:
                            break
                    for out in held:
                        queue.put_nowait(out)
                    return
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as e:
                    if not retry or attempt >= RETRIES:
                        queue.put_nowait(RuntimeError(f"the replica serving this request went away: {e}"))
                        return
                    held.clear()
                    self.reruns += 1
                    current[0] = await self._start(req)
        except asyncio.CancelledError:
            current[0].cancel()
            raise
        except Exception as e:  # noqa: BLE001 - a refusal on the rerun, a Ray fault: this request fails alone
            queue.put_nowait(e)
        finally:
            self._live.pop(rid, None)

    def abort(self, rid: str) -> None:
        task, current = self._live.pop(rid, (None, None))
        if task is not None:
            current[0].cancel()  # cancels the replica's generator, which aborts the request there
            task.cancel()

    async def engine_lines(self, model_name: str) -> list[str]:
        """Every replica's lines, each sample labelled with its replica."""
        pages = await self.handle.broadcast("engine_lines", model_name).results_async(timeout_s=10,
                                                                                     return_exceptions=True)
        return with_replicas(dict(p for p in pages if not isinstance(p, BaseException))) + [
            "# TYPE specengine_requests_rerun_total counter", f"specengine_requests_rerun_total {self.reruns}"]

    def shutdown(self) -> None:
        for rid in list(self._live):
            self.abort(rid)


@serve.ingress()
class Ingress:
    """Our FastAPI app (serve/server.py's routes, unchanged) as the application's HTTP ingress."""

    def __init__(self, engines, model_name: str, default_max_tokens: int = 256, api_key: str | None = None):
        self.engines, self.model_name = engines, model_name
        self.default_max_tokens, self.api_key = default_max_tokens, api_key

    async def __serve_build_asgi_app__(self):
        from .server import create_app

        model = await self.engines.describe.remote()
        return create_app(None, self.model_name, self.default_max_tokens, self.api_key,
                          backend=RemoteBackend(self.engines, model))


def application(spec: ReplicaSpec, model_name: str | None = None, default_max_tokens: int = 256,
                api_key: str | None = None):
    """The Serve application: the ingress bound to spec.replicas engine replicas (or autoscaled)."""
    if spec.router not in ROUTERS:
        raise SpecEngineError(f"router must be one of {sorted(ROUTERS)}, got {spec.router!r}", "router")
    if spec.autoscaling is None and (not isinstance(spec.replicas, int) or spec.replicas < 1):
        raise SpecEngineError(f"replicas must be an integer >= 1, got {spec.replicas!r}", "replicas")
    max_batch = spec.core.get("max_batch") or getattr(spec.config, "max_batch", None) or 8
    options = dict(name=ENGINE, ray_actor_options={"num_cpus": spec.cpus, "num_gpus": spec.gpus},
                   max_ongoing_requests=max_batch + spec.core.get("max_waiting", 64),
                   health_check_period_s=5, health_check_timeout_s=30)
    if spec.autoscaling is not None:
        options["autoscaling_config"] = spec.autoscaling
    else:
        options["num_replicas"] = spec.replicas
    if ROUTERS[spec.router] is not None:
        options["request_router_config"] = RequestRouterConfig(request_router_class=ROUTERS[spec.router])
    engines = serve.deployment(EngineReplica).options(**options).bind(spec)
    # the ingress only parses, tokenizes for echo and relays: no CPU of its own, many streams at once
    ingress = serve.deployment(Ingress).options(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=1024)
    return ingress.bind(engines, model_name or spec.target, default_max_tokens, api_key)


def app(args: dict):
    """`serve run specengine.serve.ray_app:app target=... [draft=... replicas=2 router=prefix
    cpus=1 gpus=0 max_batch=8 method=sd model_name=...]`: an application builder."""
    known = {"target", "draft", "replicas", "router", "cpus", "gpus", "max_batch", "method", "model_name",
             "min_replicas", "max_replicas", "target_ongoing_requests"}
    unknown = set(args) - known
    if unknown or "target" not in args:
        raise SpecEngineError(f"arguments: target=... and any of {sorted(known - {'target'})}"
                              + (f"; unknown: {sorted(unknown)}" if unknown else ""))
    core = {k: (int(v) if k == "max_batch" else v) for k, v in args.items() if k in ("max_batch", "method")}
    scale = {k: float(args[k]) if k == "target_ongoing_requests" else int(args[k])
             for k in ("min_replicas", "max_replicas", "target_ongoing_requests") if k in args}
    spec = ReplicaSpec(args["target"], args.get("draft"), core=core, replicas=int(args.get("replicas", 1)),
                       autoscaling=scale or None, cpus=float(args.get("cpus", 1)), gpus=float(args.get("gpus", 0)),
                       router=args.get("router", "prefix"))
    return application(spec, args.get("model_name"), api_key=os.environ.get("SPECENGINE_API_KEY") or None)


def run(spec: ReplicaSpec, host: str = "127.0.0.1", port: int = 8000, model_name: str | None = None,
        default_max_tokens: int = 256, api_key: str | None = None, address: str | None = None) -> None:
    """`specengine serve --ray`: join the Ray cluster at `address` (None: $RAY_ADDRESS, else a
    local one started here), serve the application on host:port until interrupted."""
    ray.init(address=address or os.environ.get("RAY_ADDRESS") or None)
    serve.start(http_options={"host": host, "port": port})
    serve.run(application(spec, model_name, default_max_tokens, api_key), name="specengine", route_prefix="/",
              blocking=True)
