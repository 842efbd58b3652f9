"""The GIE endpoint picker's pick latency, as a gateway sees it (issue 16).

Starts a cluster with `ClusterSupervisor` (N fast sim engines + N Predictors + the tagger,
separate processes on loopback; its scheduler is not used), then one `astro serve epp`
process per arm over those instances, and drives each through real ext_proc streams
(the `epp` extra's generated stubs) the way Envoy does in FULL_DUPLEX_STREAMED mode:
request headers, the body (`end_of_stream`), and waits for the EPP's two answers (the
headers answer carrying `x-gateway-destination-endpoint`, then the body). Pick latency =
first message sent → the body answer received: everything the EPP adds before the
gateway can forward (gRPC, parse, tag RPC, the policy with its predict RPCs). Then the
response phase (headers, body end) is sent so the EPP releases the instance, and the
stream closed. Requests are sequential (one in flight), so this is latency, not
throughput.

Arms are interleaved in batches (`--batch` requests per arm per round, `--rounds`
rounds); the figures are medians over the rounds with their spread (min-max of the
round medians).

    .venv/bin/python benchmarks/epp_pick_latency.py [--rounds 3 --batch 100] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

from rps_astro_cli.services.cluster import ClusterSupervisor
from rps_astro_cli.services.config import parse_config

ARMS = {
    "power_of_k k=2 (e2e)": ["--policy", "power_of_k", "--k", "2", "--objective", "e2e"],
    "round_robin": ["--policy", "round_robin"],
}
FULL = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED


def _headers() -> pb.ProcessingRequest:
    hm = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in
                                     {":method": "POST", ":path": "/v1/completions",
                                      "content-type": "application/json"}.items()])
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hm), protocol_config=pb.ProtocolConfiguration(
        request_body_mode=FULL, response_body_mode=FULL))


def one(stub, body: bytes) -> float:
    """One request through the EPP; its pick latency (s)."""
    q: queue.Queue = queue.Queue()
    t0 = time.perf_counter()
    q.put(_headers())
    q.put(pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)))
    it = stub.Process(iter(q.get, None), timeout=30)
    first = next(it)
    assert first.WhichOneof("response") == "request_headers", first
    second = next(it)
    dt = time.perf_counter() - t0
    assert second.WhichOneof("response") == "request_body", second
    q.put(pb.ProcessingRequest(response_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")]))))
    q.put(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"{}", end_of_stream=True)))
    q.put(None)
    list(it)
    return dt


def start_epp(info: dict, args: list[str], token: str | None, d: str, i: int) -> tuple[subprocess.Popen, str]:
    ready = Path(d) / f"epp-{i}.ready"
    cmd = [sys.executable, "-m", "rps_astro_cli.cli.main", "serve", "epp", "--port", "0", "--ready-file", str(ready),
           "--tagger", info["tagger"]["url"], *args]
    for inst in info["instances"]:
        cmd += ["--engine", inst["engine_url"], "--predictor", inst["predictor_url"]]
    env = dict(os.environ, **({"ASTRO_INTERNAL_TOKEN": token} if token else {}))
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=open(Path(d) / f"epp-{i}.log", "w"))
    deadline = time.monotonic() + 120
    while not (ready.exists() and ready.read_text().strip()):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"astro serve epp did not start: {(Path(d) / f'epp-{i}.log').read_text()[-2000:]}")
        time.sleep(0.1)
    return proc, ready.read_text().strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=100)
    ap.add_argument("--time-scale", type=float, default=0.01)
    ap.add_argument("--json", nargs="?", const="-", default=None,
                    help="print the figures as one JSON object; with PATH: write them there and print the table")
    a = ap.parse_args()
    cfg = parse_config({"name": "epp-pick", "instances": a.instances, "restart_crashed": 0,
                        "engine": {"time_scale": a.time_scale}, "tagger": {"length_model": "baseline"},
                        "scheduler": {"policy": "round_robin"},
                        "predictor": {"in_process": False}})  # the EPP and scheduler ask the sidecars
    body = json.dumps({"model": None, "prompt": "Summarize the plot of a short story about a lighthouse keeper.",
                       "max_tokens": 2})
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as d:
        sup = ClusterSupervisor(cfg, d, report=lambda s: print(s, file=sys.stderr))
        try:
            info = sup.start()
            raw = body.replace('"model": null', json.dumps({"model": info["model"]})[1:-1]).encode()
            stubs = {}
            for i, (name, args) in enumerate(ARMS.items()):
                proc, addr = start_epp(info, args, sup.internal_token, d, i)
                procs.append(proc)
                ch = grpc.insecure_channel(addr)
                stubs[name] = pb_grpc.ExternalProcessorStub(ch)
                for _ in range(20):  # warm: connections, memos
                    one(stubs[name], raw)
            per_round: dict[str, list[list[float]]] = {n: [] for n in ARMS}
            for _ in range(a.rounds):
                for name, stub in stubs.items():
                    per_round[name].append([one(stub, raw) * 1000 for _ in range(a.batch)])
        finally:
            for p in procs:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
            sup.stop()
    res = {"instances": a.instances, "rounds": a.rounds, "batch": a.batch, "load_avg_1m": os.getloadavg()[0],
           "arms": {}}
    for name, rounds in per_round.items():
        p50 = [float(np.percentile(r, 50)) for r in rounds]
        p99 = [float(np.percentile(r, 99)) for r in rounds]
        res["arms"][name] = {"p50_ms": float(np.median(p50)), "p50_spread_ms": [min(p50), max(p50)],
                             "p99_ms": float(np.median(p99)), "p99_spread_ms": [min(p99), max(p99)]}
    if a.json == "-":
        print(json.dumps(res))
        return
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    print(f"EPP pick latency, {a.instances} sim engines, {a.rounds} rounds x {a.batch} sequential requests per arm "
          f"(load average {res['load_avg_1m']:.1f})")
    for name, r in res["arms"].items():
        print(f"  {name:22s} p50 {r['p50_ms']:.2f} ms ({r['p50_spread_ms'][0]:.2f}-{r['p50_spread_ms'][1]:.2f})"
              f"   p99 {r['p99_ms']:.2f} ms ({r['p99_spread_ms'][0]:.2f}-{r['p99_spread_ms'][1]:.2f})")


if __name__ == "__main__":
    main()
