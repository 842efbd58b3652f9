"""Soak: N minutes of mixed good and bad traffic through `astro serve --instances 4`;
do memory and file descriptors stay flat, is every request answered, is no work left?
(issue 11; not a CI test.)

    .venv/bin/python benchmarks/soak.py --minutes 10

Starts `astro serve --instances 4 --time-scale 0.1` (sim engines at 10x speed, default
recipe: power_of_k k=2, Predictors, tagger) as a subprocess, then sends, at `--rate`
requests/s (Poisson) with at most `--max-inflight` at once, a fixed mix:

- good: streamed chat, non-streamed chat, non-streamed completions (max_tokens 4-64);
- bad (must be 4xx): invalid JSON, missing messages, max_tokens 0, an unknown model,
  deeply nested JSON, a body over the 1 MiB limit, a wrong route;
- vanishing clients: a stream read for a few events and then closed, a non-stream
  request with a 0.2 s client timeout (the scheduler must abort both at the engine).

RSS (VmRSS) and open file descriptors of every child and of the supervisor are sampled
after a warm-up minute-fraction (`--warmup-s`), then every minute, and printed at the
end with the first → last change. At the end: outcomes by kind (a 5xx or a transport
error on a good request is a failure), and every engine's `/status` must show no running
or waiting request once the traffic stops (`--settle-s`). Exit code 0 when every request
got its expected class of answer and no work was left, 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx

KINDS = {  # kind → weight in the mix
    "stream": 30, "chat": 20, "completion": 15,
    "bad_json": 4, "no_messages": 4, "zero_tokens": 4, "unknown_model": 4, "deep_json": 3, "too_large": 2,
    "wrong_route": 2, "vanish_stream": 6, "vanish_nonstream": 6,
}
BAD = {"bad_json", "no_messages", "zero_tokens", "unknown_model", "deep_json", "too_large", "wrong_route"}


def proc_stats(pid: int) -> tuple[float, int] | None:
    """(RSS MiB, open fds) of `pid`, or None when it is gone."""
    try:
        rss_kb = next(int(line.split()[1]) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                      if line.startswith("VmRSS:"))
        return rss_kb / 1024, len(os.listdir(f"/proc/{pid}/fd"))
    except (OSError, StopIteration, ValueError):
        return None


def pids_of(info: dict, supervisor_pid: int) -> dict[str, int]:
    out = {"supervisor": supervisor_pid, "scheduler": info["scheduler"]["pid"]}
    if info.get("tagger"):
        out["tagger"] = info["tagger"]["pid"]
    for inst in info["instances"]:
        out[inst["name"]] = inst["engine_pid"]
        if inst.get("predictor_pid"):
            out[inst["name"].replace("engine", "predictor")] = inst["predictor_pid"]
    return out


async def one(c: httpx.AsyncClient, kind: str, model: str, rng: random.Random) -> str:
    """Send one request of `kind`; its outcome: ok | 4xx | aborted (vanishing client, as
    intended) | fail:<why> (a 5xx, transport error, or a bad request that was accepted)."""
    n = rng.randint(4, 64)
    chat = {"model": model, "messages": [{"role": "user", "content": "tell me " * rng.randint(1, 60)}],
            "max_tokens": n}
    path, body, raw = "/v1/chat/completions", chat, None
    if kind == "completion":
        path, body = "/v1/completions", {"model": model, "prompt": "x " * rng.randint(1, 200), "max_tokens": n}
    elif kind == "bad_json":
        raw = b'{"model": "' + model.encode() + b'", "messages": [}'
    elif kind == "no_messages":
        body = {"model": model, "max_tokens": 4}
    elif kind == "zero_tokens":
        body = {**chat, "max_tokens": 0}
    elif kind == "unknown_model":
        body = {**chat, "model": "no/such-model"}
    elif kind == "deep_json":
        raw = b'{"model": "m", "messages": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    elif kind == "too_large":
        raw = json.dumps({**chat, "messages": [{"role": "user", "content": "a" * (1 << 20)}]}).encode()
    elif kind == "wrong_route":
        path = "/v1/nothing-here"
    try:
        if kind in ("stream", "vanish_stream"):
            body = {**chat, "stream": True, "max_tokens": 200 if kind == "vanish_stream" else n,
                    "ignore_eos": kind == "vanish_stream"}
            async with c.stream("POST", path, json=body, timeout=60) as r:
                if r.status_code != 200:
                    return f"fail:{kind} HTTP {r.status_code}"
                events = 0
                async for line in r.aiter_lines():
                    if line.startswith("data: "):
                        events += 1
                        if kind == "vanish_stream" and events >= 3:
                            return "aborted"  # leaving the block closes the connection mid-stream
                        if line == "data: [DONE]":
                            return "ok"
                return f"fail:{kind} stream ended without [DONE]"
        if kind == "vanish_nonstream":
            try:
                await c.post(path, json={**chat, "max_tokens": 400, "ignore_eos": True}, timeout=0.2)
            except httpx.TimeoutException:
                return "aborted"
            return "ok"
        kw = {"content": raw, "headers": {"content-type": "application/json"}} if raw is not None else {"json": body}
        r = await c.post(path, timeout=60, **kw)
    except httpx.HTTPError as exc:
        return f"fail:{kind} transport {type(exc).__name__}"
    if kind in BAD:
        return "4xx" if 400 <= r.status_code < 500 else f"fail:{kind} HTTP {r.status_code}"
    return "ok" if r.status_code == 200 else f"fail:{kind} HTTP {r.status_code}"


async def traffic(sched: str, model: str, seconds: float, rate: float, max_inflight: int, seed: int,
                  on_minute) -> Counter:
    rng = random.Random(seed)
    kinds, weights = zip(*KINDS.items())
    outcomes: Counter = Counter()
    sent: Counter = Counter()
    sem = asyncio.Semaphore(max_inflight)
    tasks: set[asyncio.Task] = set()
    limits = httpx.Limits(max_connections=max_inflight + 8, max_keepalive_connections=max_inflight)
    async with httpx.AsyncClient(base_url=sched, limits=limits) as c:
        t_end = time.monotonic() + seconds
        next_minute = time.monotonic() + 60
        while time.monotonic() < t_end:
            await asyncio.sleep(rng.expovariate(rate))
            if time.monotonic() >= next_minute:
                on_minute()
                next_minute += 60
            kind = rng.choices(kinds, weights)[0]
            sent[kind] += 1
            await sem.acquire()

            async def run(kind: str = kind) -> None:
                try:
                    outcomes[await one(c, kind, model, rng)] += 1
                finally:
                    sem.release()

            t = asyncio.create_task(run())
            tasks.add(t)
            t.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.wait(tasks, timeout=90)
    outcomes["_sent"] = sum(sent.values())
    return outcomes


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--time-scale", type=float, default=0.1)
    ap.add_argument("--rate", type=float, default=20.0, help="requests/s (Poisson)")
    ap.add_argument("--max-inflight", type=int, default=64)
    ap.add_argument("--warmup-s", type=float, default=20.0)
    ap.add_argument("--settle-s", type=float, default=15.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the printed figures here")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="astro-soak-"))
    cj = tmp / "cluster.json"
    out = open(tmp / "serve.out", "w")
    proc = subprocess.Popen([sys.executable, "-m", "rps_astro_cli.cli.main", "serve", "--instances",
                             str(args.instances), "--time-scale", repr(args.time_scale), "--run-dir",
                             str(tmp / "run"), "--cluster-json", str(cj)],
                            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not cj.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                print((tmp / "serve.out").read_text(), file=sys.stderr)
                return 1
            time.sleep(0.2)
        time.sleep(0.5)
        info = json.loads(cj.read_text())
        sched, model = info["scheduler"]["url"], info["model"]
        token = Path(info["internal_token_file"]).read_text().strip()
        pids = pids_of(info, proc.pid)
        print(f"cluster up: {len(pids)} processes, scheduler {sched}, model {model}", flush=True)

        samples: list[tuple[float, dict[str, tuple[float, int] | None]]] = []
        t0 = time.monotonic()

        def sample() -> None:
            samples.append((time.monotonic() - t0, {n: proc_stats(p) for n, p in pids.items()}))
            s = samples[-1][1]
            tot = sum(v[0] for v in s.values() if v)
            print(f"  t={samples[-1][0]:6.0f} s: total RSS {tot:7.1f} MiB, fds "
                  f"{sum(v[1] for v in s.values() if v)}", flush=True)

        asyncio.run(traffic(sched, model, args.warmup_s, args.rate, args.max_inflight, args.seed + 1,
                            lambda: None))
        sample()
        outcomes = asyncio.run(traffic(sched, model, args.minutes * 60, args.rate, args.max_inflight, args.seed,
                                       sample))
        time.sleep(args.settle_s)
        sample()
        left = {}
        for inst in info["instances"]:
            st = httpx.get(inst["engine_url"] + "/status", headers={"x-astro-internal-token": token},
                           timeout=5).json()
            left[inst["name"]] = len(st["running"]) + len(st["waiting"])
        health = httpx.get(sched + "/health", timeout=5).json()
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        out.close()

    first, last = samples[0][1], samples[-1][1]
    procs: dict[str, dict | None] = {}
    print(f"\nsoak: {args.minutes:g} min at {args.rate:g} req/s, {args.instances} instances, "
          f"time scale {args.time_scale:g}")
    print(f"{'process':<14}{'RSS start MiB':>14}{'RSS end MiB':>13}{'Δ MiB':>8}{'fds start':>11}{'fds end':>9}")
    for name in pids:
        a, b = first.get(name), last.get(name)
        if a is None or b is None:
            print(f"{name:<14}{'gone':>14}")
            procs[name] = None
            continue
        print(f"{name:<14}{a[0]:>14.1f}{b[0]:>13.1f}{b[0] - a[0]:>+8.1f}{a[1]:>11}{b[1]:>9}")
        procs[name] = {"rss_start_mib": a[0], "rss_end_mib": b[0], "fds_start": a[1], "fds_end": b[1]}
    sent = outcomes.pop("_sent")
    fails = {k: v for k, v in outcomes.items() if k.startswith("fail")}
    answered = sum(outcomes.values())
    print(f"requests sent {sent}, answered {answered}: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    print(f"work left on engines after {args.settle_s:g} s: {left}; scheduler /health: {health['status']}")
    ok = not fails and answered == sent and not any(left.values()) and health["status"] == "ok"
    print("soak: OK" if ok else "soak: FAILED")
    if args.json:
        res = {"args": {k: v for k, v in vars(args).items() if k != "json"}, "processes": procs,
               "requests_sent": sent, "answered": answered, "outcomes": dict(outcomes), "work_left": left,
               "scheduler_health": health["status"], "ok": ok}
        args.json.write_text(json.dumps(res, indent=1) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
