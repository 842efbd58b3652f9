"""Client CPU seconds per 10k streamed events: `astro bench` vs `vllm bench serve`, one
fake SSE server with known latencies.

The fake server (a separate process, raw asyncio HTTP/1.1 with keep-alive and chunked
encoding, so its own CPU is not counted) answers every POST to `/v1/chat/completions`
with an OpenAI chat stream: a role-only delta after `--ttft-ms`, then `max_tokens` text
deltas `--itl-ms` apart (the last with `finish_reason: "length"`), a usage chunk and
`[DONE]` — vLLM's shapes. Each tool runs as its own process (`astro bench --base-url ...
-w random`, `vllm bench serve --dataset-name random` through vLLM's benchmark entry),
`--num-prompts` requests at `--max-concurrency`, at two reply lengths; the CPU of the
tool's process (user + sys, `RUSAGE_CHILDREN`) at the long length minus that at the short
length, over the difference in events, is the marginal client CPU per event (start-up,
tokenizer loading and dataset sampling cancel out). Arms interleave, `--repeats` times;
printed: median and range per tool, the ratio, and the TTFT / ITL each tool measured
against the server's known ones.

    .venv/bin/python benchmarks/client_cpu_per_event.py --repeats 3 \\
        --vllm /tmp/.astro-vllm-venv/bin/vllm --tokenizer /tmp/.astro-vllm-venv/tiny-llama
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VLLM_SHIM = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
             "from vllm.utils.argparse_utils import FlexibleArgumentParser; p = FlexibleArgumentParser(); "
             "add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


def _event(obj: dict) -> bytes:
    data = b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
    return b"%x\r\n%s\r\n" % (len(data), data)


async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, ttft_s: float, itl_s: float) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            method, path = lines[0].split(b" ")[:2]
            length = 0
            for line in lines[1:]:
                k, _, v = line.partition(b":")
                if k.strip().lower() == b"content-length":
                    length = int(v)
            body = json.loads(await reader.readexactly(length)) if length else {}
            if method != b"POST" or not path.endswith(b"/chat/completions"):
                msg = b'{"object":"list","data":[{"id":"fake","object":"model"}]}' if path.endswith(b"/models") \
                    else b'{"error":"not here"}'
                code = b"200 OK" if path.endswith(b"/models") else b"404 Not Found"
                writer.write(b"HTTP/1.1 %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (code, len(msg), msg))
                await writer.drain()
                continue
            n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
            base = {"id": "chatcmpl-fake", "object": "chat.completion.chunk", "created": 1, "model": "fake"}
            t0 = time.perf_counter()
            await asyncio.sleep(ttft_s)
            writer.write(_event({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                      "logprobs": None, "finish_reason": None}]}))
            for i in range(n):
                # each event at its planned time t0 + ttft + (i + 1) · itl (no drift)
                delay = t0 + ttft_s + (i + 1) * itl_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                writer.write(_event({**base, "choices": [{"index": 0, "delta": {"content": " tok"}, "logprobs": None,
                                                          "finish_reason": "length" if i == n - 1 else None}]}))
            writer.write(_event({**base, "choices": [],
                                 "usage": {"prompt_tokens": 16, "completion_tokens": n, "total_tokens": 16 + n}}))
            done = b"data: [DONE]\n\n"
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(done), done))
            await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError, ValueError):
        pass
    finally:
        writer.close()


def serve(port: int, ttft_s: float, itl_s: float) -> None:
    async def main() -> None:
        srv = await asyncio.start_server(lambda r, w: _handle(r, w, ttft_s, itl_s), "127.0.0.1", port, backlog=1024)
        async with srv:
            await srv.serve_forever()

    try:
        import uvloop

        uvloop.run(main())
    except ImportError:  # pragma: no cover
        asyncio.run(main())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_tool(cmd: list[str], timeout: float) -> tuple[float, subprocess.CompletedProcess]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "HF_HUB_OFFLINE": "1"})
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if r.returncode:
        raise SystemExit(f"{cmd[:4]} failed ({r.returncode}):\n{r.stderr[-3000:]}")
    return cpu, r


def astro_cmd(a, url: str, out_len: int, out_dir: Path) -> list[str]:
    return [sys.executable, "-m", "rps_astro_cli.cli.main", "bench", "--base-url", url, "--model", "fake",
            "-w", "random", "--input-len", "16", "--output-len", str(out_len), "-n", str(a.num_prompts),
            "--request-rate", "inf", "--max-concurrency", str(a.max_concurrency), "--ignore-eos",
            "--ttft-definition", "vllm", "--out", str(out_dir)]


def baseline_cmd(a, url: str, out_len: int, out_dir: Path) -> list[str]:
    """An older astro (`--baseline-python`: e.g. the venv of a checkout before the lean
    client, whose load generator is httpx) on a lengths-only trace of the same lengths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    trace = out_dir / "lengths.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n" + f"16,{out_len}\n" * a.num_prompts)
    return [a.baseline_python, "-m", "rps_astro_cli.cli.main", "bench", "--base-url", url, "--model", "fake",
            "-w", "length-trace", "--path", str(trace), "-n", str(a.num_prompts), "--request-rate", "inf",
            "--max-concurrency", str(a.max_concurrency), "--ignore-eos", "--max-tokens", "reference",
            "--out", str(out_dir / "rep")]


def vllm_cmd(a, url: str, out_len: int, out_file: Path) -> list[str]:
    return [str(Path(a.vllm).with_name("python")), "-c", VLLM_SHIM, "--backend", "openai-chat", "--endpoint",
            "/v1/chat/completions", "--base-url", url, "--model", "fake", "--tokenizer", a.tokenizer,
            "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", str(out_len),
            "--num-prompts", str(a.num_prompts), "--max-concurrency", str(a.max_concurrency), "--ignore-eos",
            "--request-rate", "inf", "--disable-tqdm", "--percentile-metrics", "ttft,itl", "--save-result",
            "--result-dir", str(out_file.parent), "--result-filename", out_file.name, "--num-warmups", "0"]


def measured(tool: str, path: Path) -> tuple[float, float]:
    """(mean TTFT s, mean ITL s) the tool reported."""
    if tool == "vllm":
        d = json.loads(path.read_text())
        return d["mean_ttft_ms"] / 1e3, d["mean_itl_ms"] / 1e3
    if tool == "baseline":
        path = path / "rep"
    m = json.loads((path / "report.json").read_text())["runs"][0]["metrics"]["overall"]
    return m["ttft_s"]["mean"], m["itl_s"]["mean"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm", default="/tmp/.astro-vllm-venv/bin/vllm")
    ap.add_argument("--tokenizer", default="/tmp/.astro-vllm-venv/tiny-llama")
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--max-concurrency", type=int, default=50)
    ap.add_argument("--short", type=int, default=10, help="reply events at the short length")
    ap.add_argument("--long", type=int, default=110, help="reply events at the long length")
    ap.add_argument("--ttft-ms", type=float, default=20.0)
    ap.add_argument("--itl-ms", type=float, default=5.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--tools", default="astro,vllm", help="astro, vllm, baseline (see --baseline-python)")
    ap.add_argument("--baseline-python", default="/work/main/.venv/bin/python",
                    help="the interpreter of an older astro install, for the baseline tool")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", type=Path, default=None, help="write the printed figures here")
    a = ap.parse_args()
    port = _free_port()
    srv = subprocess.Popen([sys.executable, __file__, "--serve", str(port), str(a.ttft_ms / 1e3), str(a.itl_ms / 1e3)],
                           start_new_session=True)
    work = Path(tempfile.mkdtemp(prefix="astro-client-cpu-"))
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        tools = a.tools.split(",")
        per_event: dict[str, list[float]] = {t: [] for t in tools}
        seen: dict[str, list[tuple[float, float]]] = {t: [] for t in tools}
        for rep in range(a.repeats):
            for tool in (tools if rep % 2 == 0 else tools[::-1]):
                cpu = {}
                for n in (a.short, a.long):
                    out = work / f"{tool}-{rep}-{n}" / ("r.json" if tool == "vllm" else "")
                    out.parent.mkdir(parents=True, exist_ok=True)
                    cmd = {"vllm": vllm_cmd, "baseline": baseline_cmd, "astro": astro_cmd}[tool](a, url, n, out)
                    cpu[n], _ = run_tool(cmd, a.timeout)
                    if n == a.long:
                        seen[tool].append(measured(tool, out))
                events = a.num_prompts * (a.long - a.short)
                per_event[tool].append((cpu[a.long] - cpu[a.short]) / events * 1e4)
                print(f"repeat {rep} {tool}: CPU {cpu[a.short]:.2f} s at {a.short} events/request, "
                      f"{cpu[a.long]:.2f} s at {a.long}: {per_event[tool][-1]:.3f} s per 10k events",
                      file=sys.stderr, flush=True)
        print(f"server: TTFT {a.ttft_ms:g} ms (role-only delta; vLLM's definition), ITL {a.itl_ms:g} ms; "
              f"{a.num_prompts} requests at concurrency {a.max_concurrency}, {a.short} vs {a.long} events each")
        print("| tool | client CPU s per 10k events (median) | range | measured mean TTFT ms | mean ITL ms |")
        print("|---|---|---|---|---|")
        rows: dict[str, dict] = {}
        for t in tools:
            v = per_event[t]
            ttft = statistics.median(x[0] for x in seen[t]) * 1e3
            itl = statistics.median(x[1] for x in seen[t]) * 1e3
            print(f"| {t} | {statistics.median(v):.3f} | {min(v):.3f}–{max(v):.3f} | {ttft:.1f} | {itl:.2f} |")
            rows[t] = {"cpu_s_per_10k_events": v, "cpu_s_per_10k_events_median": statistics.median(v),
                       "ttft_mean_ms": ttft, "itl_mean_ms": itl}
        if "vllm" in tools:
            for t in tools:
                if t != "vllm":
                    r = [x / y for x, y in zip(per_event[t], per_event["vllm"])]
                    print(f"\n{t} / vllm: median {statistics.median(r):.2f}× (range {min(r):.2f}–{max(r):.2f})")
                    rows[t]["ratio_to_vllm"] = r
        if a.json:
            out = {"ttft_ms": a.ttft_ms, "itl_ms": a.itl_ms, "num_prompts": a.num_prompts,
                   "max_concurrency": a.max_concurrency, "short": a.short, "long": a.long, "tools": rows}
            a.json.write_text(json.dumps(out, indent=1) + "\n")
    finally:
        os.killpg(srv.pid, signal.SIGTERM)
        srv.wait(timeout=10)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--serve":
        serve(int(sys.argv[2]), float(sys.argv[3]), float(sys.argv[4]))
    else:
        main()
