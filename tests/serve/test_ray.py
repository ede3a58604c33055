"""Replicas on a real Ray cluster started here (a local head on this machine's CPUs, stopped at
the end): two engine replicas of the tiny pair behind Ray Serve's HTTP proxy and our ingress,
driven by the `openai` client. Outputs equal a standalone engine's; a chat's second turn reaches
the replica holding its prefix; a replica killed under load loses no request; the gateway
metrics come back per replica."""
import asyncio
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from specengine import Engine, EngineConfig

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow  # a Ray head and two replicas: about a minute
MODEL = "tiny"
PROMPTS = ["def add(a, b):\n", "x = [1", "for i in range(3", "import os", "class A:", "while x:", "y = (", "z = {"]
CONFIG = dict(max_seq_len=256, method="sd", gamma=3, dtype="float32", cpu_matmul="linear")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def cluster(tiny_dir):
    """(base url, standalone reference engine): the application with 2 replicas, prefix routing."""
    from specengine.serve.ray_app import ReplicaSpec, application

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    port = _free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        spec = ReplicaSpec(str(tiny_dir), str(tiny_dir), EngineConfig(**CONFIG, max_batch=4),
                           core={"max_batch": 4, "max_waiting": 64}, replicas=2, cpus=1, warmup=False)
        serve.run(application(spec, MODEL, default_max_tokens=16), name="specengine", route_prefix="/")
        ref = Engine.from_pretrained(str(tiny_dir), draft=str(tiny_dir), config=EngineConfig(**CONFIG))
        yield f"http://127.0.0.1:{port}", ref
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture
def client(cluster):
    return openai.OpenAI(base_url=cluster[0] + "/v1", api_key="none", max_retries=0, timeout=120)


def test_concurrent_requests_equal_a_standalone_engine(cluster, client):
    url, ref = cluster
    want = [ref.generate(p, max_new_tokens=12, ignore_eos=True).text for p in PROMPTS]

    def one(p):
        return client.completions.create(model=MODEL, prompt=p, max_tokens=12, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(one, PROMPTS))
    assert got == want
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert streamed == want[0]


def test_a_replicas_refusal_is_the_servers_400(client):
    with pytest.raises(openai.BadRequestError) as e:  # prompt + max_tokens past the KV cache: the replica refuses
        client.completions.create(model=MODEL, prompt="x" * 200, max_tokens=200, temperature=0)
    assert e.value.status_code == 400 and "max_tokens" in str(e.value.body)


def test_a_chats_second_turn_reaches_the_replica_holding_its_prefix(client):
    """Prefix reuse holds only on the replica that served turn 1: cached tokens on turn 2 show
    the router sent it there (with Ray's default, half the turns would land elsewhere)."""
    for i in range(4):
        history = [{"role": "user", "content": f"question {i}: " + PROMPTS[i] * 3}]
        first = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
        history += [{"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "and then?"}]
        second = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0)
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1, i


def test_gateway_metrics_per_replica(cluster, client):
    from prometheus_client.parser import text_string_to_metric_families

    client.completions.create(model=MODEL, prompt="x = 1", max_tokens=3, temperature=0)
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(cluster[0] + "/metrics").text)}
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"):
        assert len({s.labels["replica"] for s in families[name].samples}) == 2, name
    assert sum(s.value for s in families["specengine_requests"].samples if s.name == "specengine_requests_total") >= 1
    assert httpx.get(cluster[0] + "/health").json() == {"status": "ok"}


def test_a_replica_killed_under_load_loses_no_completed_request(cluster, client):
    url, ref = cluster
    prompts, NEW = PROMPTS * 2, 160
    want = {p: ref.generate(p, max_new_tokens=NEW, ignore_eos=True).text for p in PROMPTS}
    replicas = [a for a in ray.util.list_named_actors(all_namespaces=True) if "EngineReplica" in a["name"]]
    assert len(replicas) == 2

    def one(p):
        try:
            return client.completions.create(model=MODEL, prompt=p, max_tokens=NEW, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text
        except openai.APIStatusError as e:  # allowed: a clear error, never a hang or a wrong answer
            return e
    def busy_replica():  # a replica running requests now, by its /metrics series (a kill must land on work)
        from prometheus_client.parser import text_string_to_metric_families

        for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
            for sample in family.samples:
                if sample.name == "vllm:num_requests_running" and sample.value > 0:
                    return sample.labels["replica"]
        return None

    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(one, p) for p in prompts]
        deadline, busy = time.time() + 60, None
        while busy is None and time.time() < deadline:
            busy = busy_replica()
        victim = next(a for a in replicas if busy is not None and a["name"].endswith(busy))
        ray.kill(ray.get_actor(victim["name"], namespace=victim["namespace"]), no_restart=False)
        results = [f.result(timeout=300) for f in futures]
    done = [(p, r) for p, r in zip(prompts, results) if isinstance(r, str)]
    assert all(r == want[p] for p, r in done)  # every completed request is right
    assert len(done) == len(prompts)  # non-streamed requests on the dead replica ran again elsewhere
    reruns = [line for line in httpx.get(url + "/metrics").text.splitlines()
              if line.startswith("specengine_requests_rerun_total")]
    assert float(reruns[0].split()[-1]) >= 1  # the kill did land on running requests
    deadline = time.time() + 120  # Ray replaces the replica; the application serves on
    while time.time() < deadline:
        status = serve.status().applications["specengine"].deployments["EngineReplica"]
        if status.status == "HEALTHY" and status.replica_states.get("RUNNING", 0) == 2:
            break
        time.sleep(1)
    assert one(PROMPTS[1]) == want[PROMPTS[1]]


def test_without_ray_the_command_says_how_to_install_it(monkeypatch):
    import importlib
    import sys

    from specengine import SpecEngineError

    monkeypatch.setitem(sys.modules, "ray", None)
    monkeypatch.delitem(sys.modules, "specengine.serve.ray_app", raising=False)
    with pytest.raises(SpecEngineError, match=r"pip install 'specengine\[ray\]'"):
        importlib.import_module("specengine.serve.ray_app")
