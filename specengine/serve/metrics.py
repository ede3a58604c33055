"""Prometheus text-format metrics of the server (GET /metrics): our own counters, the names the
Kubernetes Gateway API Inference Extension's model-server protocol routes by (vLLM's spelling:
an endpoint picker configured for vLLM reads us unchanged), and the speculative counters."""
from __future__ import annotations

import time

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Histogram:
    """A Prometheus histogram (cumulative buckets, sum, count)."""

    def __init__(self, buckets=LATENCY_BUCKETS):
        self.buckets, self.counts, self.sum, self.count = buckets, [0] * len(buckets), 0.0, 0

    def observe(self, x: float) -> None:
        self.sum, self.count = self.sum + x, self.count + 1
        for i, b in enumerate(self.buckets):
            if x <= b:
                self.counts[i] += 1

    def lines(self, name: str) -> list[str]:
        out = [f"# TYPE {name} histogram"]
        out += [f'{name}_bucket{{le="{b}"}} {c}' for b, c in zip(self.buckets, self.counts)]
        return out + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {self.sum}", f"{name}_count {self.count}"]


def _label(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def engine_lines(aeng, model_name: str) -> list[str]:
    """An engine's part of the page: its requests, tokens and rounds, the gateway's gauges and the
    speculative figures. Computed where the engine runs (a replica's own, serve/ray_app.py)."""
    m, core = aeng.metrics, aeng.core
    gen = core.gen
    c = gen.counters if gen is not None else None
    acc = c.accepted / max(c.proposed, 1) if c is not None else 0.0
    tau = c.round_tokens / c.row_rounds if c is not None and c.row_rounds else 0.0
    running, waiting = len(core.running), len(core.waiting)
    model, method = _label(model_name), _label(core.method_name)
    lines = []
    for name, kind, value in (
            ("requests_total", "counter", m["requests"]), ("requests_finished_total", "counter", m["finished"]),
            ("requests_aborted_total", "counter", m["aborted"]), ("requests_failed_total", "counter", m["failed"]),
            ("generated_tokens_total", "counter", m["tokens"]), ("rounds_total", "counter", m["rounds"]),
            ("prompt_tokens_total", "counter", m["prompt_tokens"]),
            ("cached_prompt_tokens_total", "counter", m["cached_prompt_tokens"]),  # prompt tokens a row already held
            ("requests_running", "gauge", running), ("requests_waiting", "gauge", waiting),
            ("acceptance_rate", "gauge", acc)):
        lines += [f"# TYPE specengine_{name} {kind}", f"specengine_{name} {value}"]
    # the speculative figures per method (a serving core runs one method): what a router or a
    # dashboard compares across replicas
    lines += ["# TYPE specengine_method_acceptance_rate gauge",
              f'specengine_method_acceptance_rate{{method="{method}"}} {acc}',
              "# TYPE specengine_tokens_per_target_forward gauge",
              f'specengine_tokens_per_target_forward{{method="{method}"}} {tau}']
    # the Gateway API Inference Extension's model-server protocol (TotalQueuedRequests,
    # TotalRunningRequests, KVCacheUtilization, the LoRA info gauge: no adapters here)
    lines += ["# TYPE vllm:num_requests_waiting gauge", f'vllm:num_requests_waiting{{model_name="{model}"}} {waiting}',
              "# TYPE vllm:num_requests_running gauge", f'vllm:num_requests_running{{model_name="{model}"}} {running}',
              "# TYPE vllm:kv_cache_usage_perc gauge",
              f'vllm:kv_cache_usage_perc{{model_name="{model}"}} {core.kv_usage()}',
              "# TYPE vllm:lora_requests_info gauge",
              f'vllm:lora_requests_info{{max_lora="0",running_lora_adapters="",waiting_lora_adapters=""}} {time.time()}']
    return lines


def http_lines(counts: dict, hist: dict) -> list[str]:
    """The HTTP layer's part: refusals it answered itself and the latency histograms."""
    lines = []
    for name in ("bad_requests", "overloaded", "unauthorized"):
        lines += [f"# TYPE specengine_{name}_total counter", f"specengine_{name}_total {counts[name]}"]
    lines += hist["ttft"].lines("specengine_time_to_first_token_seconds")
    lines += hist["itl"].lines("specengine_inter_token_seconds")
    return lines + hist["latency"].lines("specengine_request_latency_seconds")


def with_replicas(pages: dict[str, list[str]]) -> list[str]:
    """Several engines' lines as one page: each family's TYPE line once, then every replica's
    samples of it with a `replica` label (what a scraper of the one ingress needs to tell them apart)."""
    families: dict[str, list[str]] = {}
    order: list[str] = []
    for replica, lines in pages.items():
        family = None
        for line in lines:
            if line.startswith("# TYPE "):
                family = line
                if family not in families:
                    families[family] = []
                    order.append(family)
                continue
            name, value = line.rsplit(" ", 1)
            tag = f'replica="{_label(replica)}"'
            name = name[:-1] + "," + tag + "}" if name.endswith("}") else name + "{" + tag + "}"
            families[family].append(f"{name} {value}")
    return [line for family in order for line in [family, *families[family]]]
