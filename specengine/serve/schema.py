"""The HTTP server's request and error schemas (pydantic), built from `RequestParams` (its
served fields, under OpenAI's names, with the bounds the engine enforces: the schema tells the
truth) plus OpenAI's own fields (model, stream, n, messages / prompt)."""
from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, Field, StrictBool, create_model

from ..request import served_fields


def _no_bool(value):
    """JSON's true/false is not a number: refused where pydantic would coerce it to 1/0."""
    if isinstance(value, bool):
        raise ValueError("a boolean is not a number here")
    return value


Int = Annotated[int, BeforeValidator(_no_bool)]  # JSON Schema integers (1.0 included), never booleans
Float = Annotated[float, BeforeValidator(_no_bool)]


# OpenAI's defaults where they differ from the API's (RequestParams): temperature 1; a request
# without max_tokens gets the server's default_max_tokens; seed may be null
OPENAI_DEFAULTS = {"temperature": 1.0, "max_new_tokens": None, "seed": None}


class _Request(BaseModel):
    """What every completion request carries beside the sampling fields."""
    model: str
    stream: StrictBool = False
    stream_options: dict | None = None  # {"include_usage": true}: a last chunk with usage
    n: Int = Field(default=1, ge=1, le=1)


def _sampling_fields() -> dict:
    """The served RequestParams fields as pydantic fields, under their API names, with the
    bounds the engine enforces (the schema tells the truth): numbers are JSON numbers
    (`"ignore_eos": 0` or a prompt of booleans is refused, not coerced)."""
    fields = {}
    for f in served_fields():
        kind = {bool: StrictBool, int: Int, float: Float}.get(type(f.default), str | list[str] | None)
        default = OPENAI_DEFAULTS.get(f.name, f.default)
        fields[f.metadata["served"]] = (kind | None if default is None else kind,
                                        Field(default=default, description=f.metadata["help"], **f.metadata["schema"]))
    return fields


Sampling = create_model("Sampling", __base__=_Request, **_sampling_fields())


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """OpenAI's error body."""
    error: ErrorDetail


STREAMED = {200: {"description": "a completion (JSON), or with `stream: true` server-sent events",
                  "content": {"application/json": {}, "text/event-stream": {}}}}
ERRORS = {400: {"model": ErrorBody, "description": "bad request: the field at fault is `error.param`"},
          401: {"model": ErrorBody, "description": "missing or wrong API key (servers started with --api-key)"},
          500: {"model": ErrorBody, "description": "the engine failed this request (others are unaffected)"},
          503: {"model": ErrorBody, "description": "overloaded: too many requests waiting; retry later"}}


class CompletionRequest(Sampling):
    prompt: str | list[Int]


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)


