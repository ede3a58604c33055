"""Serving: a request-level core with continuous batching (core.py), an asyncio front end
driven by one background thread (async_engine.py) and an OpenAI-compatible HTTP server
(server.py, needs the `[serve]` extra)."""
from .async_engine import AsyncEngine
from .core import EngineCore, Overloaded, RequestOutput, RequestParams

__all__ = ["AsyncEngine", "EngineCore", "Overloaded", "RequestOutput", "RequestParams"]
