"""Streaming client: SSE decoding, honest timing rules, and a live run against a small fake
OpenAI SSE server written here (no dependency on astro's own servers)."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import threading

import pytest

from rps_astro_cli.bench.client import SSEDecoder, StreamTimer, _finish, build_body
from rps_astro_cli.bench.records import RequestRecord
from rps_astro_cli.bench.workload_base import BenchRequest


def ev(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj, ensure_ascii=False).encode()) + b"\n\n"


def delta(text=None, role=None, finish=None):
    d = {}
    if role:
        d["role"] = role
    if text is not None:
        d["content"] = text
    return {"choices": [{"index": 0, "delta": d, "finish_reason": finish}]}


USAGE = {"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}}


def test_sse_decoder_keeps_multibyte_char_split_across_chunks():
    payload = ev(delta("héllo 🙂")) + ev(b"[DONE]")
    cut = payload.index("🙂".encode()) + 2  # in the middle of the 4-byte emoji
    d = SSEDecoder()
    first = d.feed(payload[:cut])
    rest = d.feed(payload[cut:])
    assert first == []
    assert json.loads(rest[0])["choices"][0]["delta"]["content"] == "héllo 🙂"
    assert rest[1] == b"[DONE]"


def test_sse_decoder_handles_crlf_comments_and_multiline_data():
    d = SSEDecoder()
    out = d.feed(b": keep-alive\r\n\r\ndata: {\"a\":\r\ndata: 1}\r\n\r\n")
    assert out == [b'{"a":\n1}']
    # the fast path (whole LF events, several per network chunk) gives what the line parser gives
    burst = b'data: {"x":1}\n\ndata: [DONE]\n\n'
    crlf = SSEDecoder()  # CRLF takes the line-by-line path
    assert SSEDecoder().feed(burst) == crlf.feed(burst.replace(b"\n", b"\r\n")) == [b'{"x":1}', b"[DONE]"]
    mixed = b'event: e\ndata: {"y":2}\n\n: ping\n\ndata:{"z":3}\n\n'
    assert SSEDecoder().feed(mixed) == SSEDecoder().feed(mixed.replace(b"\n", b"\r\n")) == [b'{"y":2}', b'{"z":3}']
    d = SSEDecoder()  # an event cut anywhere waits for its end
    cuts = [d.feed(burst[i:i + 5]) for i in range(0, len(burst), 5)]
    assert [e for c in cuts for e in c] == [b'{"x":1}', b"[DONE]"]


def _run(chunks: list[tuple[float, bytes]], sent_s: float = 0.0, chat: bool = True) -> RequestRecord:
    timer = StreamTimer(chat=chat)
    for t, data in chunks:
        timer.feed(data, t)
    end = chunks[-1][0] if chunks else sent_s
    timer.close(end)
    rec = RequestRecord("r", sent_s=sent_s)
    _finish(rec, timer, end, lambda s: len(s.split()))
    return rec


def test_role_only_first_chunk_and_usage_only_last_chunk_move_no_timing():
    # sent at 0; role-only delta at 0.1 s; content at 0.5, 0.7, 1.0; usage-only at 3.0; [DONE] at 3.1
    rec = _run([(0.1, ev(delta(role="assistant"))), (0.5, ev(delta("a"))), (0.7, ev(delta(" b"))),
                (1.0, ev(delta(" c", finish="stop"))), (3.0, ev(USAGE)), (3.1, ev(b"[DONE]"))])
    assert rec.success
    assert rec.ttft_s == pytest.approx(0.5)      # not 0.1 (role-only)
    assert rec.e2e_s == pytest.approx(1.0)       # not 3.0 / 3.1 (usage-only, DONE)
    assert rec.output_tokens == 3 and rec.output_tokens_source == "usage"
    assert rec.prompt_tokens == 7
    assert rec.itl_s == pytest.approx([0.2, 0.3])
    assert rec.tpot_s == pytest.approx((1.0 - 0.5) / 2)          # 0.25
    assert rec.normalized_s_per_token == pytest.approx(1.0 / 3)


def test_one_token_output_has_no_tpot_and_no_itl():
    rec = _run([(0.4, ev(delta("x", finish="length"))), (0.5, ev(b"[DONE]"))])
    assert rec.success and rec.output_tokens == 1 and rec.output_tokens_source == "counted"
    assert rec.ttft_s == pytest.approx(0.4) and rec.e2e_s == pytest.approx(0.4)
    assert rec.tpot_s is None and rec.itl_s == []
    assert rec.normalized_s_per_token == pytest.approx(0.4)


def test_zero_token_output_is_a_failure():
    """A complete stream with no output token is not an ok answer (issue 11)."""
    usage0 = {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 0}}
    rec = _run([(0.2, ev(delta(role="assistant"))), (0.3, ev(delta("", finish="stop"))), (0.6, ev(usage0)),
                (0.7, ev(b"[DONE]"))])
    assert not rec.success and rec.output_tokens == 0 and rec.error == "stream ended with zero output tokens"
    assert rec.ttft_s is None and rec.tpot_s is None and rec.normalized_s_per_token is None
    assert rec.e2e_s is None and rec.finish_s == pytest.approx(0.7)   # stream end when no content came


def test_error_event_and_early_end_fail():
    rec = _run([(0.2, ev(delta("a"))), (0.3, ev({"error": {"message": "engine died", "code": 502}})),
                (0.4, ev(b"[DONE]"))])
    assert not rec.success and "engine died" in rec.error and rec.ttft_s is None and rec.e2e_s is None
    rec = _run([(0.2, ev(delta("a")))])
    assert not rec.success and "ended early" in rec.error


def test_completions_text_chunks():
    rec = _run([(0.3, ev({"choices": [{"text": "hi", "finish_reason": None}]})),
                (0.5, ev({"choices": [{"text": " there", "finish_reason": "stop"}]})), (0.6, ev(b"[DONE]"))],
               chat=False)
    assert rec.ttft_s == pytest.approx(0.3) and rec.e2e_s == pytest.approx(0.5) and rec.output_tokens == 2


def test_body_carries_true_length_only_when_asked():
    from rps_astro_cli.bench.client import ClientOptions

    r = BenchRequest("q", "hello there", 2, 17)
    path, body = build_body(r, ClientOptions("http://x", model="m"))
    assert path == "/v1/chat/completions" and body["max_tokens"] == 17
    assert body["vllm_xargs"] == {"astro_output_tokens": 17}
    assert body["stream_options"] == {"include_usage": True}
    _, body = build_body(r, ClientOptions("http://x", send_true_lengths=False, endpoint="completions"))
    assert "vllm_xargs" not in body and body["prompt"] == "hello there"
    _, body = build_body(r, ClientOptions("http://x", max_tokens_mode="none"))
    assert "max_tokens" not in body
    _, body = build_body(r, ClientOptions("http://x", max_tokens_mode="64"))
    assert body["max_tokens"] == 64


# -- live run against a fake OpenAI SSE server ---------------------------------------------

FIRST_DELAY_S = 0.30   # server waits this long before the first content chunk
GAP_S = 0.05           # then this between content chunks
SEEN: list[str] = []   # the user text of every chat request the fake server received


def _fake_server():
    """A raw asyncio HTTP/1.1 server answering /v1/models and streaming chat completions:
    a role-only delta at once, then `max_tokens` one-word content chunks (the first after
    FIRST_DELAY_S, then every GAP_S), a usage-only chunk after 0.2 s, and [DONE]. A prompt
    containing "FAIL" gets HTTP 500."""
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    state: dict = {}

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.decode().split("\r\n")
            method, path, _ = lines[0].split(" ")
            headers = {k.lower(): v.strip() for k, v in (h.split(":", 1) for h in lines[1:] if ":" in h)}
            body = await reader.readexactly(int(headers.get("content-length", 0)))
            if path == "/v1/models":
                data = json.dumps({"data": [{"id": "fake-model"}]}).encode()
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(data)).encode() + b"\r\n\r\n" + data)
                await writer.drain()
                return
            req = json.loads(body)
            SEEN.append(str(req["messages"][0]["content"]))
            if "FAIL" in json.dumps(req["messages"]):
                data = b'{"error": {"message": "boom"}}'
                writer.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-type: application/json\r\n"
                             b"content-length: " + str(len(data)).encode() + b"\r\nconnection: close\r\n\r\n" + data)
                await writer.drain()
                return
            n = int(req["vllm_xargs"]["astro_output_tokens"])
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nx-astro-instance: fake-0\r\n"
                         b"connection: close\r\n\r\n")
            writer.write(ev(delta(role="assistant")))
            await writer.drain()
            await asyncio.sleep(FIRST_DELAY_S)
            for i in range(n):
                if i:
                    await asyncio.sleep(GAP_S)
                writer.write(ev(delta("w ", finish="stop" if i == n - 1 else None)))
                await writer.drain()
            await asyncio.sleep(0.2)
            writer.write(ev({"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": n}}))
            writer.write(ev(b"[DONE]"))
            await writer.drain()
        finally:
            writer.close()

    def main():
        asyncio.set_event_loop(loop)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        state["port"] = sock.getsockname()[1]
        server = loop.run_until_complete(asyncio.start_server(handle, sock=sock))
        state["server"] = server
        ready.set()
        loop.run_forever()
        server.close()
        loop.run_until_complete(server.wait_closed())

    th = threading.Thread(target=main, daemon=True)
    th.start()
    ready.wait(5)
    return loop, th, state["port"]


@pytest.fixture(scope="module")
def fake_url():
    loop, th, port = _fake_server()
    yield f"http://127.0.0.1:{port}"
    loop.call_soon_threadsafe(loop.stop)
    th.join(5)


def test_live_run_against_fake_server(fake_url, tmp_path):
    import math

    from rps_astro_cli.bench import workload_base, workloads
    from rps_astro_cli.bench.config import BenchConfig
    from rps_astro_cli.bench.runner import run_bench

    reqs = [BenchRequest("a", "hello", 1, 4), BenchRequest("b", "one two", 2, 1), BenchRequest("c", "FAIL now", 2, 3)]

    def fake_loader(opts, rng):
        return workload_base.Workload("fake", reqs, "test")

    workloads.WORKLOADS._items["fake-test"] = fake_loader
    try:
        res = run_bench(BenchConfig.flat(workload="fake-test", base_url=fake_url, request_rate=math.inf,
                                    slo=["ttft:5"], out_dir=str(tmp_path / "rep")))
    finally:
        del workloads.WORKLOADS._items["fake-test"]
    run = res.runs[0]
    by = {r.request_id: r for r in run.records}
    a, b, c = by["a"], by["b"], by["c"]
    assert a.success and a.instance == "fake-0" and a.output_tokens == 4 and a.prompt_tokens == 9
    # TTFT at the first content chunk (not the role-only one, sent at once), then 3 more gaps;
    # only lower bounds: the server sleeps at least this long, a loaded machine only adds (the
    # exact chunk semantics are test_role_only_first_chunk_and_usage_only_last_chunk_move_no_timing)
    assert a.ttft_s >= FIRST_DELAY_S - 0.005
    assert a.e2e_s - a.ttft_s >= 3 * GAP_S - 0.005
    assert len(a.itl_s) == 3
    assert b.success and b.output_tokens == 1 and b.tpot_s is None
    assert not c.success and c.error.startswith("HTTP 500") and "boom" in c.error
    o = run.metrics["overall"]
    assert (o.num_requests, o.num_completed, o.num_failed) == (3, 2, 1)
    assert o.slo.good == 2 and o.slo.violation_rate == pytest.approx(1 / 3)
    assert o.ttft_s.count == 2
    assert res.exit_code == 3  # one of three failed: partly failed (issue 11), not 0
    assert any(r.startswith("1 of 3 requests failed") and "HTTP 500" in r for r in res.exit_reasons)
    for f in ("report.json", "requests.jsonl", "report.md", "report.html"):
        assert (tmp_path / "rep" / f).is_file()
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    assert rep["schema"] == "astro.bench/1" and rep["config"]["seed"] == 0
    assert len((tmp_path / "rep" / "requests.jsonl").read_text().splitlines()) == 3


def test_all_failed_exits_nonzero(fake_url):
    from rps_astro_cli.bench import workload_base, workloads
    from rps_astro_cli.bench.config import BenchConfig
    from rps_astro_cli.bench.runner import run_bench

    reqs = [BenchRequest("x", "FAIL", 1, 2), BenchRequest("y", "FAIL too", 2, 2)]
    workloads.WORKLOADS._items["fake-fail"] = lambda opts, rng: workload_base.Workload("fake", reqs, "test")
    try:
        res = run_bench(BenchConfig.flat(workload="fake-fail", base_url=fake_url))
    finally:
        del workloads.WORKLOADS._items["fake-fail"]
    o = res.runs[0].metrics["overall"]
    assert o.num_completed == 0 and o.num_failed == 2
    assert o.ttft_s.mean is None and o.throughput_rps == 0.0
    assert res.exit_code == 1 and "every request failed" in res.exit_reasons[0]


def test_max_concurrency_delays_sending_not_timing(fake_url):
    from rps_astro_cli.bench.client import ClientOptions, run_requests

    reqs = [BenchRequest("a", "x", 1, 2), BenchRequest("b", "y", 1, 2)]
    recs = asyncio.run(run_requests(reqs, [0.0, 0.0], ClientOptions(fake_url), max_concurrency=1))
    a, b = sorted(recs, key=lambda r: r.sent_s)
    assert a.scheduled_s == b.scheduled_s == 0.0
    assert b.sent_s >= a.finish_s              # b waited for a's slot ...
    # ... and its TTFT starts when it was sent, not when it was scheduled
    assert b.ttft_s == pytest.approx(b.first_token_s - b.sent_s) and b.ttft_s >= FIRST_DELAY_S - 0.005


def test_time_scaled_cluster_reports_engine_seconds(fake_url, tmp_path):
    """cluster.json with time_scale 0.1: the fake server's 0.30 s wall TTFT is 3.0 engine s,
    its 0.05 s wall chunk gaps 0.5 engine s; the table title and report.md say so."""
    from typer.testing import CliRunner

    from rps_astro_cli.bench import workload_base, workloads
    from rps_astro_cli.cli.main import app

    cl = tmp_path / "cluster.json"
    cl.write_text(json.dumps({"schema": "astro.cluster/1", "scheduler": {"url": fake_url}, "instances": [],
                              "model": "fake-model", "time_scale": 0.1}))
    reqs = [BenchRequest("a", "hello", 1, 3)]
    workloads.WORKLOADS._items["fake-ts"] = lambda opts, rng: workload_base.Workload("fake", reqs, "test")
    try:
        res = CliRunner().invoke(app, ["bench", "-w", "fake-ts", "--cluster", str(cl), "-n", "1",
                                       "--out", str(tmp_path / "rep")])
    finally:
        del workloads.WORKLOADS._items["fake-ts"]
    assert res.exit_code == 0, res.output
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    m = rep["runs"][0]["metrics"]["overall"]
    # wall ÷ time scale; lower bounds only (a loaded machine only adds wall time)
    assert m["ttft_s"]["mean"] >= FIRST_DELAY_S / 0.1 - 0.05  # not the 0.3 s wall value
    assert m["itl_s"]["mean"] >= GAP_S / 0.1 - 0.05
    assert rep["target"]["time_scale"] == 0.1
    assert "ENGINE seconds" in res.output and "time_scale 0.1" in res.output
    assert "ENGINE seconds" in (tmp_path / "rep" / "report.md").read_text()


def test_failures_name_their_reasons_without_plot_warnings(fake_url, tmp_path):
    """Every request fails (HTTP 500 "boom"): the summary, the exit reason and report.md
    give "2 × HTTP 500: boom"; the progress line reads "done 2/2 · ok 0 · failed 2"; no
    matplotlib legend warning leaks (no curve to label)."""
    import warnings

    from typer.testing import CliRunner

    from rps_astro_cli.bench import workload_base, workloads
    from rps_astro_cli.cli.main import app

    reqs = [BenchRequest("x", "FAIL", 1, 2), BenchRequest("y", "FAIL too", 2, 2)]
    workloads.WORKLOADS._items["fake-fail2"] = lambda opts, rng: workload_base.Workload("fake", reqs, "test")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = CliRunner().invoke(app, ["bench", "-w", "fake-fail2", "--base-url", fake_url,
                                           "--out", str(tmp_path / "rep")])
    finally:
        del workloads.WORKLOADS._items["fake-fail2"]
    assert res.exit_code == 1
    assert "fail: every request failed in run server @ all at t=0 (rate inf): 2 × HTTP 500: boom" in res.output
    assert "failed 2: 2 × HTTP 500: boom" in res.output
    assert "done 2/2 · ok 0 · failed 2" in res.output
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "2 × HTTP 500: boom" in md and "## Failed requests" in md
    assert not [w for w in caught if "No artists with labels" in str(w.message)]


def test_multi_turn_sends_each_turn_after_the_previous_reply(fake_url):
    # two sessions; s1's turn 1 waits for turn 0's reply plus its 0.1 s think time; a
    # turn whose previous turn failed is not sent. First turns take the send times in
    # order (0 and 0.05 s; the rest of the list is unused).
    from rps_astro_cli.bench.client import ClientOptions, run_requests

    reqs = [BenchRequest("s1-t0", "x", 1, 2, session_id="s1", turn=0),
            BenchRequest("s2-t0", "FAIL", 1, 2, session_id="s2", turn=0),
            BenchRequest("s1-t1", "x y", 1, 2, session_id="s1", turn=1, think_s=0.1),
            BenchRequest("s2-t1", "z", 1, 2, session_id="s2", turn=1, think_s=0.1)]
    recs = asyncio.run(run_requests(reqs, [0.0, 0.05, 9.0, 9.0], ClientOptions(fake_url)))
    s1t0, s2t0, s1t1, s2t1 = recs
    assert s1t0.scheduled_s == 0.0 and s2t0.scheduled_s == 0.05
    assert s1t0.success and not s2t0.success
    # closed loop: scheduled at the reply's end + think; sent no earlier (a physical bound)
    assert s1t1.scheduled_s == pytest.approx(s1t0.finish_s + 0.1)
    assert s1t1.sent_s >= s1t1.scheduled_s and s1t1.success
    assert not s2t1.success and s2t1.error == "its previous turn failed" and s2t1.server_request_id is None


def test_warmup_requests_are_sent_first_and_left_out_of_every_metric_csv_written(fake_url, tmp_path):
    import csv

    from rps_astro_cli.bench import workload_base, workloads
    from rps_astro_cli.bench.config import BenchConfig
    from rps_astro_cli.bench.runner import run_bench

    reqs = [BenchRequest("w0", "warm one", 1, 1), BenchRequest("w1", "warm two", 1, 2)]
    workloads.WORKLOADS._items["fake-warm"] = lambda opts, rng: workload_base.Workload("fake", reqs, "test")
    before = len(SEEN)
    try:
        res = run_bench(BenchConfig.flat(workload="fake-warm", base_url=fake_url, request_rate=math.inf, warmup=3,
                                         out_dir=str(tmp_path / "rep")))
    finally:
        del workloads.WORKLOADS._items["fake-warm"]
    got = SEEN[before:]
    # 3 warm-up requests (the workload's first, cycled) all before the 2 measured ones
    assert sorted(got[:3]) == ["warm one", "warm one", "warm two"] and sorted(got[3:]) == ["warm one", "warm two"]
    o = res.runs[0].metrics["overall"]
    assert (o.num_requests, o.num_completed) == (2, 2) and o.total_output_tokens == 3
    rows = list(csv.DictReader((tmp_path / "rep" / "summary.csv").open()))
    assert [(r["group"], r["num_requests"], r["total_output_tokens"]) for r in rows] == [("overall", "2", "3"),
                                                                                          ("sand", "2", "3")]
    assert float(rows[0]["ttft_mean_s"]) == pytest.approx(o.ttft_s.mean)
    per = list(csv.DictReader((tmp_path / "rep" / "requests.csv").open()))
    assert sorted(r["request_id"] for r in per) == ["w0", "w1"] and {r["success"] for r in per} == {"True"}
