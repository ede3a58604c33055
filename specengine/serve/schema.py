"""The HTTP server's request and error schemas (pydantic), built from `RequestParams` (its
served fields, under OpenAI's names, with the bounds the engine enforces: the schema tells the
truth) plus OpenAI's own fields (model, stream, n, messages / prompt).

No parameter is silently ignored. A field the server does not know is a 400 naming it
(`extra="forbid"`). OpenAI parameters it does not implement are declared with only their
no-op value allowed (`frequency_penalty: 0`, `logit_bias: {}`, `tools: []`, ...), so clients
that send defaults work and anything else is a 400 that names the field and says why
(UNSUPPORTED). Structured output is served: `response_format` (json_object, json_schema) and
vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. `user` is
informational: accepted and unused."""
from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictBool, create_model

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


# OpenAI parameters this server does not implement: only their no-op value is accepted (below);
# any other value is a 400 with this reason
UNSUPPORTED = {
    "n": "only n=1 is supported",
    "frequency_penalty": "penalties are not implemented; only 0 is accepted",
    "presence_penalty": "penalties are not implemented; only 0 is accepted",
    "logit_bias": "logit_bias is not implemented; only {} is accepted",
    "tools": "tool calling is not implemented; only [] is accepted",
    "tool_choice": 'tool calling is not implemented; only "none" is accepted',
    "best_of": "only best_of=1 is supported",
    "suffix": "suffix (insertion) is not implemented; only an empty suffix is accepted",
}

class JsonSchemaFormat(BaseModel):
    """OpenAI's `response_format.json_schema`: the schema the output must follow."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str
    description: str | None = None
    schema_: dict = Field(alias="schema")
    strict: StrictBool | None = None  # the output always follows the schema here (strict or not)


class ResponseFormat(BaseModel):
    """`response_format`: text (no constraint), any JSON object, or JSON under a schema."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Request(BaseModel):
    """What every completion request carries beside the sampling fields."""
    model_config = ConfigDict(extra="forbid")  # an unknown field is a 400 naming it, never ignored
    model: str
    stream: StrictBool = False
    stream_options: dict | None = None  # {"include_usage": true}: a last chunk with usage
    n: Int = Field(default=1, ge=1, le=1)
    user: str | None = Field(default=None, description="informational: accepted and not used")
    frequency_penalty: Float | None = Field(default=None, ge=0, le=0, description=UNSUPPORTED["frequency_penalty"])
    presence_penalty: Float | None = Field(default=None, ge=0, le=0, description=UNSUPPORTED["presence_penalty"])
    logit_bias: dict[str, Float] | None = Field(default=None, max_length=0, description=UNSUPPORTED["logit_bias"])
    response_format: ResponseFormat | None = Field(default=None, description="structured output: json_object or "
                                                   "json_schema (xgrammar; lossless under every method)")
    tools: list[dict] | None = Field(default=None, max_length=0, description=UNSUPPORTED["tools"])
    tool_choice: Literal["none"] | None = Field(default=None, description=UNSUPPORTED["tool_choice"])


def _sampling_fields() -> dict:
    """The served RequestParams fields as pydantic fields, under their API names, with the
    bounds the engine enforces (the schema tells the truth): numbers are JSON numbers
    (`"ignore_eos": 0` or a prompt of booleans is refused, not coerced)."""
    fields = {}
    for f in served_fields():
        kind = f.metadata.get("kind") or {bool: StrictBool, int: Int, float: Float}.get(type(f.default),
                                                                                          str | list[str] | None)
        default = OPENAI_DEFAULTS.get(f.name, f.default)
        fields[f.metadata["served"]] = (kind | None if default is None else kind,
                                        Field(default=default, description=f.metadata["help"], **f.metadata["schema"]))
    return fields


Sampling = create_model("Sampling", __base__=_Request, **_sampling_fields())


_BOUNDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def json_schema_bounds(node):
    """pydantic writes the bounds of an optional field whose type has a validator (Int, Float)
    under their Python names (ge, lt, ...), which JSON Schema ignores: renamed in place, so the
    published schema states them (schemathesis then generates within them)."""
    if isinstance(node, dict):
        if node.get("type") in ("integer", "number"):
            for py, js in _BOUNDS.items():
                if py in node:
                    node[js] = node.pop(py)
        for value in node.values():
            json_schema_bounds(value)
    elif isinstance(node, list):
        for value in node:
            json_schema_bounds(value)
    return node


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
ERRORS = {400: {"model": ErrorBody, "description": "bad request: the field at fault is `error.param`. Beside what "
                                                  "the schema states: a prompt that tokenizes to no tokens, or a "
                                                  "prompt plus max_tokens longer than the KV cache"},
          401: {"model": ErrorBody, "description": "missing or wrong API key (servers started with --api-key)"},
          500: {"model": ErrorBody, "description": "the engine failed this request (others are unaffected)"},
          503: {"model": ErrorBody, "description": "overloaded: too many requests waiting; retry later"}}


class CompletionRequest(Sampling):
    prompt: str | list[Int]
    max_tokens: Int | None = Field(default=None, ge=0, description="new tokens, at most; 0 with echo scores the "
                                                                    "prompt (lm-evaluation-harness's log-likelihood)")
    logprobs: Int | None = Field(default=None, ge=0, le=5, description="each token's log-probability under the "
                                 "target and the top N alternatives (raw: the model's log_softmax)")
    echo: StrictBool = Field(default=False, description="the prompt before the completion, in the text and, with "
                             "logprobs, its tokens' log-probabilities (the first token has none)")
    best_of: Int | None = Field(default=None, ge=1, le=1, description=UNSUPPORTED["best_of"])
    suffix: str | None = Field(default=None, max_length=0, description=UNSUPPORTED["suffix"])


class ChatMessage(BaseModel):
    role: str
    content: str


class ChatRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1, description="OpenAI's newer name for max_tokens")
    logprobs: StrictBool | None = Field(default=None, description="each token's log-probability under the target "
                                        "(raw: the model's log_softmax)")
    top_logprobs: Int | None = Field(default=None, ge=0, le=20, description="the N most likely alternatives per "
                                     "token (needs logprobs: true)")


