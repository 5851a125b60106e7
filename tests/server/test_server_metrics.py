"""GET /metrics: Prometheus text that prometheus_client parses, with request, token, queue, cache and latency
series that move with the traffic.
"""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from server_harness import http_json, wait_idle


def scrape(server) -> dict:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        assert resp.headers["content-type"].startswith("text/plain")
        text = resp.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_parse_and_follow_traffic(server):
    wait_idle(server)
    before = scrape(server)
    for _ in range(2):
        code, _, data = http_json("POST", server.url + "/v1/completions",
                                  {"prompt": "metrics please", "max_tokens": 5, "ignore_eos": True})
        assert code == 200
    wait_idle(server)
    after = scrape(server)
    prompt = data["usage"]["prompt_tokens"]
    ok = dict(endpoint="/v1/completions", status="200")
    assert value(after, "qwen_jax_http_requests_total", **ok) - value(before, "qwen_jax_http_requests_total", **ok) \
        == 2
    assert value(after, "qwen_jax_request_generation_tokens_total") - \
        value(before, "qwen_jax_request_generation_tokens_total") == 10
    assert value(after, "qwen_jax_request_prompt_tokens_total") - \
        value(before, "qwen_jax_request_prompt_tokens_total") == 2 * prompt
    assert value(after, "qwen_jax_generation_tokens_total") - value(before, "qwen_jax_generation_tokens_total") >= 10
    assert value(after, "qwen_jax_time_to_first_token_seconds_count") - \
        value(before, "qwen_jax_time_to_first_token_seconds_count") == 2
    assert value(after, "qwen_jax_time_per_output_token_seconds_count") > 0
    assert value(after, "qwen_jax_request_success_total", finish_reason="length") >= 2
    # two requests of 5 tokens: at least 5 steps (they may share steps), each with some device wait inside it
    steps = value(after, "qwen_jax_engine_steps_total") - value(before, "qwen_jax_engine_steps_total")
    seconds = value(after, "qwen_jax_engine_step_seconds_total") - value(before, "qwen_jax_engine_step_seconds_total")
    waited = value(after, "qwen_jax_engine_step_device_wait_seconds_total") - \
        value(before, "qwen_jax_engine_step_device_wait_seconds_total")
    assert 5 <= steps <= 12 and 0 < waited < seconds
    assert value(after, "qwen_jax_num_requests_running") == 0 and value(after, "qwen_jax_num_requests_waiting") == 0
    assert value(after, "qwen_jax_kv_blocks_total") > 0 and value(after, "qwen_jax_state_slots_total") > 0
    assert 0 <= value(after, "qwen_jax_kv_cache_usage_perc") <= 1
    assert 0 <= value(after, "qwen_jax_prefix_cache_hit_rate") <= 1
    for name in ("qwen_jax_prefix_cache_queries_total", "qwen_jax_prefix_cache_hits_total",
                 "qwen_jax_state_cache_usage_perc", "qwen_jax_server_requests_in_flight",
                 "qwen_jax_e2e_request_latency_seconds_count"):
        assert (name, ()) in after, name
