"""`astro bench` against servers and inputs that misbehave (issue 29, findings 4 and 5, and
the bench's minor points): a stream kept alive by SSE comments ends at `--request-timeout`
(the deadline of the whole request), SIGTERM writes the partial report as Ctrl-C does, a
bad `--out` fails before the first request, a finished run is never lost to a report
folder that went bad meanwhile, `--base-url` without a scheme or with the `openai`
client's trailing /v1, the real line of a bad JSONL row, and a mistyped ASTRO_DATA_DIR.

The fake server is a raw asyncio HTTP/1.1 server on a loopback thread (exact bytes): a
prompt containing PING gets one token and then a `: ping` comment every PING_EVERY_S,
never an end; any other prompt gets its `output_tokens` at once, usage and [DONE]."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import hand_profile, write_profile
from rps_astro_cli.cli.main import app

runner = CliRunner()
PING_EVERY_S = 0.2   # the keep-alive comment's period: well under --request-timeout 1
STATE: dict = {"requests": [], "ok_done": 0, "ping_started": 0, "closing": False}


def _ev(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


def _delta(text=None, role=None, finish=None) -> dict:
    d = {"role": role} if role else {"content": text}
    return {"choices": [{"index": 0, "delta": d, "finish_reason": finish}]}


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        method, path, _ = lines[0].split(" ")
        headers = {k.lower(): v.strip() for k, v in (h.split(":", 1) for h in lines[1:] if ":" in h)}
        body = await reader.readexactly(int(headers.get("content-length", 0)))
        STATE["requests"].append(f"{method} {path}")
        if path == "/v1/models":
            data = json.dumps({"data": [{"id": "fake-model"}]}).encode()
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                         + str(len(data)).encode() + b"\r\nconnection: close\r\n\r\n" + data)
            await writer.drain()
            return
        if path not in ("/v1/chat/completions", "/v1/completions"):
            data = b'{"error": {"message": "not found"}}'
            writer.write(b"HTTP/1.1 404 Not Found\r\ncontent-type: application/json\r\ncontent-length: "
                         + str(len(data)).encode() + b"\r\nconnection: close\r\n\r\n" + data)
            await writer.drain()
            return
        req = json.loads(body)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
        writer.write(_ev(_delta(role="assistant")))
        if "PING" in json.dumps(req.get("messages") or req.get("prompt")):
            STATE["ping_started"] += 1
            writer.write(_ev(_delta("w ")))  # one token, then keep-alive comments, never an end
            await writer.drain()
            for _ in range(int(120 / PING_EVERY_S)):
                if STATE["closing"]:
                    return
                await asyncio.sleep(PING_EVERY_S)
                writer.write(b": ping\n\n")
                await writer.drain()
            return
        n = int(req["vllm_xargs"]["astro_output_tokens"])
        for i in range(n):
            writer.write(_ev(_delta("w ", finish="stop" if i == n - 1 else None)))
        writer.write(_ev({"choices": [], "usage": {"prompt_tokens": 2, "completion_tokens": n}}))
        writer.write(_ev(b"[DONE]"))
        await writer.drain()
        STATE["ok_done"] += 1
    except (ConnectionError, asyncio.IncompleteReadError):
        pass  # the client hung up (its deadline, or it was stopped)
    finally:
        writer.close()


@pytest.fixture(scope="module")
def url():
    loop = asyncio.new_event_loop()
    ready = threading.Event()
    port: list[int] = []

    def main() -> None:
        asyncio.set_event_loop(loop)
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        port.append(sock.getsockname()[1])
        server = loop.run_until_complete(asyncio.start_server(_handle, sock=sock))
        ready.set()
        loop.run_forever()
        server.close()
        loop.run_until_complete(server.wait_closed())

    th = threading.Thread(target=main, daemon=True)
    th.start()
    assert ready.wait(5)
    yield f"http://127.0.0.1:{port[0]}"
    STATE["closing"] = True
    time.sleep(2 * PING_EVERY_S)  # the ping loops see it and end
    loop.call_soon_threadsafe(loop.stop)
    th.join(5)


def _rows(tmp_path: Path, prompts: list[str], name: str = "rows.jsonl") -> str:
    p = tmp_path / name
    p.write_text("".join(json.dumps({"prompt": t, "output_tokens": 3}) + "\n" for t in prompts))
    return str(p)


def _astro(*args: str) -> list[str]:
    return [sys.executable, "-m", "rps_astro_cli.cli.main", *args]


def _virtual(tmp_path: Path) -> list[str]:
    return ["bench", "--virtual", "--profile", write_profile(tmp_path, hand_profile()), "--instances", "2",
            "-w", "synthetic", "-n", "4", "--policies", "round_robin", "--oracle-lengths", "--request-rate", "50",
            "--max-total-tokens", "1000"]


# -- finding 4: a stream kept alive by comments ends at --request-timeout -----------------------

@pytest.mark.timeout(120)
def test_request_timeout_is_the_deadline_of_the_whole_request_not_of_one_read(url, tmp_path):
    """One token, then `: ping` every 0.2 s forever: before, the comments pushed the read
    deadline on (once a second) and `astro bench` never ended. Now the request fails 2 s
    after it was sent, the other request of the run is unaffected, and the report is
    written. (2 s, not 1: the old deadline moved at most once a second, so at 1 s it
    could still fire before its first push.)"""
    out = tmp_path / "rep"
    proc = subprocess.run(_astro("bench", "--base-url", url, "-w", "custom", "--path",
                                 _rows(tmp_path, ["OK hello", "PING forever"]), "-n", "2",
                                 "--request-timeout", "2", "--out", str(out)),
                          capture_output=True, text=True, timeout=60)  # before: TimeoutExpired (it hung)
    assert proc.returncode == 3, proc.stderr[-3000:]  # some requests failed
    m = json.loads((out / "report.json").read_text())["runs"][0]["metrics"]["overall"]
    assert (m["num_requests"], m["num_completed"], m["num_failed"]) == (2, 1, 1)
    rows = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    bad = [r for r in rows if not r["success"]]
    assert len(bad) == 1 and "--request-timeout 2 s" in bad[0]["error"] and "Timeout" in bad[0]["error"]
    assert bad[0]["finish_s"] - bad[0]["sent_s"] >= 2.0 - 0.01  # not cut before its deadline


@pytest.mark.timeout(60)
def test_https_client_path_has_the_same_whole_request_deadline(url):
    """httpx (the https:// path) times each read; a comment every 0.2 s never trips a
    1 s read timeout. `send_request` must end the request at the 1 s deadline too."""
    import httpx

    from rps_astro_cli.bench.client import ClientOptions, send_request
    from rps_astro_cli.bench.workload_base import BenchRequest

    async def go():
        t0 = time.perf_counter()
        timeout = httpx.Timeout(connect=5.0, read=1.0, write=5.0, pool=None)
        async with httpx.AsyncClient(timeout=timeout) as c:
            return await asyncio.wait_for(  # before: this 20 s guard fired (the request never ended)
                send_request(c, BenchRequest("p", "PING", 1, 3), ClientOptions(url, timeout_s=1.0),
                             lambda: time.perf_counter() - t0, 0.0), 20)

    rec = asyncio.run(go())
    assert not rec.success and "--request-timeout 1 s" in rec.error
    assert rec.finish_s - rec.sent_s >= 1.0 - 0.01


def test_request_timeout_must_be_a_positive_number_of_seconds():
    for bad in ("0", "-1", "inf", "nan"):
        res = runner.invoke(app, ["bench", "--base-url", "http://127.0.0.1:9", "--no-report",
                                  "--request-timeout", bad])
        assert res.exit_code == 2 and "--request-timeout" in res.output and "Traceback" not in res.output, bad


def test_help_says_the_request_timeout_runs_from_sent_to_the_last_byte():
    res = runner.invoke(app, ["bench", "--help"], env={"COLUMNS": "200"}, terminal_width=200)
    line = " ".join(res.output.split())  # click folds the help text
    # the option, its type (`<float>` or `FLOAT`, by the rich/typer release), then the text
    assert re.search(r"--request-timeout \S+ Deadline of each whole request, from sending it to its last byte",
                     line), line


# -- finding 4: SIGTERM writes the partial report as Ctrl-C does ---------------------------------

def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sigint", ["default", "ignored"])  # ignored: a job started with `&` by a script
def test_sigterm_writes_the_partial_report_and_exits_130(url, tmp_path, sigint):
    """As test_reliability.py's Ctrl-C test: two requests complete, two stream on (PING);
    SIGTERM → exit 130, report.json says interrupted (SIGTERM), one "(interrupted)" run
    holding the two completed requests. Before: the process died, nothing written."""
    out = tmp_path / "rep"
    ok0, ping0 = STATE["ok_done"], STATE["ping_started"]
    proc = subprocess.Popen(_astro("bench", "--base-url", url, "-w", "custom", "-n", "4", "--out", str(out),
                                   "--path", _rows(tmp_path, ["OK a", "OK b", "PING c", "PING d"])),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_ignore_sigint if sigint == "ignored" else None)
    try:
        deadline = time.monotonic() + 60
        while STATE["ok_done"] - ok0 < 2 or STATE["ping_started"] - ping0 < 2:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the requests never reached the server"
            time.sleep(0.05)
        time.sleep(1.0)  # the client reads the two finished streams' ends
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err[-3000:]  # before: -15, no report
    assert "Traceback" not in err
    rep = json.loads((out / "report.json").read_text())
    assert rep["exit_code"] == 130 and rep["exit_reasons"][0].startswith("interrupted (SIGTERM)")
    assert len(rep["runs"]) == 1 and rep["runs"][0]["label"].endswith("(interrupted)")
    assert rep["runs"][0]["metrics"]["overall"]["num_requests"] == 2
    rows = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and all(r["success"] for r in rows)


def test_sigterm_inside_a_connection_callback_ends_the_run_not_the_connection():
    """With SIGINT ignored (a job a script started with `&`), a SIGTERM that lands while a
    connection's data callback runs ends the event loop's run with KeyboardInterrupt (the
    bench then writes its partial report). Before: KeyboardInterrupt was raised inside the
    callback, where uvloop reports it as that connection's fatal error — a traceback on
    stderr — and the run went on."""
    import os

    import uvloop

    from rps_astro_cli.bench.runner import _sigterm_as_ctrl_c

    got: dict[str, str] = {}
    errors: list[dict] = []

    class Peer(asyncio.Protocol):
        def data_received(self, data: bytes) -> None:
            os.kill(os.getpid(), signal.SIGTERM)  # its handler runs at this callback's next bytecodes
            for _ in range(10_000):
                pass

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
        ours, theirs = socket.socketpair()
        await loop.connect_accepted_socket(Peer, ours)
        theirs.send(b"x")
        await asyncio.sleep(3)
        theirs.close()

    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    restore = _sigterm_as_ctrl_c(got)
    try:
        with pytest.raises(KeyboardInterrupt):
            uvloop.run(main())
    finally:
        restore()
        signal.signal(signal.SIGINT, before)
    assert got == {"signal": "SIGTERM"} and errors == []


# -- finding 5: a bad --out fails before the first request ---------------------------------------

@pytest.mark.parametrize("name", ["results", "README.md"])
def test_out_naming_an_existing_file_fails_before_the_run(tmp_path, name):
    f = tmp_path / name
    f.write_text("keep me\n")
    res = runner.invoke(app, [*_virtual(tmp_path), "--out", str(f)])
    assert res.exit_code == 2, res.output  # before: the whole run, then a FileExistsError traceback
    assert f"--out: {f} is a file, not a folder" in res.output and "Traceback" not in res.output
    assert res.output.count("error:") == 1
    assert "workload" not in res.output and "done" not in res.output  # nothing loaded or run
    assert f.read_text() == "keep me\n"


def test_out_on_a_live_target_is_checked_before_any_request_is_sent(url, tmp_path):
    f = tmp_path / "results"
    f.write_text("x")
    n0 = len(STATE["requests"])
    res = runner.invoke(app, ["bench", "--base-url", url, "-w", "custom", "--path", _rows(tmp_path, ["OK a"]),
                              "-n", "1", "--out", str(f)])
    assert res.exit_code == 2 and "--out:" in res.output and "is a file" in res.output, res.output
    assert STATE["requests"][n0:] == []  # not even the reachability check went out


@pytest.mark.parametrize("where", ["/proc/forbidden", "{file}/sub"])
def test_out_that_cannot_be_created_fails_before_the_run(tmp_path, where):
    (tmp_path / "file").write_text("x")
    target = where.format(file=tmp_path / "file")
    res = runner.invoke(app, [*_virtual(tmp_path), "--out", target])
    assert res.exit_code == 2, res.output  # before: the run, then "file not found" (or a traceback)
    assert f"--out: cannot create the report folder {target}" in res.output and "Traceback" not in res.output
    assert "workload" not in res.output


def test_out_check_leaves_no_folder_behind_when_the_run_then_fails(tmp_path):
    target = tmp_path / "new" / "deeper"
    res = runner.invoke(app, [*_virtual(tmp_path), "-w", "nope", "--out", str(target)])
    assert res.exit_code == 2 and "unknown workload" in res.output
    assert not (tmp_path / "new").exists()


def test_a_report_folder_that_fails_after_the_run_goes_to_a_fallback_folder(tmp_path, monkeypatch):
    """The run finished; writing into --out fails (the disk, a folder removed meanwhile):
    the report goes to a fresh temporary folder and a warning names both."""
    import shutil

    from rps_astro_cli.bench import report
    from rps_astro_cli.bench.config import BenchConfig
    from rps_astro_cli.bench.runner import run_bench

    given = tmp_path / "rep"
    real = report.write_report

    def flaky(result, out_dir):
        if Path(out_dir) == given:
            raise PermissionError(13, "Permission denied", str(given))
        return real(result, out_dir)

    monkeypatch.setattr(report, "write_report", flaky)
    res = run_bench(BenchConfig.flat(virtual=True, profile=write_profile(tmp_path, hand_profile()), instances=2,
                                     workload="synthetic", num_requests=3, policies=["round_robin"],
                                     oracle_lengths=True, max_total_tokens=1000, out_dir=str(given)))
    try:
        assert res.out_dir is not None and res.out_dir != given  # before: PermissionError, the run lost
        rep = json.loads((res.out_dir / "report.json").read_text())
        assert rep["runs"][0]["metrics"]["overall"]["num_completed"] == 3
        assert any(w.startswith(f"--out {given}: could not write the report") and str(res.out_dir) in w
                   for w in res.warnings)
    finally:
        if res.out_dir is not None and res.out_dir != given:
            shutil.rmtree(res.out_dir)


# -- minor: --base-url ----------------------------------------------------------------------------

@pytest.mark.parametrize("given", ["127.0.0.1:8000", "localhost:8000"])
def test_base_url_without_scheme_says_so_before_sending(given):
    res = runner.invoke(app, ["bench", "--base-url", given, "--no-report", "-n", "1"])
    assert res.exit_code == 2, res.output
    assert "--base-url" in res.output and "no http:// or https:// scheme" in res.output
    assert f"--base-url http://{given}" in res.output  # the fix, spelled out
    assert "server running" not in res.output and "Traceback" not in res.output  # before: "is the server running?"


@pytest.mark.parametrize("suffix", ["/v1", "/v1/"])
def test_base_url_ending_in_v1_is_the_server_root(url, tmp_path, suffix):
    """`http://host:port/v1` (cluster.json's openai_base_url, the openai client's form):
    before, every request went to /v1/v1/chat/completions and 404ed, found after the run."""
    from rps_astro_cli.bench.config import BenchConfig
    from rps_astro_cli.bench.runner import run_bench

    n0 = len(STATE["requests"])
    res = run_bench(BenchConfig.flat(workload="custom", path=_rows(tmp_path, ["OK a", "OK b"]),
                                     base_url=url + suffix, num_requests=2))
    assert res.exit_code == 0, res.exit_reasons
    assert all(r.success for r in res.runs[0].records)
    seen = STATE["requests"][n0:]
    assert seen.count("POST /v1/chat/completions") == 2 and not any("/v1/v1" in s for s in seen)
    assert res.target["base_url"] == url


# -- minor: a bad JSONL row's own line ------------------------------------------------------------

def test_bad_jsonl_row_reports_its_real_line(tmp_path):
    p = tmp_path / "rows.jsonl"
    p.write_text('{"prompt": "a", "output_tokens": 3}\n\n{"prompt": "b", "output_tokens": 3}\n{"prompt": "c", oops}\n')
    res = runner.invoke(app, ["bench", "--virtual", "--no-report", "-w", "custom", "--path", str(p)])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output
    assert f"{p}: line 4 is not valid JSON" in res.output  # before: "line 1 column 15"
    assert "line 1" not in res.output


# -- minor: a mistyped ASTRO_DATA_DIR ------------------------------------------------------------

def test_mistyped_astro_data_dir_is_a_loud_warning_naming_it(tmp_path, monkeypatch):
    """Before: the typo fell back to synthetic prompts, and the warning never said that
    ASTRO_DATA_DIR pointed nowhere."""
    from rps_astro_cli.bench.config import BenchConfig
    from rps_astro_cli.bench.runner import run_bench

    typo = tmp_path / "shraed-data"
    monkeypatch.setenv("ASTRO_DATA_DIR", str(typo))
    res = run_bench(BenchConfig.flat(virtual=True, profile=write_profile(tmp_path, hand_profile()), instances=2,
                                     workload="sharegpt", num_requests=3, policies=["round_robin"],
                                     oracle_lengths=True, max_total_tokens=1000))
    assert res.exit_code == 0
    assert res.warnings[0].startswith(f"ASTRO_DATA_DIR={typo} is not a folder")
    assert any("SYNTHETIC" in w for w in res.warnings)  # the existing fallback warning stays
