"""No OpenAI parameter is silently ignored (issue 41 item 3): unknown or unimplemented ones get a 400
naming them through the openai client, their no-op values change nothing, chat's newer
`max_completion_tokens` works, and the published schema states what the server enforces,
including for a model whose tokenizer has no chat template (no chat route at all)."""
import copy
import json

import pytest
from test_server import MODEL, client, ref, server, start  # noqa: F401 (fixtures)

from specengine import Engine

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

PROMPT = "def add(a, b):\n"
MSGS = [{"role": "user", "content": "hi"}]

REFUSED = [  # (route, extra body, the param the 400 names, words its message holds)
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "Field required"),
    ("chat", {"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ("completions", {"guided_json": {"type": "objec"}}, "guided_json", "cannot be compiled"),
    ("completions", {"guided_regex": "a(b"}, "guided_regex", "does not compile"),
    ("chat", {"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex", "one output constraint"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tool calling"),
    ("chat", {"tool_choice": "auto"}, "tool_choice", "tool calling"),
    ("completions", {"logit_bias": {"5": 10}}, "logit_bias", "not implemented"),
    ("completions", {"frequency_penalty": 0.5}, "frequency_penalty", "penalties"),
    ("chat", {"presence_penalty": -1}, "presence_penalty", "penalties"),
    ("completions", {"best_of": 2}, "best_of", "best_of=1"),
    ("completions", {"suffix": "}"}, "suffix", "suffix"),
    ("completions", {"n": 2}, "n", "n=1"),
    ("completions", {"logprobs": 6}, "logprobs", "less than or equal to 5"),
    ("chat", {"top_logprobs": 3}, "top_logprobs", "needs logprobs: true"),
    ("chat", {"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
    ("chat", {"functions": [{"name": "f"}]}, "functions", "not a parameter"),
    ("completions", {"temperture": 0.5}, "temperture", "not a parameter"),  # a typo is not ignored either
    ("chat", {"max_tokens": 4, "max_completion_tokens": 5}, "max_completion_tokens", "disagree"),
]


def _create(client, route, **kw):
    if route == "chat":
        return client.chat.completions.create(model=MODEL, messages=MSGS, **kw)
    return client.completions.create(model=MODEL, prompt=PROMPT, **kw)


@pytest.mark.parametrize("route, extra, param, words", REFUSED, ids=[f"{r[0]}-{r[2]}" for r in REFUSED])
def test_an_unimplemented_parameter_is_a_400_that_names_it(client, route, extra, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        _create(client, route, max_tokens=extra.pop("max_tokens", 3), temperature=0, extra_body=extra)
    assert err.value.param == param and words in err.value.message, err.value.body


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_no_op_values_and_informational_fields_change_nothing(server, client, route):
    plain = _create(client, route, max_tokens=6, temperature=0)
    same = _create(client, route, max_tokens=6, temperature=0, user="someone", n=1, frequency_penalty=0,
                   presence_penalty=0.0, logit_bias={}, extra_body={"response_format": {"type": "text"}, "tools": [],
                                                                    "tool_choice": "none"})
    text = (lambda r: r.choices[0].message.content) if route == "chat" else (lambda r: r.choices[0].text)
    assert text(same) == text(plain) == ref(server, MSGS if route == "chat" else PROMPT, 6).text
    if route == "completions":
        again = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, echo=False,
                                          best_of=1, suffix="")
        assert again.choices[0].text == text(plain)


def test_max_completion_tokens_is_chats_max_tokens(server, client):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_completion_tokens=5, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 5
    assert r.choices[0].message.content == ref(server, MSGS, 5, ignore_eos=True).text


def test_the_schema_states_bounds_and_refuses_unknown_fields(server):
    schema = httpx.get(server[0] + "/openapi.json").json()
    text = json.dumps(schema)
    assert '"ge":' not in text and '"lt":' not in text and '"le":' not in text  # JSON Schema names only
    comp = schema["components"]["schemas"]
    for name in ("CompletionRequest", "ChatRequest"):
        assert comp[name]["additionalProperties"] is False
    seed = comp["CompletionRequest"]["properties"]["seed"]["anyOf"][0]
    assert seed["minimum"] == 0 and seed["exclusiveMaximum"] == 2 ** 63
    penalty = comp["ChatRequest"]["properties"]["frequency_penalty"]["anyOf"][0]
    assert penalty["minimum"] == penalty["maximum"] == 0
    assert comp["ChatRequest"]["properties"]["max_completion_tokens"]["anyOf"][0]["maximum"] >= 1


def test_a_tokenizer_without_a_chat_template_gets_no_chat_route(tiny_pair, tokenizer):
    from specengine.serve.server import create_app

    tok = copy.deepcopy(tokenizer)  # the session's tokenizer keeps its template
    tok.chat_template = None
    target, _, draft = tiny_pair
    app = create_app(Engine(target, tok, draft, max_seq_len=128, max_batch=2), MODEL, default_max_tokens=4)
    url, stop = start(app)
    try:
        assert "/v1/chat/completions" not in httpx.get(url + "/openapi.json").json()["paths"]
        r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": MSGS})
        assert r.status_code == 404
        ok = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] >= 1
    finally:
        stop()


SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "c": {"enum": ["x", "y"]}}, "required": ["n", "c"]}


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_structured_output_is_served_as_the_engine_gives_it(server, client, route):
    """response_format and vLLM's guided_* fields: the server's rows (the serving core, method sd)
    give the engine's own constrained output, JSON that follows the schema."""
    fmt = {"type": "json_schema", "json_schema": {"name": "n_c", "schema": SCHEMA, "strict": True}}
    got = _create(client, route, max_tokens=40, temperature=0, extra_body={"response_format": fmt})
    text = got.choices[0].message.content if route == "chat" else got.choices[0].text
    prompt = MSGS if route == "chat" else PROMPT
    assert text == ref(server, prompt, 40, json_schema=SCHEMA).text
    assert got.choices[0].finish_reason == "stop"
    obj = json.loads(text)
    assert set(obj) == {"n", "c"} and 0 <= obj["n"] <= 99 and obj["c"] in ("x", "y")
    got = _create(client, route, max_tokens=12, temperature=0, extra_body={"guided_choice": ["yes", "no"]})
    text = got.choices[0].message.content if route == "chat" else got.choices[0].text
    assert text in ("yes", "no") and text == ref(server, prompt, 12, choice=["yes", "no"]).text
    got = _create(client, route, max_tokens=12, temperature=0, extra_body={"response_format": {"type": "json_object"}})
    text = got.choices[0].message.content if route == "chat" else got.choices[0].text
    assert text == ref(server, prompt, 12, response_format={"type": "json_object"}).text and text.startswith("{")
