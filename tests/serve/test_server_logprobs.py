"""Log-probabilities through the OpenAI API (issue 41 item 2), via the openai client: completions'
`logprobs` and `echo` (with `max_tokens: 0`, how lm-evaluation-harness scores a text), chat's
`logprobs` / `top_logprobs`, streamed and not. Values are the engine's own (tested against
transformers in tests/methods/test_logprobs.py); here the format and the plumbing."""
import math

import pytest
from test_server import MODEL, client, server  # noqa: F401 (fixtures)

openai = pytest.importorskip("openai")

PROMPT = "def add(a, b):\n"
MSGS = [{"role": "user", "content": "hi"}]
TOL = 1e-4


def engine_ref(server, prompt, n, **kw):
    return server[2].generate(prompt, max_new_tokens=n, method="sd", gamma=3, ignore_eos=True, **kw)


def close(a, b):
    return all(math.isclose(x, y, abs_tol=TOL) for x, y in zip(a, b)) and len(a) == len(b)


def test_completion_logprobs_are_the_engines(server, client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    want = engine_ref(server, PROMPT, 8, logprobs=2)
    lp = r.choices[0].logprobs
    assert close(lp.token_logprobs, [e.logprob for e in want.logprobs])
    assert lp.tokens == [server[2].tokenizer.decode([t]) for t in want.token_ids]
    assert all(len(top) <= 2 and tok in top for tok, top in zip(lp.tokens, lp.top_logprobs))  # greedy: the top one
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_echo_with_max_tokens_0_scores_the_prompt(server, client):
    """lm-evaluation-harness's log-likelihood request: the prompt back, each token scored, nothing generated."""
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = r.choices[0]
    want = engine_ref(server, PROMPT, 1, logprobs=1, prompt_logprobs=True).prompt_logprobs
    assert choice.text == PROMPT and r.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert close(choice.logprobs.token_logprobs[1:], [e.logprob for e in want[1:]])
    both = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, echo=True, logprobs=0, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert both.choices[0].text.startswith(PROMPT) and len(both.choices[0].logprobs.tokens) == len(want) + 3


def test_chat_logprobs_and_top_logprobs(server, client):
    r = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    want = engine_ref(server, MSGS, 6, logprobs=3)
    assert close([c.logprob for c in content], [e.logprob for e in want.logprobs])
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.top_logprobs[-1].logprob for c in content)
    assert "".join(c.token for c in content) == r.choices[0].message.content
    assert all(bytes(c.bytes).decode() == c.token for c in content)
    plain = client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_streamed_logprobs_add_up_to_the_whole_answers(server, client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=1, echo=True,
              extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **kw)]
    assert "".join(c.text for c in chunks) == whole.text
    streamed = [v for c in chunks if c.logprobs for v in c.logprobs.token_logprobs]
    assert streamed[0] is None and close(streamed[1:], whole.logprobs.token_logprobs[1:])
    msgs = [c.choices[0] for c in client.chat.completions.create(model=MODEL, messages=MSGS, max_tokens=5, stream=True,
                                                                 temperature=0, logprobs=True)]
    assert sum(len(c.logprobs.content) for c in msgs if c.logprobs) == 5
