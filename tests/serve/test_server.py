"""A real server on 127.0.0.1 (uvicorn in a thread, tiny models) exercised with the official
`openai` client and httpx: completions, chat, streaming, stops, concurrency, aborts, 400s,
and a bounded soak."""
import gc
import json
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from specengine import Engine

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")

MODEL = "tiny"
PROMPTS = ["def add(a, b):\n", "x = [1", "for i in range(3", "import os", "class A:", "while x:", "y = (", "z = {"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(app):
    """(base url, stop()) for a uvicorn server running `app` in a thread."""
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    for _ in range(200):
        if srv.started:
            break
        time.sleep(0.05)
    assert srv.started

    def stop():
        srv.should_exit = True
        thread.join(10)
    return f"http://127.0.0.1:{port}", stop


@pytest.fixture(scope="module")
def server(tiny_pair, tokenizer):
    """(base url, the served AsyncEngine, a separate engine for standalone references)."""
    from specengine.serve.server import create_app

    target, _, draft = tiny_pair
    served = Engine(target, tokenizer, draft, max_seq_len=256, max_batch=4)
    app = create_app(served, MODEL, default_max_tokens=16, max_batch=4, max_waiting=64, method="sd", gamma=3)
    url, stop = start(app)
    yield url, app.state.engine, Engine(target, tokenizer, draft, max_seq_len=256)
    stop()


@pytest.fixture()
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="none", max_retries=0)


def ref(server, prompt, n, **kw):
    return server[2].generate(prompt, max_new_tokens=n, method="sd", gamma=3, **kw)


def idle(aeng, timeout=10.0) -> bool:
    t = time.time()
    while time.time() - t < timeout:
        if not aeng.core.has_unfinished() and not aeng._queues:
            return True
        time.sleep(0.02)
    return False


def test_models_health_and_metrics(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server[0] + "/health").json() == {"status": "ok"}
    client.completions.create(model=MODEL, prompt="x = 1", max_tokens=3, temperature=0)
    text = httpx.get(server[0] + "/metrics").text
    for name in ("specengine_requests_total", "specengine_generated_tokens_total", "specengine_acceptance_rate",
                 "specengine_time_to_first_token_seconds_bucket", "specengine_inter_token_seconds_count",
                 "specengine_request_latency_seconds_sum"):
        assert name in text
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert float(values["specengine_requests_total"]) >= 1 and float(values["specengine_generated_tokens_total"]) >= 3


def test_gateway_metrics_parse_with_prometheus_and_follow_the_core(server, client):
    """What the Gateway API Inference Extension's endpoint picker reads (vLLM's names: waiting,
    running, KV-cache usage, the LoRA info gauge) and our speculative figures per method, read
    by Prometheus' own parser; the gauges follow the core while a request runs."""
    from prometheus_client.parser import text_string_to_metric_families

    url, aeng, _ = server
    client.completions.create(model=MODEL, prompt="x = 1", max_tokens=4, temperature=0)

    def scrape():
        return {s.name: s for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)
                for s in f.samples}

    idle = scrape()
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert idle[name].labels == {"model_name": MODEL} and idle[name].value == 0, name
    assert idle["vllm:lora_requests_info"].labels == {"max_lora": "0", "running_lora_adapters": "",
                                                      "waiting_lora_adapters": ""}
    assert idle["specengine_tokens_per_target_forward"].labels == {"method": "sd"}
    assert idle["specengine_tokens_per_target_forward"].value >= 1  # a round commits one token at least
    assert 0 <= idle["specengine_method_acceptance_rate"].value <= 1
    seen, new = [], 160  # a long reply: a loaded machine must not finish it before the first scrape
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=new, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    for _ in stream:  # mid-stream: one request holds a row and its tokens (scraped until seen: on a
        if not seen or seen[0] == 0:  # loaded machine the server may finish before the first scrape)
            now = scrape()
            seen = [now["vllm:num_requests_running"].value, now["vllm:kv_cache_usage_perc"].value]
    held = len(aeng.engine.encode(PROMPTS[0])[0][0]) + new  # at most the request's whole text
    assert seen[0] == 1 and 0 < seen[1] <= held / (aeng.core.max_batch * aeng.engine.max_seq_len) + 1e-9


def test_completion_and_chat_equal_standalone_greedy(server, client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    want = ref(server, PROMPTS[0], 12, ignore_eos=True)
    assert r.choices[0].text == want.text and r.usage.completion_tokens == 12
    assert r.choices[0].finish_reason == "length"
    msgs = [{"role": "user", "content": "hi"}]
    c = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=10, temperature=0)
    assert c.choices[0].message.content == ref(server, msgs, 10).text


def test_streaming_and_stop_strings(server, client):
    want = ref(server, PROMPTS[1], 14, ignore_eos=True).text
    pieces = [ch.choices[0].text for ch in client.completions.create(
        model=MODEL, prompt=PROMPTS[1], max_tokens=14, temperature=0, stream=True, extra_body={"ignore_eos": True})]
    assert "".join(pieces) == want and len([p for p in pieces if p]) > 1
    last = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=5, temperature=0, stream=True,
                                          stream_options={"include_usage": True}))[-1]
    assert last.usage.completion_tokens == 5 and not last.choices
    stop = want[6:8]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=14, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == want[:want.index(stop)] and r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}],
                                                 max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref(
        server, [{"role": "user", "content": "a"}], 8).text


def test_sixteen_concurrent_requests_each_equal_standalone(server, client):
    jobs = [(PROMPTS[i % len(PROMPTS)], 6 + i % 5) for i in range(16)]

    def call(job):
        p, n = job
        return client.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
    with ThreadPoolExecutor(16) as pool:
        got = list(pool.map(call, jobs))
    assert got == [ref(server, p, n, ignore_eos=True).text for p, n in jobs]
    assert idle(server[1]) and server[1].core.free_slots == 4


def test_disconnect_aborts_and_frees_the_row(server):
    aeng = server[1]
    before = aeng.metrics["aborted"]
    body = {"model": MODEL, "prompt": PROMPTS[2], "max_tokens": 200, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", server[0] + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["text"]:
                break  # one piece, then hang up
    assert idle(aeng) and aeng.metrics["aborted"] == before + 1 and aeng.core.free_slots == 4


@pytest.mark.parametrize("body,param", [
    ({"model": "other", "prompt": "x"}, "model"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, "temperature"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, "top_p"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -1}, "max_tokens"),  # 0 scores the prompt (test_server_logprobs)
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"model": MODEL, "prompt": "x" * 400}, "prompt"),
    ({"model": MODEL, "prompt": "x", "n": 2}, "n"),
    ({"model": MODEL, "prompt": ""}, "prompt"),
    ({"model": MODEL, "prompt": [10 ** 9]}, "prompt"),
    ({"model": MODEL}, "prompt"),
    ({"model": MODEL, "messages": []}, "messages"),
])
def test_bad_requests_get_a_400_naming_the_field(server, body, param):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    r = httpx.post(server[0] + path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["message"]


def test_malformed_json_is_a_400_and_the_server_survives(server, client):
    r = httpx.post(server[0] + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0).choices[0].text is not None


def test_overloaded_queue_gets_a_503(tiny_pair, tokenizer):
    from specengine.serve import AsyncEngine, Overloaded, RequestParams
    import asyncio

    target, _, draft = tiny_pair
    aeng = AsyncEngine(Engine(target, tokenizer, draft, max_seq_len=256, max_batch=1), max_batch=1, max_waiting=1)
    try:
        async def main():
            aeng.submit("a", RequestParams(max_new_tokens=200, ignore_eos=True))
            for _ in range(100):  # wait until it runs, then fill the one waiting place
                if aeng.core.running:
                    break
                await asyncio.sleep(0.01)
            aeng.submit("b", RequestParams(max_new_tokens=2))
            with pytest.raises(Overloaded):
                aeng.submit("c", RequestParams(max_new_tokens=2))
        asyncio.run(main())
    finally:
        aeng.shutdown()


def rss_mb() -> float:
    """This process's resident memory now (not its peak: ru_maxrss never falls, and earlier
    tests already raised it by gigabytes, so a peak could hide any growth)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_bounded_soak_no_lost_or_mixed_responses(server, client):
    """A few hundred short requests from 8 threads: every response is the standalone answer for
    its own prompt, nothing is left running, and resident memory stays flat (measured after a
    warm-up batch, before and after the soak)."""
    jobs = [(PROMPTS[i % len(PROMPTS)] + str(i % 13), 2 + i % 4) for i in range(240)]
    want = {j: ref(server, j[0], j[1], ignore_eos=True).text for j in set(jobs)}

    def call(job):
        p, n = job
        return client.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(call, jobs[:24]))  # warm-up: allocator pools, client connections
    gc.collect()
    rss0 = rss_mb()
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(call, jobs))
    assert [g == want[j] for g, j in zip(got, jobs)] == [True] * len(jobs)
    assert idle(server[1]) and not server[1]._queues and server[1].core.free_slots == 4
    gc.collect()
    assert rss_mb() - rss0 < 100, (rss0, rss_mb())


def test_sampled_requests_equal_seeded_generate(server, client):
    """Sampled requests, concurrent, each with its own seed: the tokens of Engine.generate with
    that seed (whatever row served it)."""
    jobs = [(PROMPTS[i], 10, 100 + i) for i in range(6)]
    kw = dict(temperature=0.8, top_p=0.95)

    def call(job):
        p, n, seed = job
        return client.completions.create(model=MODEL, prompt=p, max_tokens=n, seed=seed, **kw,
                                         extra_body={"ignore_eos": True}).choices[0].text
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(call, jobs))
    want = [ref(server, p, n, seed=seed, ignore_eos=True, **kw).text for p, n, seed in jobs]
    assert got == want
    assert want[0] != ref(server, PROMPTS[0], 10, seed=7, ignore_eos=True, **kw).text  # seeds matter


GOOD = [(PROMPTS[i], 8) for i in range(6)]


def _good(server, client, job):
    p, n = job
    return client.completions.create(model=MODEL, prompt=p, max_tokens=n, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text


@pytest.mark.parametrize("body,param", [
    ({"temperature": 1e308}, "temperature"),  # past fp32: once took the engine loop down
    ({"temperature": 1e39}, "temperature"),
    ({"top_p": 1e-300, "temperature": 1.0, "seed": -1}, "seed"),
])
def test_a_bad_request_among_good_ones_fails_alone(server, client, body, param):
    """Bad requests sent concurrently between good ones: each bad one gets a 400 naming its
    field, every good one its exact standalone answer, and the server stays healthy."""
    def bad(_):
        r = httpx.post(server[0] + "/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4, **body})
        return r.status_code, r.json()["error"]["param"]
    with ThreadPoolExecutor(9) as pool:
        goods = [pool.submit(_good, server, client, j) for j in GOOD]
        bads = [pool.submit(bad, i) for i in range(3)]
        got = [f.result() for f in goods]
    assert [b.result() for b in bads] == [(400, param)] * 3
    assert got == [ref(server, p, n, ignore_eos=True).text for p, n in GOOD]
    assert httpx.get(server[0] + "/health").json() == {"status": "ok"}


def test_extreme_but_valid_values_behave_as_their_limit(server, client):
    """A subnormal temperature is greedy; a top_p that rounds to 0 keeps the top token."""
    want = ref(server, PROMPTS[3], 8, ignore_eos=True).text
    for kw in (dict(temperature=1e-45), dict(temperature=1.0, top_p=1e-300)):
        r = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=8, **kw,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == want, kw


@pytest.mark.parametrize("where", ["admit", "step"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_fault_inside_the_engine_loop_fails_only_its_requests(server, client, monkeypatch, where, stream):
    """A fault injected where the loop admits a request (only the marked one) or runs a round
    (once): the requests it concerns get a 500 (or an error event) with the fault's message,
    the others their exact answers, the rows are freed and the server keeps serving."""
    from specengine.generation import Generation

    aeng, marker = server[1], "#!#"
    real = getattr(Generation, where)
    fired = []

    def faulty(self, *a, **k):
        if where == "admit" and marker in aeng.engine.decode(a[1]) or where == "step" and not fired:
            fired.append(1)
            raise RuntimeError("injected fault")
        return real(self, *a, **k)
    monkeypatch.setattr(Generation, where, faulty)
    body = {"model": MODEL, "prompt": marker + "x", "max_tokens": 6, "temperature": 0, "stream": stream}
    r = httpx.post(server[0] + "/v1/completions", json=body, timeout=60)
    if stream:
        assert r.status_code == 200
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert "injected fault" in events[-1]["error"]["message"]
    else:
        assert r.status_code == 500 and "injected fault" in r.json()["error"]["message"]
    assert fired and idle(aeng) and aeng.core.free_slots == 4
    with ThreadPoolExecutor(6) as pool:
        got = list(pool.map(lambda j: _good(server, client, j), GOOD))
    assert got == [ref(server, p, n, ignore_eos=True).text for p, n in GOOD]
    assert httpx.get(server[0] + "/health").json() == {"status": "ok"} and aeng.error is None


KEY = "sk-test-7f3c9a"


def test_several_api_keys_are_tenants_whose_suffix_caches_stay_apart(tiny_pair, tokenizer):
    """--api-key K1,K2: each key is a tenant; a suffix-decoding server remembers each key's
    responses apart (proposing one tenant's text to another would leak it), and names a tenant by
    its key's position, never by the key."""
    from specengine.serve.server import create_app

    eng = Engine(tiny_pair[0], tokenizer, max_seq_len=128, method="suffix")
    app = create_app(eng, MODEL, default_max_tokens=8, api_key="alpha-key,beta-key", method="suffix")
    url, stop = start(app)
    try:
        for key, times in (("alpha-key", 2), ("beta-key", 1)):
            client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0)
            for _ in range(times):
                client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="alpha-key,beta-key", max_retries=0).models.list()
    finally:
        stop()
    alpha, beta = eng.suffix_caches.get("key-0"), eng.suffix_caches.get("key-1")
    assert len(alpha) == 2 * len(beta) == 16 and len(eng.suffix_caches.get("")) == 0


@pytest.mark.parametrize("from_env", [False, True])
def test_api_key_guards_every_v1_route(tiny_pair, tokenizer, monkeypatch, from_env):
    """--api-key (or SPECENGINE_API_KEY): /v1 wants `Authorization: Bearer KEY`; a missing or
    wrong key gets OpenAI's 401 body; /health stays open; the key shows up in no response."""
    from specengine.serve.server import create_app

    target, _, draft = tiny_pair
    if from_env:
        monkeypatch.setenv("SPECENGINE_API_KEY", KEY)
    app = create_app(Engine(target, tokenizer, draft, max_seq_len=128), MODEL, default_max_tokens=4,
                     api_key=None if from_env else KEY)
    url, stop = start(app)
    try:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2, "temperature": 0}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Bearer {KEY}x"},
                        {"Authorization": KEY}):
            for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"),
                                 ("POST", "/v1/chat/completions")):
                r = httpx.request(method, url + path, json=body, headers=headers)
                assert r.status_code == 401, (path, headers)
                assert r.json()["error"]["code"] == "invalid_api_key" and KEY not in r.text
        assert httpx.get(url + "/health").json() == {"status": "ok"}
        good = openai.OpenAI(base_url=url + "/v1", api_key=KEY, max_retries=0)
        assert good.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0).usage.completion_tokens
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0).models.list()
        metrics = httpx.get(url + "/metrics").text
        assert KEY not in metrics and "specengine_unauthorized_total" in metrics
        responses = httpx.get(url + "/openapi.json").json()["paths"]["/v1/completions"]["post"]["responses"]
        assert responses["401"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")
    finally:
        stop()


def test_the_openapi_schema_documents_what_the_server_does(server):
    """No 422 (bad requests are OpenAI's 400), the error model on 400/401/500/503, /metrics as
    Prometheus text, and the constraints the engine enforces (n is 1, temperature <= fp32 max)."""
    schema = httpx.get(server[0] + "/openapi.json").json()
    text = json.dumps(schema)
    assert '"422"' not in text and "HTTPValidationError" not in text
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        for status in ("400", "500", "503"):  # 401 only where a key is required (test above)
            assert responses[status]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")
        assert "401" not in responses and "text/event-stream" in responses["200"]["content"]
    assert "text/plain" in schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]
    props = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert props["n"]["maximum"] == 1 and props["n"]["minimum"] == 1
    assert props["temperature"]["maximum"] == pytest.approx(3.4028234663852886e38)
