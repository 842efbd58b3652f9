"""The sim engine's Prometheus metrics (`GET /metrics`, one CollectorRegistry per app:
`engine.sim_server.create_app`): vLLM 0.32's metric names, labels `model_name` and
`engine` ("0").

- `_EngineCollector`: gauges and counters read from the engine at scrape time
  (`vllm:num_requests_running`, `vllm:num_requests_waiting`, `vllm:kv_cache_usage_perc`,
  the per-class queue gauges, `vllm:num_preemptions_total`, `vllm:prompt_tokens_total`,
  `vllm:generation_tokens_total`, `vllm:request_success_total{finished_reason}`,
  `vllm:prefix_cache_queries_total` / `vllm:prefix_cache_hits_total`, and astro's own
  `astro:engine_steps_total`, `astro:engine_steps_late_total`,
  `astro:engine_lag_seconds_max`).
- `_RequestHistograms`: vLLM's per-request histograms, with vLLM's buckets
  (`TTFT_BUCKETS_S`, `E2E_BUCKETS_S`, `ITL_BUCKETS_S`, `tokens_buckets`) and
  definitions, in engine (simulated) seconds.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from rps_astro_cli.engine.sim_engine import EngineRequest, SimEngine

# vLLM 0.32's default buckets (vllm/v1/metrics/buckets.py), so a vLLM dashboard's quantiles match
TTFT_BUCKETS_S = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                  2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
E2E_BUCKETS_S = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITL_BUCKETS_S = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0)
ENGINE_INDEX = "0"  # vLLM's `engine` label: the engine-core index (one per sim engine process)


def tokens_buckets(max_model_len: int) -> tuple[int, ...]:
    """vLLM's request-token buckets: the 1-2-5 series up to max_model_len."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_model_len:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class _RequestHistograms:
    """vLLM's per-request histograms, observed as tokens are delivered and requests end
    (engine seconds; vLLM's definitions, vllm/v1/metrics/stats.py): TTFT (first token −
    arrival), ITL (gap between a request's consecutive tokens), E2E (last token −
    arrival), queue time (first scheduled − joining the waiting queue: arrival, or the
    end of multimodal preprocessing), prefill time (first token − first scheduled),
    decode time (last − first token), inference time (last token − first scheduled),
    time per output token (decode time / (tokens − 1)), prompt and generation tokens,
    max_tokens; labels `model_name`, `engine`."""

    def __init__(self, registry: CollectorRegistry, model: str, max_model_len: int):
        lab = (model, ENGINE_INDEX)
        tok = tokens_buckets(max_model_len)

        def h(name: str, doc: str, buckets) -> Any:
            return Histogram(name, doc, ["model_name", "engine"], buckets=buckets, registry=registry).labels(*lab)

        self.ttft = h("vllm:time_to_first_token_seconds", "Time to first token (engine seconds).", TTFT_BUCKETS_S)
        self.itl = h("vllm:inter_token_latency_seconds", "Inter-token latency (engine seconds).", ITL_BUCKETS_S)
        self.tpot = h("vllm:request_time_per_output_token_seconds",
                      "Time per output token per request: decode time / (tokens - 1).", ITL_BUCKETS_S)
        self.e2e = h("vllm:e2e_request_latency_seconds", "End-to-end request latency (engine seconds).",
                     E2E_BUCKETS_S)
        self.queue = h("vllm:request_queue_time_seconds", "Time in the waiting queue before first scheduled.",
                       E2E_BUCKETS_S)
        self.prefill = h("vllm:request_prefill_time_seconds", "First scheduled to first token.", E2E_BUCKETS_S)
        self.decode = h("vllm:request_decode_time_seconds", "First token to last token.", E2E_BUCKETS_S)
        self.inference = h("vllm:request_inference_time_seconds", "First scheduled to last token.", E2E_BUCKETS_S)
        self.prompt = h("vllm:request_prompt_tokens", "Prompt tokens per request.", tok)
        self.generation = h("vllm:request_generation_tokens", "Generation tokens per request.", tok)
        self.max_tokens = h("vllm:request_params_max_tokens", "The max_tokens bound per request.", tok)

    def finished(self, er: EngineRequest, end_s: float) -> None:
        s = er.sim
        sched = s.first_scheduled_s if s.first_scheduled_s is not None else s.arrival_s
        first = s.first_token_s if s.first_token_s is not None else end_s
        queued = er.ready_s if er.ready_s is not None else s.arrival_s
        self.e2e.observe(end_s - s.arrival_s)
        self.queue.observe(max(0.0, sched - queued))
        self.prefill.observe(first - sched)
        self.decode.observe(end_s - first)
        self.inference.observe(end_s - sched)
        n = s.num_generated_tokens
        if n > 1:
            self.tpot.observe((end_s - first) / (n - 1))
        self.prompt.observe(s.prompt_tokens)
        self.generation.observe(n)
        self.max_tokens.observe(er.max_tokens)


class _EngineCollector:
    """Reads gauges and counters from the engine at scrape time, so /metrics always
    agrees with the engine's state."""

    def __init__(self, engine: SimEngine, model: str):
        self.engine = engine
        self.model = model

    def collect(self):
        e, lab, labels = self.engine, [self.model, ENGINE_INDEX], ["model_name", "engine"]
        for name, doc, val in (
            ("vllm:num_requests_running", "Requests in the running batch.", e.num_running),
            ("vllm:num_requests_waiting", "Requests in the waiting queue.", e.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage: used blocks / total (0-1).", e.kv_cache_usage),
        ):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(lab, val)
            yield g
        from rps_astro_cli.rps.queue_metrics import PROMETHEUS_GAUGES

        classes = e.class_metrics()
        for key, (name, doc) in PROMETHEUS_GAUGES.items():
            g = GaugeMetricFamily(name, doc, labels=[*labels, "class"])
            for cls, vals in classes.items():
                g.add_metric([*lab, cls], vals[key])
            yield g
        c = e.counters
        for name, doc, val in (
            ("vllm:num_preemptions", "Preemptions by recompute.", e.inst.num_preemptions_total),
            ("vllm:prompt_tokens", "Prompt tokens of admitted requests.", c.prompt_tokens_total),
            ("vllm:generation_tokens", "Output tokens sampled.", c.generation_tokens_total),
            ("vllm:prefix_cache_queries", "Prefix cache queries, in prompt tokens looked up.",
             e.inst.prefix_cache_queries_tokens),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in prompt tokens served from the cache.",
             e.inst.prefix_cache_hits_tokens),
        ):
            m = CounterMetricFamily(name, doc, labels=labels)
            m.add_metric(lab, val)
            yield m
        m = CounterMetricFamily("vllm:request_success", "Requests ended, by vLLM's finished_reason.",
                                labels=[*labels, "finished_reason"])
        for reason, val in c.finished_by_reason.items():
            m.add_metric([*lab, reason], val)
        yield m
        # astro's own: is the wall-clock loop keeping up with the model's step times?
        for name, doc, val in (
            ("astro:engine_steps", "Engine steps run.", c.steps_total),
            ("astro:engine_steps_late", "Steps delivered > 5 ms (wall) after their scheduled end.",
             c.steps_late_total),
        ):
            m = CounterMetricFamily(name, doc, labels=labels)
            m.add_metric(lab, val)
            yield m
        g = GaugeMetricFamily("astro:engine_lag_seconds_max", "Largest wall-clock delivery delay "
                              "behind a step's scheduled end.", labels=labels)
        g.add_metric(lab, c.lag_wall_s_max)
        yield g
