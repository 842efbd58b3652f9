"""astro's load generator against a fake SSE server whose latencies are known exactly
(benchmarks/fake_sse_server.py, in a thread with its own event loop): the role-only
delta 80 ms after the request's body was read, then 5 text deltas 20 ms apart.

So the truth per request is: TTFT 80 ms under `--ttft-definition vllm` (the role-only
delta is vLLM's first chunk), 100 ms under astro's (the first text), ITL 20 ms, E2E
180 ms. The server logs when it read each body and wrote its first delta, so its own
lag is known too: what the client adds is its TTFT minus the server's
first-delta − arrival. Bounds are 5 ms: the ~10 ms offset `vllm bench serve` showed on
the sim fleet (BENCHMARKS.md, issue 17) would break them; the measured excess here is
~0.5–2 ms. Medians, so one descheduled moment on a loaded CI host cannot fail them.
"""

from __future__ import annotations

import asyncio
import statistics
import threading

import pytest

from conftest import load_script
from rps_astro_cli.bench.client import ClientOptions, run_requests
from rps_astro_cli.bench.workload_base import BenchRequest

TTFT_S, ITL_S, CHUNKS = 0.080, 0.020, 5
BOUND_S = 0.005  # what the client may add (median); a 10 ms offset fails it

fss = load_script("benchmarks/fake_sse_server.py", "fake_sse_server")


@pytest.fixture
def server():
    """(base URL, FakeSSE) of a server on its own thread and loop; stopped after the test."""
    fake = fss.FakeSSE(TTFT_S, ITL_S, CHUNKS)
    ready = threading.Event()
    box: dict = {}

    def run() -> None:
        loop = asyncio.new_event_loop()
        box["loop"] = loop

        async def start() -> None:
            srv = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
            box["srv"] = srv
            box["port"] = srv.sockets[0].getsockname()[1]
            ready.set()

        loop.run_until_complete(start())
        loop.run_forever()
        box["srv"].close()
        loop.run_until_complete(box["srv"].wait_closed())
        loop.close()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    assert ready.wait(10), "fake server did not start"
    yield f"http://127.0.0.1:{box['port']}", fake
    box["loop"].call_soon_threadsafe(box["loop"].stop)
    t.join(10)


def _reqs(n: int) -> list[BenchRequest]:
    return [BenchRequest(request_id=f"r{i}", prompt="hello " * 16, prompt_tokens=16, output_tokens=CHUNKS)
            for i in range(n)]


def _run(url: str, n: int, send_at: list[float], definition: str, conc: int | None = None):
    opts = ClientOptions(base_url=url, model="fake", send_true_lengths=False, ttft_definition=definition,
                         timeout_s=10.0)

    async def go():
        return await asyncio.wait_for(run_requests(_reqs(n), send_at, opts, conc), 30)

    return asyncio.run(go())


def _server_ttft_s(fake) -> float:
    """The server's own median first-delta − arrival (80 ms plus its loop lag)."""
    return statistics.median(r["first_s"] - r["arrival_s"] for r in fake.records)


def _attempts(check, n: int = 3) -> None:
    """Pass when `check()` (returning a list of failed conditions) passes in one of `n`
    attempts: a systematic offset fails every attempt, one descheduled moment of a loaded
    host (2 cores, many processes) only one."""
    failed: list[str] = []
    for _ in range(n):
        failed = check()
        if not failed:
            return
    pytest.fail("; ".join(failed))


@pytest.mark.parametrize("definition, ttft_s", [("vllm", TTFT_S), ("astro", TTFT_S + ITL_S)])
def test_paced_requests_measure_the_servers_known_latencies(server, definition, ttft_s) -> None:
    url, fake = server

    def check() -> list[str]:
        fake.records.clear()
        recs = _run(url, 8, [i * 0.12 for i in range(8)], definition)  # ~1.5 in flight
        assert all(r.success for r in recs), [r.error for r in recs]
        ttft = [r.ttft_s for r in recs]
        # never below the truth (the server waits 80 ms after it has the whole request)
        assert min(ttft) >= ttft_s - 0.001, ttft
        itl = [g for r in recs for g in r.itl_s]
        assert len(itl) == 8 * (CHUNKS if definition == "vllm" else CHUNKS - 1)  # vLLM counts the role delta's gap
        # the client adds under 5 ms over the server's own (lag-included) figure
        excess = statistics.median(ttft) - _server_ttft_s(fake) - (ITL_S if definition == "astro" else 0.0)
        e2e = statistics.median(r.e2e_s for r in recs)  # 180 ms, both definitions (the last text delta)
        return [m for ok, m in [(excess < BOUND_S, f"TTFT excess {excess * 1e3:.2f} ms"),
                                (abs(statistics.median(itl) - ITL_S) < 0.003, f"ITL {statistics.median(itl)}"),
                                (abs(e2e - TTFT_S - CHUNKS * ITL_S) < BOUND_S, f"E2E {e2e}")] if not ok]

    _attempts(check)


def test_a_concurrent_burst_starts_every_clock_before_its_connection(server) -> None:
    """`--max-concurrency 8`, all 16 due at 0: the first 8 go out at once on 8 new
    connections, the rest as slots free up (on kept-alive ones). Each clock starts when
    its request is released (`sent_s`, before connection set-up, as vLLM's `st` precedes
    aiohttp's connect), so all 8 of the first wave start together and their connection
    set-up counts in TTFT; the second wave, on kept-alive connections, adds under 5 ms."""
    url, fake = server

    def check() -> list[str]:
        fake.records.clear()
        recs = _run(url, 16, [0.0] * 16, "vllm", conc=8)
        assert all(r.success for r in recs), [r.error for r in recs]
        by_sent = sorted(recs, key=lambda r: r.sent_s)
        first, rest = by_sent[:8], by_sent[8:]
        assert min(r.ttft_s for r in recs) >= TTFT_S - 0.001
        # the second wave is released as the first wave's replies end (~180 ms), not before
        assert min(r.sent_s for r in rest) - min(r.sent_s for r in first) >= TTFT_S + CHUNKS * ITL_S - 0.001
        srv_rest = statistics.median(sorted(fake.records, key=lambda x: x["arrival_s"])[8:][i]["first_s"]
                                     - sorted(fake.records, key=lambda x: x["arrival_s"])[8:][i]["arrival_s"]
                                     for i in range(8))
        excess = statistics.median(r.ttft_s for r in rest) - srv_rest
        spread = max(r.sent_s for r in first) - min(r.sent_s for r in first)
        return [m for ok, m in [(spread < BOUND_S, f"first wave released over {spread * 1e3:.1f} ms"),
                                (excess < BOUND_S, f"second-wave TTFT excess {excess * 1e3:.2f} ms")] if not ok]

    _attempts(check)
