"""GET /metrics: Prometheus text that prometheus_client parses, with request, token, queue, cache and latency
series that move with the traffic.
"""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from server_harness import http_json, scrape, wait_idle

MODEL = {"model_name": "qwen-jax-test"}

# What vLLM's published Grafana dashboard (examples/observability/prometheus_grafana/grafana.json) queries, each
# filtered by model_name: a histogram's _bucket, _sum and _count, a counter's _total, a gauge by its name.
DASHBOARD_HISTOGRAMS = ("vllm:e2e_request_latency_seconds", "vllm:inter_token_latency_seconds",
                        "vllm:time_to_first_token_seconds", "vllm:request_prompt_tokens",
                        "vllm:request_generation_tokens", "vllm:request_queue_time_seconds",
                        "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds",
                        "vllm:request_max_num_generation_tokens")
DASHBOARD_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
DASHBOARD_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted({**MODEL, **labels}.items()))), 0.0)


def test_metrics_parse_and_follow_traffic(server):
    wait_idle(server)
    before = scrape(server.url)
    for _ in range(2):
        code, _, data = http_json("POST", server.url + "/v1/completions",
                                  {"prompt": "metrics please", "max_tokens": 5, "ignore_eos": True})
        assert code == 200
    wait_idle(server)
    after = scrape(server.url)

    def grew(name: str, **labels) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    prompt = data["usage"]["prompt_tokens"]
    assert all(dict(labels)["model_name"] == "qwen-jax-test" for _, labels in after), "a series without model_name"
    assert grew("qwen_jax_http_requests_total", endpoint="/v1/completions", status="200") == 2
    assert grew("vllm:request_generation_tokens_sum") == 10
    assert grew("vllm:request_generation_tokens_count") == 2
    assert grew("vllm:request_generation_tokens_bucket", le="5.0") == 2  # 5 tokens each
    assert grew("vllm:request_generation_tokens_bucket", le="2.0") == 0
    assert grew("vllm:request_max_num_generation_tokens_sum") == 10
    assert grew("vllm:request_prompt_tokens_sum") == 2 * prompt
    assert grew("vllm:request_prompt_tokens_count") == 2
    assert grew("vllm:request_queue_time_seconds_count") == 2
    e2e = grew("vllm:e2e_request_latency_seconds_sum")
    assert 0 <= grew("vllm:request_queue_time_seconds_sum") < e2e
    # a request's parts: queue, then prefill to the first token, then decode to the last
    parts = sum(grew(f"vllm:request_{part}_time_seconds_sum") for part in ("queue", "prefill", "decode"))
    assert abs(parts - e2e) < 0.05 * e2e + 0.01
    assert grew("vllm:request_inference_time_seconds_count") == 2
    assert grew("vllm:generation_tokens_total") >= 10
    assert grew("vllm:time_to_first_token_seconds_count") == 2
    assert grew("vllm:request_time_per_output_token_seconds_count") == 2
    assert grew("vllm:inter_token_latency_seconds_count") == 2 * 4  # every token after each request's first
    assert grew("vllm:request_success_total", finished_reason="length") == 2
    assert ("vllm:num_preemptions_total", tuple(MODEL.items())) in after
    # this server's warm-up is the minimal one (CPU): programs it did not compile ahead are jitted, each use counted
    assert ("qwen_jax_program_fallbacks_total", tuple(MODEL.items())) in after
    # two requests of 5 tokens: at least 5 steps (they may share steps), each with some device wait inside it
    steps = grew("qwen_jax_engine_steps_total")
    seconds = grew("qwen_jax_engine_step_seconds_total")
    waited = grew("qwen_jax_engine_step_device_wait_seconds_total")
    assert 5 <= steps <= 12 and 0 < waited < seconds
    assert value(after, "vllm:num_requests_running") == 0 and value(after, "vllm:num_requests_waiting") == 0
    assert value(after, "qwen_jax_kv_blocks_total") > 0 and value(after, "qwen_jax_state_slots_total") > 0
    assert 0 <= value(after, "vllm:kv_cache_usage_perc") <= 1
    assert 0 <= value(after, "qwen_jax_prefix_cache_hit_rate") <= 1
    for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "qwen_jax_state_cache_usage_perc", "qwen_jax_server_requests_in_flight"):
        assert (name, tuple(MODEL.items())) in after, name


def test_vllms_grafana_dashboard_finds_data(server):
    """Every series vLLM's published dashboard queries is here under its name, with model_name, and has data once
    requests have run; its finish-reason panel sums request_success_total by finished_reason."""
    code, _, _ = http_json("POST", server.url + "/v1/completions",
                           {"prompt": "a dashboard", "max_tokens": 3, "ignore_eos": True})
    assert code == 200
    wait_idle(server)
    samples = scrape(server.url)
    for name in DASHBOARD_HISTOGRAMS:
        assert value(samples, f"{name}_count") > 0 and value(samples, f"{name}_sum") >= 0, name
        buckets = [labels for sample, labels in samples if sample == f"{name}_bucket"]
        assert buckets and all(dict(labels).keys() == {"model_name", "le"} for labels in buckets), name
    for name in DASHBOARD_COUNTERS:
        assert value(samples, name) > 0, name
    for name in DASHBOARD_GAUGES:
        assert (name, tuple(MODEL.items())) in samples, name
    reasons = {dict(labels)["finished_reason"] for sample, labels in samples
               if sample == "vllm:request_success_total"}
    assert "length" in reasons


def test_every_metric_is_in_the_table_of_vllm_names(server):
    """server/README.md maps each metric to vLLM's name: a metric added without a row fails here."""
    from pathlib import Path

    table = (Path(__file__).resolve().parents[2] / "server" / "README.md").read_text()
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        # (prometheus_client adds a `_created` timestamp series beside each counter and histogram)
        families = {f.name for f in text_string_to_metric_families(resp.read().decode())
                    if not f.name.endswith("_created")}
    missing = [name for name in families if f"`{name}`" not in table and f"`{name}_total`" not in table]
    assert not missing, missing


def test_speculative_counters_follow_the_engine_stats():
    """The spec_decode_* series are the engine's counters, the accepted drafts also by their position in the row."""
    from server.metrics import ServerMetrics

    stats = {"spec_verified_rows_total": 10, "spec_drafted_tokens_total": 30, "spec_accepted_tokens_total": 17,
             "spec_accepted_tokens_per_position": [9, 6, 2]}
    text = ServerMetrics(lambda: stats, lambda: 0, "m", 64).render().decode()
    samples = {(s.name, s.labels.get("position")): s.value for family in text_string_to_metric_families(text)
               for s in family.samples if not s.name.endswith("_created")}
    assert samples[("vllm:spec_decode_num_drafts_total", None)] == 10
    assert samples[("vllm:spec_decode_num_draft_tokens_total", None)] == 30
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", None)] == 17
    per_position = [samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", str(j))] for j in range(3)]
    assert per_position == [9, 6, 2] and sum(per_position) == 17
