"""Global scheduler: the OpenAI-compatible front door (Astrolabe §3, ARCHITECTURE.md §2).

Per request to `/v1/chat/completions` or `/v1/completions`:
1. read the body (bounded: 413 over `max_body_bytes`) and start the tag RPC on the raw
   body at once; validate the body with the engine's own parser
   (`protocol/openai.py`) while the tagger works. Bad input → 4xx naming the field,
   and nothing reaches an engine; an unknown `model` → 404.
2. dispatch: the policy's `candidates` (power-of-k: k distinct healthy instances), then
   for prediction-guided policies one `POST /predict` per candidate to its Predictor, in
   parallel, with a deadline (`predict_deadline_s`, 50 ms): late or failed ones are
   skipped; the policy's `choose` picks (falling back to least outstanding requests when
   none answered).
   A policy that reads prefix-cache hits (cache_aware, power_of_k's cache pin) hashes
   the prompt's token ids as the engines cache them: on a vLLM fleet an engine's
   `POST /tokenize` answer (sent while the tagger works, deadline
   `tokenize_deadline_s`, then the fallback ids, counted), on a sim fleet the fallback
   tokenizer's ids with no RPC (`prefix_tokenizer` auto; `prompt_ids.py`).
3. forward the body to the chosen engine with `vllm_xargs.astro_predicted_output_tokens`
   set to the tagger's prediction (so the engine's `/status` shows it), and stream the
   response back unchanged (SSE events relayed whole), with header `x-astro-instance`
   (the instance's name, e.g. `engine-2`).

Clients: every call (tag, predict, forward, status polls, health checks, model
discovery) runs on `services/rpc.py`'s lean keep-alive HTTP/1.1 pools (one per
destination; httpx costs ~20x more CPU per call, see that module). A tag or predict
RPC that misses its deadline is skipped but not cancelled (it finishes in the
background, bounded by `clients.RPC_BOUND_S`), so no keep-alive connection is torn down. The bodies of every RPC are
`rps_astro_cli.protocol.service_wire`'s codec (`TagResult`, `PredictRequest` /
`PredictReply`) and `rps_astro_cli.types`' (`InstanceStatus`), the same the services at
the other end use.

Failures: a connection error or timeout marks the instance unhealthy at once (circuit
breaker open) and a background health check (`GET /health` every `health_interval_s`,
or `GET /status` for status-based policies) readmits it when it answers again. A request
whose instance fails before anything was sent to the client is retried once on another
instance; one that fails mid-stream ends with an SSE event
`data: {"error": {"message", "type": "engine_failure", "code": 502, ...}}` then
`data: [DONE]`. Every request ends in a response or an error the client sees.

Instances: a static list (`--engine/--predictor`), or with `SchedulerSettings.discovery`
(`--discover kubernetes`) the EndpointSlices of the engines' Service, watched
(`discovery/kubernetes.py`): pods are added not dispatchable, become dispatchable when
ready, take no new requests when not ready or terminating, and are dropped once their
outstanding requests end after removal. Dispatchable is separate from the circuit
breaker; the dispatch sees only dispatchable instances (docs/deploy-kubernetes.md).

Scheduler overhead (`astro:scheduler_overhead_seconds`) = time from the request's
arrival until the body is handed to the engine connection, plus time from the engine's
response headers (first chunk when streaming) until the response is handed to the
server: everything the scheduler adds except waiting on the engine.

Metrics (`GET /metrics`):
- `astro:scheduler_requests_total{endpoint,outcome}` ok | client_error | engine_error |
  midstream_error | no_instance | client_disconnected.
- `astro:dispatch_decisions_total{policy,reason}`, `astro:dispatch_decide_seconds{policy}`
  (decision time incl. predict RPCs), `astro:predict_rpcs_total{policy,outcome}`
  (ok | timeout | error | skipped; per request exactly k for power_of_k, N for k=all;
  "skipped" = not sent, the Predictor's breaker is open),
  `astro:tag_rpcs_total{outcome}`, `astro:tokenize_rpcs_total{outcome}`, `astro:scheduler_retries_total`,
  `astro:instance_healthy{instance}`, `astro:instance_outstanding_requests{instance}`,
  `astro:instance_dispatched_total{instance}`, `astro:breaker_trips_total{instance}`.
- `GET /decisions?n=100` (API key when set): the last decisions as JSON
  (`DecisionRecord.to_dict()`: `DispatchDecision.to_dict()` plus request facts:
  prompt/predicted tokens, instance, retries, overhead, `tag_wait_us` (time waiting for
  the tagger after parsing), and the latencies the scheduler saw: `observed_ttft_s` = forward → first response chunk,
  `observed_e2e_s` = forward → end), for predictor-error analysis.

The package, one job per module: `settings` (SchedulerSettings, InstanceEndpoint),
`instances` (per-instance state, circuit breakers, dispatchable), `health` (health checks, status
polls, model discovery), `clients` (connection pools), `tagging` (tag client),
`predictions` (predict client and Predictor breakers), `prompt_ids` (a prompt's token
ids for prefix hashes: engine `/tokenize` or the fallback tokenizer), `dispatcher` (the one call into
`dispatch/`), `front_door` (parse → tag → dispatch → forward, retry), `relay` (response
and SSE relay), `metrics` (Prometheus), `app` (the ASGI app and `run_scheduler`; the discovery events).
"""

from rps_astro_cli.services.scheduler.app import Scheduler, create_app, run_scheduler
from rps_astro_cli.services.scheduler.settings import InstanceEndpoint, SchedulerSettings

__all__ = ["InstanceEndpoint", "Scheduler", "SchedulerSettings", "create_app", "run_scheduler"]
