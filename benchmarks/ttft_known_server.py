"""What each load generator adds to TTFT / ITL / E2E: `astro bench --ttft-definition vllm`
and `vllm bench serve` against one fake SSE server whose latencies are known exactly.

The server (`benchmarks/fake_sse_server.py`, its own process) sends the role-only delta
`--ttft-ms` after each request's body was read, then `--chunks` text deltas `--itl-ms`
apart, and logs per request when it read the body and wrote the first delta (CLOCK_MONOTONIC,
the clock of vLLM's `start_times`). A tool's TTFT minus the server's own
first-delta − arrival is what the client adds; for vLLM (whose per-request start times are
absolute) it is split into before the request reached the server (start stamp → body read:
its own request building, connection set-up, send) and after (delta written → stamped).

Settings: Poisson `--rates` (req/s, `--num-prompts` each) and a closed loop at
`--max-concurrency` (request rate inf: the first burst of that many requests starts at
once). Arms interleave, order rotating, `--repeats` times; printed per tool and setting:
the medians over repeats of mean / P99 TTFT, its excess over the server truth, mean ITL and
E2E, and the spread.

    OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python benchmarks/ttft_known_server.py --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
VLLM_SHIM = ("import sys; from vllm.benchmarks.serve import add_cli_args, main; "
             "from vllm.utils.argparse_utils import FlexibleArgumentParser; p = FlexibleArgumentParser(); "
             "add_cli_args(p); main(p.parse_args(sys.argv[1:]))")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def load_args(setting: str) -> tuple[list[str], list[str]]:
    """(astro flags, vllm flags) of one load setting: "rate=R" or "conc=C"."""
    kind, _, v = setting.partition("=")
    if kind == "rate":
        return ["--request-rate", v], ["--request-rate", v]
    return ["--request-rate", "inf", "--max-concurrency", v], ["--request-rate", "inf", "--max-concurrency", v]


def astro_cmd(a, url: str, setting: str, out: Path) -> list[str]:
    return [sys.executable, "-m", "rps_astro_cli.cli.main", "bench", "--base-url", url, "--model", "fake",
            "-w", "random", "--input-len", "16", "--output-len", str(a.chunks), "-n", str(a.num_prompts),
            "--seed", "0", *load_args(setting)[0], "--ignore-eos", "--max-tokens", "reference",
            "--ttft-definition", "vllm", "--out", str(out)]


def vllm_cmd(a, url: str, setting: str, out: Path) -> list[str]:
    return [str(Path(a.vllm).with_name("python")), "-c", VLLM_SHIM, "--backend", "openai-chat", "--endpoint",
            "/v1/chat/completions", "--base-url", url, "--model", "fake", "--tokenizer", a.tokenizer,
            "--dataset-name", "random", "--random-input-len", "16", "--random-output-len", str(a.chunks),
            "--num-prompts", str(a.num_prompts), "--seed", "0", *load_args(setting)[1], "--ignore-eos",
            "--disable-tqdm", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "99",
            "--save-result", "--save-detailed", "--result-dir", str(out.parent), "--result-filename", out.name]


def _p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(0.99 * (len(s) - 1))))]


def result(tool: str, out: Path) -> dict:
    if tool == "vllm":
        d = json.loads(out.read_text())
        ok = [i for i, e in enumerate(d.get("errors") or []) if not e]
        return {"ttft_mean": d["mean_ttft_ms"] / 1e3, "ttft_p99": d["p99_ttft_ms"] / 1e3,
                "itl_mean": d["mean_itl_ms"] / 1e3, "e2e_mean": d["mean_e2el_ms"] / 1e3,
                "completed": d["completed"],
                "starts": [d["start_times"][i] for i in ok], "ttfts": [d["ttfts"][i] for i in ok]}
    m = json.loads((out / "report.json").read_text())["runs"][0]["metrics"]["overall"]
    return {"ttft_mean": m["ttft_s"]["mean"], "ttft_p99": m["ttft_s"]["p99"], "itl_mean": m["itl_s"]["mean"],
            "e2e_mean": m["e2e_s"]["mean"], "completed": m["num_completed"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm", default="/tmp/.astro-vllm-venv/bin/vllm")
    ap.add_argument("--tokenizer", default="/tmp/.astro-vllm-venv/tiny-llama")
    ap.add_argument("--ttft-ms", type=float, default=80.0)
    ap.add_argument("--itl-ms", type=float, default=20.0)
    ap.add_argument("--chunks", type=int, default=20, help="text deltas per reply")
    ap.add_argument("--num-prompts", type=int, default=50)
    ap.add_argument("--settings", default="rate=2,rate=10,conc=16",
                    help="comma list of rate=R (Poisson req/s) and conc=C (closed loop, C in flight)")
    ap.add_argument("--tools", default="vllm,astro")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--json", help="write the raw figures here")
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="astro-ttft-known-"))
    log = work / "server.jsonl"
    port = _free_port()
    srv = subprocess.Popen([sys.executable, str(HERE / "fake_sse_server.py"), "--port", str(port), "--ttft-ms",
                            str(a.ttft_ms), "--itl-ms", str(a.itl_ms), "--chunks", str(a.chunks), "--log", str(log)],
                           start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    tools = a.tools.split(",")
    settings = a.settings.split(",")
    rows: dict[tuple[str, str], list[dict]] = {(t, s): [] for t in tools for s in settings}
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.1)
        for rep in range(a.repeats):
            for s in settings:
                order = tools if (rep + settings.index(s)) % 2 == 0 else tools[::-1]
                for tool in order:
                    out = work / f"{tool}-{s.replace('=', '')}-{rep}" / ("r.json" if tool == "vllm" else "")
                    out.parent.mkdir(parents=True, exist_ok=True)
                    cmd = (vllm_cmd if tool == "vllm" else astro_cmd)(a, url, s, out)
                    mark = log.stat().st_size if log.exists() else 0
                    r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout,
                                       env={**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_LEVEL": "WARNING"})
                    if r.returncode:
                        raise SystemExit(f"{tool} failed ({r.returncode}):\n{r.stderr[-3000:]}")
                    res = result(tool, out)
                    with log.open() as f:
                        f.seek(mark)
                        srv_rows = [json.loads(line) for line in f if line.strip()]
                    if tool == "vllm":  # its ready-check request is logged too: keep the run's own
                        srv_rows = srv_rows[-a.num_prompts:]
                    truth = [x["first_s"] - x["arrival_s"] for x in srv_rows]
                    res["truth_ttft_mean"] = statistics.fmean(truth)
                    res["excess_ms"] = (res["ttft_mean"] - res["truth_ttft_mean"]) * 1e3
                    if tool == "vllm" and len(res["starts"]) == len(srv_rows):
                        # sorted start stamps ↔ sorted arrivals (one host, loopback: the order holds)
                        arr = sorted(x["arrival_s"] for x in srv_rows)
                        firsts = sorted(x["first_s"] for x in srv_rows)
                        pairs = sorted(zip(res["starts"], res["ttfts"]))
                        res["pre_ms"] = statistics.fmean(x - st for x, (st, _) in zip(arr, pairs)) * 1e3
                        res["post_ms"] = statistics.fmean(st + tt - f for f, (st, tt) in zip(firsts, pairs)) * 1e3
                    res.pop("starts", None)
                    res.pop("ttfts", None)
                    rows[(tool, s)].append(res)
                    print(f"repeat {rep} {s} {tool}: mean TTFT {res['ttft_mean'] * 1e3:.2f} ms (server "
                          f"{res['truth_ttft_mean'] * 1e3:.2f}), excess {res['excess_ms']:+.2f} ms"
                          + (f" (before the server {res['pre_ms']:+.2f}, after {res['post_ms']:+.2f})"
                             if "pre_ms" in res else ""), file=sys.stderr, flush=True)
        print(f"fake server: TTFT {a.ttft_ms:g} ms (role-only delta), {a.chunks} deltas {a.itl_ms:g} ms apart; "
              f"{a.num_prompts} requests per run, {a.repeats} repeats; medians (min–max)")
        print("| setting | tool | mean TTFT ms | P99 TTFT ms | mean TTFT − server's, ms | mean ITL ms | mean E2E ms |")
        print("|---|---|---|---|---|---|---|")

        def fmt(xs: list[float], k: float = 1e3, d: int = 2) -> str:
            xs = [x * k for x in xs]
            return f"{statistics.median(xs):.{d}f} ({min(xs):.{d}f}–{max(xs):.{d}f})"

        for s in settings:
            for t in tools:
                v = rows[(t, s)]
                print(f"| {s} | {t} | {fmt([x['ttft_mean'] for x in v])} | {fmt([x['ttft_p99'] for x in v])} | "
                      f"{fmt([x['excess_ms'] for x in v], 1)} | {fmt([x['itl_mean'] for x in v])} | "
                      f"{fmt([x['e2e_mean'] for x in v], 1e3, 1)} |")
        if a.json:
            Path(a.json).write_text(json.dumps({f"{t}|{s}": v for (t, s), v in rows.items()}, indent=1))
    finally:
        os.killpg(srv.pid, signal.SIGTERM)
        srv.wait(timeout=10)


if __name__ == "__main__":
    main()
