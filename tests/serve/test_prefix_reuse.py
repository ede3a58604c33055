"""Prefix reuse across requests (serve/core.py): a turn that continues a conversation is
admitted into the free row holding the previous turn and prefills only the new tokens, and
its tokens are those of a cold, standalone generation."""
import pytest

from specengine import Engine
from specengine.runtime.step_costs import StepCosts
from specengine.serve import EngineCore, RequestParams

OPENERS = ["def add(a, b):\n", "x = [1, 2", "for i in range(3", "import os\n"]
FOLLOW_UPS = ["\nuser: and then?\n", "\nuser: why?\n", "\nuser: more\n"]


@pytest.fixture()
def engines(tiny_pair, tokenizer):
    target, _, draft = tiny_pair
    return (Engine(target, tokenizer, draft, max_seq_len=384, max_batch=2),
            Engine(target, tokenizer, draft, max_seq_len=384))


def run_conversations(core, tokenizer, turns: int, max_new: list[int], sampling: dict):
    """Conversations 0 and 1 start at once and a third joins when 0's second turn ends (so it
    takes a row another conversation held); each sends its next turn (previous prompt + answer
    + a follow-up, as token ids) as soon as the previous one finished. Returns {(conv, turn):
    (prompt ids, output, seed)}."""
    prompts = {c: tokenizer.encode(OPENERS[c]) for c in range(3)}
    pending, results = {}, {}

    def send(c, t):
        seed = 100 * c + t
        rid = core.add_request(prompts[c], RequestParams(max_new_tokens=max_new[(c + t) % len(max_new)],
                                                         ignore_eos=True, seed=seed, **sampling))
        pending[rid] = (c, t, list(prompts[c]), seed)

    send(0, 0), send(1, 0)
    while core.has_unfinished():
        for out in core.step():
            if not out.finished:
                continue
            c, t, prompt, seed = pending.pop(out.request_id)
            assert out.finish_reason == "length", out.error
            results[c, t] = (prompt, out, seed)
            if t + 1 < turns:
                prompts[c] = prompt + out.token_ids + tokenizer.encode(FOLLOW_UPS[t % len(FOLLOW_UPS)])
                send(c, t + 1)
            if (c, t) == (0, 1):
                send(2, 0)
    return results


@pytest.mark.parametrize("method,sampling", [("ar", {}), ("sd", {}), ("pearl", {}), ("ngram", {}), ("hybrid", {}),
                                             ("hybrid:auto", {}),
                                             ("sd", dict(temperature=0.8, top_k=30))])
def test_concurrent_multi_turn_conversations_reuse_their_rows_and_keep_cold_tokens(engines, tokenizer, method,
                                                                                   sampling):
    """Three conversations over two rows (so a row is taken from another, too): every turn gets
    the tokens of a cold standalone generation with its seed, and turns that came back to their
    row reused all of the previous turn's prompt and answer (the row held them). hybrid:auto
    (costs where the draft pays) reads each admitted row into the draft on its first draft round;
    it is greedy only, since its rounds are chosen for the whole batch (sampled, it keeps the
    target's distribution, not a cold run's samples)."""
    eng, ref = engines
    method, _, gamma = method.partition(":")
    gamma = gamma or 3
    if gamma == "auto":
        for e in (eng, ref):
            e.step_costs = lambda state, width, draft=True: StepCosts(state.batch, 0.05, (1.0,) * width)
    core = EngineCore(eng, max_batch=2, method=method, gamma=gamma)
    results = run_conversations(core, tokenizer, turns=3, max_new=[7, 12, 5], sampling=sampling)
    assert len(results) == 9
    if gamma == "auto":  # admitted rows were read into the draft when it first drafted them
        assert core.gen.method.primes >= 3 and core.gen.method.draft_rounds > 0
    reused = 0
    for (c, t), (prompt, out, seed) in sorted(results.items()):
        cold = ref.generate(prompt, max_new_tokens=len(out.token_ids), method=method, gamma=gamma, ignore_eos=True,
                            seed=seed, **sampling)
        assert out.token_ids == cold.token_ids, (method, c, t)
        assert out.cached_tokens < len(prompt)  # the last prompt token is always fed anew
        if t:
            previous_prompt, previous, _ = results[c, t - 1]
            if out.cached_tokens >= len(previous_prompt) + len(previous.token_ids) - 1:
                reused += 1  # all the row could hold: the previous prompt and answer but its last token
    assert reused >= 3, reused  # most later turns found their row


def test_reuse_prefills_only_the_new_tokens(engines, tokenizer):
    """The second turn's target prefill runs the new tokens alone, from the position the row
    held; without reuse it runs the whole prompt."""
    eng, _ = engines
    seen = []
    forward = eng.target.forward
    eng.target.forward = lambda tokens, **kw: (seen.append(tokens.shape[1]), forward(tokens, **kw))[1]
    try:
        sizes = {}
        for reuse in (True, False):
            core = EngineCore(eng, max_batch=2, method="ar", prefix_reuse=reuse)
            first = tokenizer.encode(OPENERS[0])
            out = core_run(core, first, 9)
            second = first + out.token_ids + tokenizer.encode(FOLLOW_UPS[0])
            seen.clear()
            out2 = core_run(core, second, 4)
            sizes[reuse] = (seen[0], out2.cached_tokens, out2.token_ids)
    finally:
        del eng.target.forward
    held = len(first) + 9 - 1  # the first turn's prompt and answer but the answer's last token
    assert sizes[True][:2] == (len(second) - 1 - held, held)
    assert sizes[False][:2] == (len(second) - 1, 0)
    assert sizes[True][2] == sizes[False][2]


def core_run(core, prompt, n):
    rid = core.add_request(prompt, RequestParams(max_new_tokens=n, ignore_eos=True))
    while core.has_unfinished():
        for out in core.step():
            if out.request_id == rid and out.finished:
                return out


def test_a_prompt_that_diverges_inside_the_held_tokens_reuses_only_the_shared_start(engines, tokenizer):
    """An edited earlier message: the row keeps the shared start, recomputes the rest; the same
    prompt again (a regenerate) reuses all of it."""
    eng, ref = engines
    core = EngineCore(eng, max_batch=1, method="sd", gamma=3)
    first = tokenizer.encode("def add(a, b):\n    return a + b\n")
    core_run(core, first, 6)
    edited = first[:10] + tokenizer.encode("c, d):\n    return c * d\n")
    out = core_run(core, edited, 8)
    assert out.cached_tokens == 10
    want = ref.generate(edited, max_new_tokens=8, method="sd", gamma=3, ignore_eos=True).token_ids
    assert out.token_ids == want
    again = core_run(core, edited, 8)  # regenerate: the row holds all of it; only the last token is fed
    assert again.cached_tokens == len(edited) - 1 and again.token_ids == want


def test_a_shared_system_prompt_takes_an_empty_row_and_leaves_the_conversation_held(engines, tokenizer):
    """Another request that shares only the start every chat has (a system prompt) goes to an
    empty row while one is left, so the conversation's next turn still finds its row."""
    eng, ref = engines
    core = EngineCore(eng, max_batch=2, method="sd", gamma=3)
    system = tokenizer.encode("system: be brief\n")
    turn1 = system + tokenizer.encode("user: def add(a, b):\n")
    first = core_run(core, turn1, 12)
    other = core_run(core, system + tokenizer.encode("user: import os\n"), 6)
    assert other.cached_tokens == 0  # the empty row, not the conversation's
    turn2 = turn1 + first.token_ids + tokenizer.encode("user: and then?\n")
    second = core_run(core, turn2, 8)
    assert second.cached_tokens >= len(turn1)
    assert second.token_ids == ref.generate(turn2, max_new_tokens=8, method="sd", gamma=3, ignore_eos=True).token_ids


def test_prompt_logprobs_and_a_new_sampling_class_prefill_cold(engines, tokenizer):
    """Prompt log-probabilities need every position's logits; a new sampling class starts fresh
    caches: neither reuses a row."""
    eng, _ = engines
    core = EngineCore(eng, max_batch=1, method="ar")
    first = tokenizer.encode(OPENERS[1])
    out = core_run(core, first, 5)
    rid = core.add_request(first + out.token_ids, RequestParams(max_new_tokens=2, prompt_logprobs=True))
    outs = [o for _ in range(3) for o in core.step() if o.request_id == rid]
    assert outs[0].cached_tokens == 0 and len(outs[0].prompt_logprobs) == len(first) + 5
    core_run(core, first, 3)
    rid = core.add_request(first + [5], RequestParams(max_new_tokens=2, temperature=0.7))
    assert [o for o in core.step() if o.request_id == rid][0].cached_tokens == 0


def test_a_chat_through_the_openai_client_reports_its_cached_tokens(tiny_pair, tokenizer):
    """Turn 2 of a chat (the client sends the whole history) reuses turn 1's row: usage says how
    many prompt tokens were cached, /metrics counts them, and the reply is the standalone one."""
    openai = pytest.importorskip("openai")
    httpx = pytest.importorskip("httpx")
    from test_server import MODEL, start

    from specengine.serve.server import create_app

    target, _, draft = tiny_pair
    app = create_app(Engine(target, tokenizer, draft, max_seq_len=384, max_batch=2), MODEL, method="sd", gamma=3)
    url, stop = start(app)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        ref = Engine(target, tokenizer, draft, max_seq_len=384)
        msgs = [{"role": "user", "content": "write a loop"}]
        first = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
        assert first.usage.prompt_tokens_details.cached_tokens == 0
        msgs += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "now in reverse"}]
        second = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
        assert second.choices[0].message.content == ref.generate(msgs, max_new_tokens=12, method="sd", gamma=3).text
        cached = second.usage.prompt_tokens_details.cached_tokens
        assert first.usage.prompt_tokens < cached < second.usage.prompt_tokens
        metrics = httpx.get(url + "/metrics").text
        assert f"specengine_cached_prompt_tokens_total {cached}" in metrics
    finally:
        stop()


def test_auto_turns_reuse_on_for_fp32_targets_only(tiny_pair, tokenizer):
    """16-bit activations round a two-chunk prefill differently from a whole one: auto leaves
    reuse off there (it can still be asked for); a bad value is named."""
    import copy

    import torch

    from specengine.errors import SpecEngineError

    target, _, draft = tiny_pair
    assert EngineCore(Engine(target, tokenizer, max_seq_len=64)).prefix_reuse is True
    half = copy.deepcopy(target).to(torch.bfloat16)
    assert EngineCore(Engine(half, tokenizer, max_seq_len=64)).prefix_reuse is False
    assert EngineCore(Engine(half, tokenizer, max_seq_len=64), prefix_reuse=True).prefix_reuse is True
    with pytest.raises(SpecEngineError, match="prefix_reuse"):
        EngineCore(Engine(target, tokenizer, max_seq_len=64), prefix_reuse="yes")
