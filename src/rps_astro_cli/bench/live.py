"""Live target: an astro cluster (`cluster.json`) or any OpenAI-compatible server.

With `cluster.json` the bench also scrapes every engine's and predictor's `/metrics`
and the scheduler's `/metrics` + `/decisions` around each run. With `--policies` it
starts a fresh cluster per policy from the recipe recorded in `cluster.json` (same
instances, profile and engine settings; only `scheduler.policy` / `scheduler.k` change)
via `services.cluster.ClusterSupervisor`, and stops it after the policy's runs. With
`--instance-policies` it does the same per in-instance policy (`engine.instance_policy`
changes; of the recipe's `engine.instance_policy_params` the policy gets those it
declares), so every policy starts on fresh engines; each run records its
`instance_policy` and the policy each engine's `/status` reported at the start
(`extras["engine_instance_policies"]`).

Times are reported in **engine seconds**. A sim cluster with `time_scale` ≠ 1 (cluster.json;
e.g. `recipes/quick-sim.yaml`, 0.1) runs engine time at `time_scale` wall seconds per
engine second, so the bench sends on a schedule compressed by that factor (arrival i at
wall t_i × time_scale: `--request-rate` is in engine req/s) and divides every measured
time (send, first/last token, ITL gaps) by it: latencies and rates then describe the
profiled hardware (e.g. Llama-2-7B on A30), not the sped-up wall clock. Client and
HTTP overheads are divided too (inflated by 1 / time_scale). A plain `--base-url`
server has time_scale 1 (wall seconds).
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from rps_astro_cli.bench import scrape
from rps_astro_cli.bench.client import ClientOptions, discover_model, run_requests, server_root
from rps_astro_cli.bench.records import RequestRecord
from rps_astro_cli.bench.workload_base import BenchRequest, Workload
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.tokens import TokenCounter


def read_cluster_json(path: str | Path) -> dict[str, Any]:
    """Load and minimally check `cluster.json` (schema "astro.cluster/1").

    Raises:
        AstroUserError: missing file, invalid JSON, or no scheduler URL.
    """
    p = Path(path).expanduser()
    if not p.is_file():
        raise AstroUserError(f"no such file: {p}", field="--cluster",
                             fix="start `astro serve --instances N` first (it writes cluster.json)")
    try:
        d = json.loads(p.read_text())
    except json.JSONDecodeError as exc:
        raise AstroUserError(f"{p} is not valid JSON: {exc}", field="--cluster") from None
    url = (d.get("scheduler") or {}).get("url") if isinstance(d, dict) else None
    if not url:
        raise AstroUserError(f"{p} has no scheduler.url", field="--cluster",
                             fix="pass the cluster.json written by `astro serve`")
    return d


UNAUTHORIZED_FIX = "pass --api-key KEY or set ASTRO_API_KEY (the key the server was started with)"


def unauthorized_message(base_url: str, key_given: bool) -> str:
    """What a 401 from the target means for the user."""
    if key_given:
        return f"{base_url} answered HTTP 401: the API key given is not the server's"
    return f"{base_url} answered HTTP 401: the server requires an API key and none was given"


def run_loop(coro: Any) -> Any:
    """Run `coro` on uvloop when installed (a core dependency off Windows; less client CPU
    per streamed event, benchmarks/client_cpu_per_event.py), else on asyncio's loop."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - Windows
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def reply_length_source(send_true_lengths: bool, ignore_eos: bool, max_tokens_mode: str) -> str:
    """Where a sim engine's reply length comes from under these client settings, in words
    (the engine's rule: `engine.sim_engine`, `target_output_tokens`)."""
    if ignore_eos and max_tokens_mode != "none":
        what = "the dataset's reply length" if max_tokens_mode == "reference" else f"{max_tokens_mode} tokens"
        return f"max_tokens with ignore_eos: {what} (sim and real engines alike)"
    if send_true_lengths:
        return ("the dataset's reply length (vllm_xargs.astro_output_tokens): a sim engine stops there; "
                "a real engine ignores it and stops at EOS or max_tokens")
    return ("the server's own: a sim engine draws from its profile's length distribution, NOT the dataset's "
            "(send --ignore-eos --max-tokens reference, or keep --send-true-lengths, to reproduce the dataset)")


class LiveTarget:
    """Sends the workload over HTTP (see module docstring)."""

    def __init__(self, cfg, wl: Workload, counter: TokenCounter):
        self.cfg = cfg
        self.wl = wl
        self.counter = counter
        self.cluster: dict[str, Any] | None = None
        # the server root: `--base-url http://host:port/v1` (the openai client's form) works too
        self.base_url: str = server_root(cfg.target.base_url or "")
        self.model: str | None = cfg.target.model
        self._supervisor = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._slo_of: dict[str, Any] = {}  # request_id → its SLO class (`_run`)
        self.policy_desc: dict[str, Any] | None = None
        #: the in-instance policy the next runs use (`use_instance_policy`; None: the cluster's own)
        self.instance_policy: str | None = None

    # -- lifecycle -------------------------------------------------------------------------
    def open(self) -> None:
        if self.cfg.target.cluster:
            self._load_cluster(read_cluster_json(self.cfg.target.cluster))
        if self.cfg.slo.e2e_scale is not None and not ((self.cluster or {}).get("profile") or self.cfg.cluster.profile):
            raise AstroUserError("--slo-scale needs an execution profile for isolated E2E", field="--slo-scale",
                                 fix="pass --profile ID (the served model's profile) or use --cluster")
        self._check_reachable()
        if self.model is None:
            self.model = asyncio.run(discover_model(self.base_url, self.cfg.target.api_key))

    @property
    def side_headers(self) -> dict[str, str]:
        """Headers of the bench's side calls (metrics scrapes, engine `/status` polls,
        `/tag`, `/decisions`): the cluster's internal token (from cluster.json's
        `internal_token_file`, else $ASTRO_INTERNAL_TOKEN / _FILE) and the front-door key."""
        from rps_astro_cli.protocol.internal_auth import internal_token, token_headers

        token = None
        path = (self.cluster or {}).get("internal_token_file")
        if path:
            try:
                token = Path(path).read_text().strip() or None
            except OSError:
                token = None
        if token is None:
            try:
                token = internal_token()
            except AstroUserError:
                token = None
        out = token_headers(token)
        if self.cfg.target.api_key:
            out["authorization"] = f"Bearer {self.cfg.target.api_key}"
        return out

    def _load_cluster(self, d: dict[str, Any]) -> None:
        self.cluster = d
        self.base_url = server_root(d["scheduler"]["url"])
        self.policy_desc = d.get("policy")
        if self.cfg.target.model is None:
            self.model = d.get("model")

    def _check_reachable(self) -> None:
        """The target answers `GET /v1/models`; a 401 there (a keyed server, no or a wrong
        `--api-key`) stops the run before any request is sent, saying how to pass the key."""
        key = self.cfg.target.api_key
        headers = {"authorization": f"Bearer {key}"} if key else {}
        try:
            with httpx.Client(timeout=5.0) as c:
                r = c.get(self.base_url.rstrip("/") + "/v1/models", headers=headers)
        except httpx.HTTPError as exc:
            flag = "--cluster" if self.cfg.target.cluster else "--base-url"
            raise AstroUserError(f"cannot reach {self.base_url}: {type(exc).__name__}", field=flag,
                                 fix="is the server running?") from None
        if r.status_code == 401:
            raise AstroUserError(unauthorized_message(self.base_url, bool(key)), field="--api-key",
                                 fix=UNAUTHORIZED_FIX)

    def close(self) -> None:
        if self._supervisor is not None:
            self._supervisor.stop()
            self._supervisor = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"mode": "live", "base_url": self.base_url, "model": self.model,
                             "endpoint": self.cfg.target.endpoint,
                             "send_true_lengths": self.cfg.target.send_true_lengths,
                             "max_tokens": self.max_tokens_mode,
                             "ttft_definition": self.cfg.target.ttft_definition,
                             "reply_lengths": reply_length_source(self.cfg.target.send_true_lengths,
                                                                  self.cfg.target.ignore_eos, self.max_tokens_mode)}
        if self.cluster:
            d.update(cluster=str(self.cfg.target.cluster), policy=self.policy_desc, profile=self.cluster.get("profile"),
                     instances=len(self.cluster.get("instances") or []),
                     instance_policy=self.cluster.get("instance_policy"),
                     time_scale=self.time_scale)
            if self.cfg.cluster.instance_policies:
                d["instance_policies"] = list(self.cfg.cluster.instance_policies)
            insts = [i for i in self.cluster.get("instances") or [] if isinstance(i, dict)]
            own = {i.get("name"): i.get("profile") for i in insts}
            told = {i.get("name"): i.get("assumed_profile") for i in insts if i.get("assumed_profile")}
            if len(set(own.values())) > 1 or any(told.get(n, p) != p for n, p in own.items()):
                d["instance_profiles"] = own  # a heterogeneous fleet (cluster.json per instance)
                if any(told.get(n, p) != p for n, p in own.items()):
                    d["predictor_profiles"] = told
        d["time_unit"] = ("engine seconds (wall ÷ time_scale)" if self.time_scale != 1.0 else "seconds")
        return d

    def use_instance_policy(self, name: str | None) -> None:
        """The in-instance policy of the next runs (None: the cluster's own); it takes
        effect at the next `use_policy`, which restarts the cluster (call this first)."""
        self.instance_policy = name

    def use_policy(self, policy: str | None, k: str | None) -> None:
        """Restart the cluster with `policy` (and k) and/or the in-instance policy of
        `use_instance_policy`, when either is asked for."""
        ipol = self.instance_policy
        if policy is None and ipol is None:
            return
        if not self.cluster or not isinstance(self.cluster.get("recipe"), dict):
            flag = "--policies" if policy is not None else "--instance-policies"
            raise AstroUserError(f"live {flag} needs --cluster from `astro serve` (its recipe is reused)",
                                 field=flag, fix="use --cluster cluster.json, or --virtual")
        from rps_astro_cli.services.cluster import ClusterSupervisor
        from rps_astro_cli.services.config import parse_config

        if self._supervisor is not None:
            self._supervisor.stop()
            self._supervisor = None
        recipe = json.loads(json.dumps(self.cluster["recipe"]))
        if policy is not None:
            recipe.setdefault("scheduler", {})["policy"] = policy
            if k is not None:
                recipe["scheduler"]["k"] = k if k in ("all", "auto") else int(k)
            if self.cfg.cluster.policy_params:  # --param: to this policy when it declares the name
                from rps_astro_cli.dispatch import dispatch_params

                declared = {p.name for p in dispatch_params(policy)}
                params = recipe["scheduler"].setdefault("params", {})
                params.update({n: v for n, v in self.cfg.cluster.policy_params.items() if n in declared})
        if ipol is not None:
            from rps_astro_cli.policies import INSTANCE_POLICIES

            eng = recipe.setdefault("engine", {})
            # a recipe written for rps may set its classifier; fcfs declares no parameter
            own = {p.name for p in INSTANCE_POLICIES.get(ipol).params}
            eng["instance_policy"] = ipol
            eng["instance_policy_params"] = {n: v for n, v in (eng.get("instance_policy_params") or {}).items()
                                             if n in own}
        recipe.setdefault("scheduler", {})["port"] = 0
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="astro-bench-")
        run_dir = Path(self._tmp.name) / f"{ipol or 'i'}-{policy or 'p'}-{k or 'd'}"
        sup = ClusterSupervisor(parse_config(recipe, "cluster.json recipe"), run_dir)
        d = sup.start()
        self._supervisor = sup
        root = self.cluster
        self._load_cluster(d)
        self.cluster["recipe"] = root["recipe"]

    # -- runs ------------------------------------------------------------------------------
    def _client_opts(self) -> ClientOptions:
        return ClientOptions(base_url=self.base_url, model=self.model, endpoint=self.cfg.target.endpoint,
                             send_true_lengths=self.cfg.target.send_true_lengths, ignore_eos=self.cfg.target.ignore_eos,
                             timeout_s=self.cfg.target.timeout_s, api_key=self.cfg.target.api_key, counter=self.counter,
                             max_tokens_mode=self.max_tokens_mode, ttft_definition=self.cfg.target.ttft_definition,
                             slo_of=self._slo_of)

    @property
    def max_tokens_mode(self) -> str:
        """"auto" → "none" against an astro cluster (no oracle bound for its dispatcher),
        "reference" against a plain server (as `vllm bench serve`)."""
        if self.cfg.target.max_tokens != "auto":
            return self.cfg.target.max_tokens
        return "none" if self.cluster else "reference"

    @property
    def time_scale(self) -> float:
        """Wall seconds per engine second of the cluster's sim engines (1 without cluster.json)."""
        try:
            ts = float((self.cluster or {}).get("time_scale", 1.0) or 1.0)
        except (TypeError, ValueError):
            raise AstroUserError(f"time_scale {self.cluster.get('time_scale')!r} is not a number",
                                 field="--cluster", fix="pass the cluster.json written by `astro serve`") from None
        if ts <= 0:
            raise AstroUserError(f"time_scale must be > 0, got {ts}", field="--cluster")
        return ts

    def run(self, requests: list[BenchRequest], times: list[float],
            on_done: Callable[[RequestRecord], None]) -> tuple[list[RequestRecord], dict[str, Any]]:
        ts = self.time_scale
        if ts == 1.0:
            return run_loop(self._run(requests, times, on_done))
        # send times and multi-turn think times are engine seconds: wall = engine × time_scale
        scaled = [replace(r, think_s=r.think_s * ts) if r.think_s else r for r in requests]
        records, extras = run_loop(self._run(scaled, [t * ts for t in times], on_done))
        for r in records:
            to_engine_seconds(r, ts)
        extras["time_scale"] = ts
        return records, extras

    def _urls(self) -> tuple[list[str], list[str], str | None]:
        if not self.cluster:  # a plain server (e.g. vLLM) exports vllm:num_preemptions_total itself
            return [self.base_url], [], None
        inst = self.cluster.get("instances") or []
        engines = [i["engine_url"] for i in inst if i.get("engine_url")]
        preds = [i["predictor_url"] for i in inst if i.get("predictor_url")]
        sched = (self.cluster or {}).get("scheduler", {}).get("url")
        return engines, preds, sched

    async def _scrape_all(self, client: httpx.AsyncClient) -> dict[str, Any]:
        engines, preds, sched = self._urls()
        res = await asyncio.gather(*(scrape.scrape(client, u) for u in [*engines, *preds, sched]))
        return {"engines": res[:len(engines)], "predictors": res[len(engines):len(engines) + len(preds)],
                "scheduler": res[-1], "t": time.perf_counter()}

    async def _run(self, requests, times, on_done):
        from rps_astro_cli.bench.slo import assign_slo_classes, parse_slo_classes

        # per-request SLO classes (issue 33): drawn as the virtual target draws them
        self._slo_of = assign_slo_classes([r.request_id for r in requests],
                                          parse_slo_classes(self.cfg.workload.slo_classes), self.cfg.workload.seed)
        n_warm = self.cfg.arrivals.warmup_requests
        if n_warm:  # sent and awaited before the "before" scrape: in no metric, no engine-metric delta
            # independent requests (no session: a multi-turn workload's warm-up is not closed loop)
            warm = [replace(requests[i % len(requests)], request_id=f"warmup-{i}", session_id="", turn=0)
                    for i in range(n_warm)]
            await run_requests(warm, [0.0] * n_warm, self._client_opts(), self.cfg.arrivals.max_concurrency)
        async with httpx.AsyncClient(timeout=10.0, headers=self.side_headers) as c:
            before = await self._scrape_all(c)
            engine_policies = await self._engine_policies(c) if self.instance_policy is not None else None
        classes: dict[str, str] = {}
        stop = asyncio.Event()
        poller = asyncio.create_task(self._poll_classes(classes, stop))
        try:
            records = await run_requests(requests, times, self._client_opts(),
                                         self.cfg.arrivals.max_concurrency, on_done)
        finally:
            stop.set()
            await poller
        for r in records:
            if r.class_source != "engine" and r.server_request_id in classes:
                r.req_class, r.class_source = classes[r.server_request_id], "engine"
        async with httpx.AsyncClient(timeout=30.0, headers=self.side_headers) as c:
            after = await self._scrape_all(c)
            decisions = await scrape.fetch_decisions(c, self._urls()[2], len(requests))
            await self._tag(c, requests, records)
        extras = self._extras(before, after, decisions)
        if self.instance_policy is not None:
            extras["instance_policy"] = self.instance_policy
            extras["engine_instance_policies"] = engine_policies
        return records, extras

    async def _engine_policies(self, client: httpx.AsyncClient) -> list[str | None]:
        """The in-instance policy each engine's `/status` reports (None: no answer)."""
        async def one(url: str) -> str | None:
            try:
                r = await client.get(url.rstrip("/") + "/status")
                d = r.json() if r.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                return None
            pol = d.get("policy") if isinstance(d, dict) else None
            return pol.get("name") if isinstance(pol, dict) else None

        return list(await asyncio.gather(*(one(u) for u in self._urls()[0])))

    async def _poll_classes(self, classes: dict[str, str], stop: asyncio.Event, every_s: float = 0.25) -> None:
        """Engine-reported classes: poll each engine's `/status` while the run lasts and
        remember request id → `req_class` (set by class-aware instance policies). An
        engine without `/status` (e.g. plain vLLM) is dropped after its first failure."""
        engines = self._urls()[0]
        alive = list(engines)
        async with httpx.AsyncClient(timeout=2.0, headers=self.side_headers) as c:
            while alive and not stop.is_set():
                for u in list(alive):
                    try:
                        r = await c.get(u.rstrip("/") + "/status")
                        d = r.json() if r.status_code == 200 else None
                    except (httpx.HTTPError, ValueError):
                        d = None
                    if not isinstance(d, dict):
                        alive.remove(u)
                        continue
                    for q in (d.get("running") or []) + (d.get("waiting") or []):
                        if isinstance(q, dict) and q.get("req_class") in ("sand", "pebbles", "rocks"):
                            classes[str(q.get("request_id"))] = q["req_class"]
                try:
                    await asyncio.wait_for(stop.wait(), every_s)
                except TimeoutError:
                    pass

    async def _tag(self, client: httpx.AsyncClient, requests: list[BenchRequest], records: list[RequestRecord]) -> None:
        """Length-tagger error: ask the cluster's tagger (`POST /tag`, deterministic) for the
        length it predicted for each request's exact body, after the run (so it adds no load
        during it). Sets `predicted_output_tokens` where the response did not carry one."""
        url = ((self.cluster or {}).get("tagger") or {}).get("url")
        if not url:
            return
        from rps_astro_cli.bench.client import build_body

        sem = asyncio.Semaphore(8)
        opts = self._client_opts()

        async def one(req: BenchRequest, rec: RequestRecord) -> None:
            if rec.predicted_output_tokens is not None:
                return
            _, body = build_body(req, opts)
            async with sem:
                try:
                    r = await client.post(url.rstrip("/") + "/tag", json=body)
                    pred = r.json().get("predicted_output_tokens") if r.status_code == 200 else None
                except (httpx.HTTPError, ValueError):
                    return
            if isinstance(pred, int):
                if isinstance(body.get("max_tokens"), int):  # the scheduler clips by max_tokens
                    pred = min(pred, body["max_tokens"])
                rec.predicted_output_tokens = pred

        await asyncio.gather(*(one(q, r) for q, r in zip(requests, records)))

    def _extras(self, before: dict[str, Any], after: dict[str, Any], decisions: list[dict]) -> dict[str, Any]:
        wall = after["t"] - before["t"]
        pre = [scrape.delta(b, a, "vllm:num_preemptions_total") for b, a in zip(before["engines"], after["engines"])]
        out: dict[str, Any] = {
            "preemptions_total": int(sum(p for p in pre if p is not None)) if any(p is not None for p in pre) else None,
            "preemptions_per_instance": pre,
        }
        # prefix caching (vLLM's counters, tokens): the run's hit rate = hits / queries
        q = [scrape.delta(b, a, "vllm:prefix_cache_queries_total") for b, a in zip(before["engines"], after["engines"])]
        h = [scrape.delta(b, a, "vllm:prefix_cache_hits_total") for b, a in zip(before["engines"], after["engines"])]
        if any(x is not None for x in q):
            out["prefix_cache_queries_tokens"] = int(sum(x for x in q if x is not None))
            out["prefix_cache_hits_tokens"] = int(sum(x for x in h if x is not None))
        cpu, reqs, pct = [], [], []
        for b, a in zip(before["predictors"], after["predictors"]):
            dc = scrape.delta(b, a, "astro:predictor_cpu_seconds_total")
            dn = scrape.delta(b, a, "astro:predictor_requests_total")
            if dc is not None:
                cpu.append(dc)
                pct.append(100 * dc / wall if wall > 0 else None)
            if dn is not None:
                reqs.append(dn)
        out["predictor_cpu_s_total"] = sum(cpu) if cpu else None
        # is each sim engine's wall-clock loop keeping up with its step model? (absent on vLLM)
        steps = [scrape.delta(b, a, "astro:engine_steps_total") for b, a in zip(before["engines"], after["engines"])]
        late = [scrape.delta(b, a, "astro:engine_steps_late_total")
                for b, a in zip(before["engines"], after["engines"])]
        lag = [a.get("astro:engine_lag_seconds_max") for a in after["engines"] if a]
        out["engine_steps"] = sum(s for s in steps if s is not None) if any(s is not None for s in steps) else None
        out["engine_steps_late"] = sum(x for x in late if x is not None) if any(x is not None for x in late) else None
        lags = [x for x in lag if x is not None]
        out["engine_lag_s_max"] = max(lags) if lags else None  # largest since the engines started
        out["predictor_queries"] = int(sum(reqs)) if reqs else None
        out["predictor_cpu_ms_per_query"] = (1000 * sum(cpu) / sum(reqs)) if cpu and reqs and sum(reqs) else None
        vals = [p for p in pct if p is not None]
        out["predictor_cpu_percent_mean"] = sum(vals) / len(vals) if vals else None
        s_b, s_a = before["scheduler"], after["scheduler"]
        n = scrape.delta(s_b, s_a, "astro:scheduler_overhead_seconds_count")
        s = scrape.delta(s_b, s_a, "astro:scheduler_overhead_seconds_sum")
        out["scheduler_overhead_ms_mean"] = (1000 * s / n) if n and s is not None else None
        out["dispatch"] = scrape.decisions_summary(decisions, self.time_scale) if decisions else None
        out["note"] = ("scraped before/after the run: other traffic on the cluster meanwhile would be counted; "
                       "request latencies are engine seconds (wall ÷ time_scale), scraped overheads wall ms")
        return out

    def fill_isolated(self, records: list[RequestRecord]) -> None:
        from rps_astro_cli.bench.slo import isolated_for
        from rps_astro_cli.sim.profile import load_profile

        prof_id = (self.cluster or {}).get("profile") or self.cfg.cluster.profile
        if not prof_id:
            raise AstroUserError("--slo-scale needs an execution profile for isolated E2E", field="--slo-scale",
                                 fix="pass --profile ID (the served model's profile) or use --cluster")
        prof = load_profile(prof_id)
        # a heterogeneous fleet: each record on the profile of the engine that served it
        # (cluster.json's per-instance "profile", by the x-astro-instance name)
        own = {i.get("name"): i.get("profile") for i in (self.cluster or {}).get("instances") or []
               if isinstance(i, dict) and i.get("profile")}
        by: dict[str, list[RequestRecord]] = {}
        for r in records:
            by.setdefault(own.get(r.instance) or prof_id, []).append(r)
        for ref, recs in by.items():  # engine seconds, like the records (see `run`)
            isolated_for(recs, prof if ref == prof_id else load_profile(ref))


def to_engine_seconds(rec: RequestRecord, time_scale: float) -> None:
    """Divide every time of `rec` (wall seconds from the run's start) by `time_scale`
    (wall s per engine s) in place, giving engine seconds."""
    rec.scheduled_s /= time_scale
    rec.sent_s /= time_scale
    if rec.first_token_s is not None:
        rec.first_token_s /= time_scale
    if rec.finish_s is not None:
        rec.finish_s /= time_scale
    rec.itl_s = [g / time_scale for g in rec.itl_s]
