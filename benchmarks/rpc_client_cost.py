"""Client CPU per JSON POST for the hot-path RPC clients (why services/rpc.py is hand-written).

Starts a uvicorn JSON endpoint (`POST /echo`, answers `{"ok": true, "n": <body bytes>}`)
in a separate process, so the server's CPU is not counted, then times `--calls`
sequential keep-alive POSTs (after `--warmup` ones) on a uvloop event loop, as the
scheduler runs, with each client, in `--rounds` interleaved rounds:

- astro-rpc:     `rps_astro_cli.services.rpc.HostPool`, the package's lean asyncio-streams
                 client (the baseline).
- aiohttp-pool:  the same surface on aiohttp, as a drop-in `services/rpc.py` would need it
                 (session per host: no cookie jar, no auto headers, no decompression,
                 no connection limit; the `on_connection_reuseconn` trace that tells a
                 stale reused connection, safe to resend on, from a fresh one; every
                 transport error mapped to one error type). See `_AiohttpPool`.
- aiohttp:       a bare `aiohttp.ClientSession` with defaults (no astro layer).
- httpx:         `httpx.AsyncClient` with defaults.

Printed per client: median over rounds of client CPU µs per call (`time.process_time`
of this process), wall µs per call, and the ratio to astro-rpc's CPU.

    .venv/bin/python benchmarks/rpc_client_cost.py [--calls 3000] [--rounds 3] [--json]

Measured 2026-11-30 on the shared 2-core dev machine (load average 3-5), `--calls 2000
--rounds 3`, three runs, aiohttp 3.14.5, httpx 0.28.1: lean 29-37 µs CPU/call;
aiohttp-pool 84-105 µs (2.8-3.4x; ~25 µs of it the reuse trace); bare aiohttp 72-93 µs
(2.5-3.1x); httpx 402-456 µs (11-15x). Through the scheduler
(`benchmarks/dispatch_overhead.py --seconds 8`, power_of_k k=2, 200 req/s, with a full
aiohttp drop-in `services/rpc.py` that passed tests/test_services_rpc.py, load generator
on the lean client in both cases, two runs each, interleaved): lean overhead p50 2.45 ms,
p99 9.1-11.0 ms, scheduler CPU 0.72-0.77 ms/request, max sustained 1103-1109 req/s;
aiohttp p50 3.6-4.1 ms, p99 20-35 ms, 1.07-1.11 ms CPU/request, 664-1011 req/s. Hence the
lean client stays (the guide's "library over own code" threshold was ~25%).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

BODY = json.dumps({"prompt_tokens": 812, "predicted_output_tokens": 201, "objective": "e2e"}).encode()


def _serve(ready_file: str) -> None:
    from fastapi import FastAPI
    from fastapi.responses import Response

    from rps_astro_cli.services.http_common import FastRoutes, run_app

    sys.stdout = open(os.devnull, "w")  # run_app prints "ready: URL"; keep --json output clean

    app = FastAPI()

    async def echo(request) -> Response:
        raw = await request.body()
        return Response(b'{"ok": true, "n": %d}' % len(raw), media_type="application/json")

    run_app(FastRoutes(app, {("POST", "/echo"): echo}), ready_file=ready_file)  # type: ignore[arg-type]


class _AiohttpPool:
    """The measured aiohttp candidate for `services/rpc.py` (POST path only): one session
    per host configured as the hot path needs it, the reuse trace for the stale-connection
    resend, and transport errors mapped to `ConnectionError`."""

    def __init__(self, base_url: str, connect_timeout_s: float = 2.0):
        import aiohttp

        async def on_reuse(session, ctx, params) -> None:
            ctx.trace_request_ctx["reused"] = True

        trace = aiohttp.TraceConfig()
        trace.on_connection_reuseconn.append(on_reuse)
        trace.freeze()
        self.aiohttp = aiohttp
        self.base_url = base_url
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, limit_per_host=0),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_timeout_s),
            cookie_jar=aiohttp.DummyCookieJar(), skip_auto_headers=("Accept", "Accept-Encoding", "User-Agent"),
            auto_decompress=False, trace_configs=[trace])
        self.urls: dict = {}

    async def post_json(self, path: str, body: bytes) -> tuple[int, bytes]:
        from yarl import URL

        aiohttp = self.aiohttp
        url = self.urls.get(path) or self.urls.setdefault(path, URL(self.base_url + path))
        for attempt in range(3):
            ctx = {"reused": False}
            try:
                resp = await self.session.request("POST", url, data=body, allow_redirects=False,
                                                  headers={"content-type": "application/json"},
                                                  trace_request_ctx=ctx)
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if ctx["reused"] and attempt < 2:
                    continue
                raise ConnectionError(repr(exc)) from None
            except aiohttp.ClientError as exc:
                raise ConnectionError(repr(exc)) from None
            try:
                return resp.status, await resp.read()
            except aiohttp.ClientError as exc:
                raise ConnectionError(repr(exc)) from None
            finally:
                resp.release()
        raise AssertionError("unreachable")

    async def close(self) -> None:
        await self.session.close()


async def _make_clients(url: str):
    """{name: (async post() -> (status, body), async close())}."""
    import httpx

    from rps_astro_cli.services import rpc

    try:
        import aiohttp
    except ImportError:  # not a dependency of the package
        aiohttp = None
        print("(aiohttp not installed: its rows are skipped; `.venv/bin/pip install aiohttp` to measure)")

    out = {}
    lp = rpc.HostPool(url)

    async def lean_close(p=lp):
        p.close()

    out["astro-rpc"] = (lambda p=lp: p.post_json("/echo", BODY), lean_close)
    hdrs = {"content-type": "application/json"}
    if aiohttp is not None:
        cand = _AiohttpPool(url)
        out["aiohttp-pool"] = (lambda p=cand: p.post_json("/echo", BODY), cand.close)
        sess = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0))

        async def aio_post(s=sess):
            async with s.post(url + "/echo", data=BODY, headers=hdrs) as r:
                return r.status, await r.read()

        out["aiohttp"] = (aio_post, sess.close)
    hc = httpx.AsyncClient(base_url=url)

    async def httpx_post(c=hc):
        r = await c.post("/echo", content=BODY, headers=hdrs)
        return r.status_code, r.content

    out["httpx"] = (httpx_post, hc.aclose)
    return out


async def _run(url: str, calls: int, warmup: int, rounds: int) -> dict[str, dict[str, float]]:
    clients = await _make_clients(url)
    cpu: dict[str, list[float]] = {k: [] for k in clients}
    wall: dict[str, list[float]] = {k: [] for k in clients}
    for name, (post, _) in clients.items():  # warm-up (and a correctness check)
        for _ in range(warmup):
            status, body = await post()
            assert status == 200 and json.loads(body) == {"ok": True, "n": len(BODY)}, (name, status, body)
    for _ in range(rounds):
        for name, (post, _) in clients.items():
            c0, w0 = time.process_time(), time.perf_counter()
            for _ in range(calls):
                await post()
            cpu[name].append((time.process_time() - c0) / calls * 1e6)
            wall[name].append((time.perf_counter() - w0) / calls * 1e6)
    for _, close in clients.values():
        await close()
    return {k: {"cpu_us": statistics.median(cpu[k]), "wall_us": statistics.median(wall[k]),
                "cpu_us_rounds": cpu[k]} for k in clients}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=3000, help="timed POSTs per client per round")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", nargs="?", const="-", default=None,
                    help="print the figures as one JSON object; with PATH: write them there and print the table")
    a = ap.parse_args()
    if a.calls < 1 or a.rounds < 1 or a.warmup < 1:
        print("error: --calls, --rounds and --warmup must be ≥ 1", file=sys.stderr)
        return 2
    ready = os.path.join(tempfile.mkdtemp(prefix="astro-rpc-bench-"), "ready")
    proc = mp.get_context("spawn").Process(target=_serve, args=(ready,), daemon=True)
    proc.start()
    try:
        t_end = time.monotonic() + 30
        while not os.path.exists(ready) or not open(ready).read().strip():
            if time.monotonic() > t_end or not proc.is_alive():
                print("error: the benchmark server did not start", file=sys.stderr)
                return 1
            time.sleep(0.05)
        url = open(ready).read().strip()
        import uvloop

        res = uvloop.run(_run(url, a.calls, a.warmup, a.rounds))
    finally:
        proc.terminate()
        proc.join(5)
    if a.json == "-":
        print(json.dumps({"calls": a.calls, "rounds": a.rounds, "clients": res}, indent=1))
        return 0
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"calls": a.calls, "rounds": a.rounds, "clients": res}, f, indent=1)
    base = res["astro-rpc"]["cpu_us"]
    print(f"client CPU per keep-alive JSON POST, {a.calls} calls x {a.rounds} rounds (median of rounds)")
    print(f"{'client':<13} {'cpu µs/call':>12} {'wall µs/call':>13} {'x astro cpu':>12}")
    for k, v in res.items():
        print(f"{k:<13} {v['cpu_us']:12.1f} {v['wall_us']:13.1f} {v['cpu_us'] / base:11.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
