"""Mooncake block-hash traces (`-w mooncake`, issue 34 item 6): prompts repeat their token
ids exactly where the trace repeats its `hash_ids`, and a virtual run's prefix-cache hit
rate is the one worked out by hand from the ids.

Hit rule (one instance, KV room for everything, so nothing is evicted): a request's hit is
the longest token prefix it shares with an earlier request's prompt — its leading 512-token
trace blocks already seen, plus the seen part of a block an earlier request held only
partially — rounded down to the engine's 16-token block, and never its last token (at most
(prompt − 1) // 16 blocks, as vLLM V1 leaves one token to compute).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import linear_profile, write_profile
from rps_astro_cli.bench.config import BenchConfig
from rps_astro_cli.bench.workload_base import WorkloadOptions
from rps_astro_cli.bench.workloads import load_workload
from rps_astro_cli.bench.workloads_traces import mooncake_block_text, mooncake_prompt_tokens
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.tokens import token_ids_fallback

# (timestamp ms, input_length, output_length, hash_ids), 10 s apart: each request has
# finished before the next arrives
ROWS = [
    (0, 1536, 4, [0, 1, 2]),       # new: hit 0
    (10_000, 1536, 4, [0, 1, 3]),  # blocks 0, 1 seen: hit 1024
    (20_000, 700, 4, [0, 4]),      # block 0 seen; 4 new (188 tokens of it): hit 512
    (30_000, 1536, 4, [0, 1, 2]),  # the first again: all seen, but not its last token: (1536 − 1) // 16 · 16 = 1520
    (40_000, 300, 4, [5]),         # new: hit 0
    (50_000, 1100, 4, [0, 4, 6]),  # 0 seen; 4 seen as its first 188 tokens → 11 engine blocks: 512 + 176 = 688
]
HITS = [0, 1024, 512, 1520, 0, 688]


def _trace(tmp_path: Path, rows=ROWS) -> Path:
    p = tmp_path / "mc.jsonl"
    p.write_text("".join(json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": h}) + "\n"
                         for t, i, o, h in rows))
    return p


def _load(path: Path, **kw):
    opts = WorkloadOptions(path=path, num_requests=kw.pop("num_requests", 100), max_prompt_tokens=8192,
                           max_total_tokens=8192, **kw)
    return load_workload("mooncake", opts, np.random.default_rng(0))


def test_blocks_repeat_exactly_where_hash_ids_repeat(tmp_path) -> None:
    wl = _load(_trace(tmp_path))
    assert [r.prompt_tokens for r in wl.requests] == [1536, 1536, 700, 1536, 300, 1100]
    assert [r.output_tokens for r in wl.requests] == [4] * 6
    assert [r.arrival_s for r in wl.requests] == [0.0, 10.0, 20.0, 30.0, 40.0, 50.0]
    assert wl.has_timestamps
    for r, (_, n, _, hs) in zip(wl.requests, ROWS):
        ids = token_ids_fallback(r.prompt)
        assert len(ids) == n
        for j, h in enumerate(hs):
            block = token_ids_fallback(mooncake_block_text(h))
            assert len(block) == 512
            assert ids[512 * j:512 * (j + 1)] == block[:min(512, n - 512 * j)]
    assert token_ids_fallback(mooncake_block_text(1)) != token_ids_fallback(mooncake_block_text(2))


def test_fitting_rule_cuts_at_a_block_boundary_and_clips_the_reply(tmp_path) -> None:
    assert mooncake_prompt_tokens(1536, 8192) == 1536
    assert mooncake_prompt_tokens(1536, 1100) == 1024  # two whole blocks fit
    assert mooncake_prompt_tokens(1536, 300) == 300    # not even one block fits
    p = _trace(tmp_path, [(0, 1536, 900, [0, 1, 2]), (5, 100, 0, [7]), (7, 100, 10, "x")])
    wl = load_workload("mooncake", WorkloadOptions(path=p, num_requests=10, max_prompt_tokens=1100,
                                                   max_total_tokens=1500), np.random.default_rng(0))
    (r,) = wl.requests
    assert (r.prompt_tokens, r.output_tokens) == (1024, 476)  # 1500 − 1024
    assert token_ids_fallback(r.prompt) == token_ids_fallback(mooncake_block_text(0) + " " + mooncake_block_text(1))
    assert wl.notes == {"prompt_cut": 1, "output_cut": 1}
    assert wl.skipped == {"zero_output_tokens": 1, "malformed": 1}


def test_bad_file_is_one_line(tmp_path) -> None:
    p = tmp_path / "bad.jsonl"
    p.write_text('{"timestamp": 0}\nnot json\n')
    with pytest.raises(AstroUserError, match="line 2"):
        _load(p)


def test_virtual_hit_rate_matches_the_trace_sharing(tmp_path) -> None:
    from rps_astro_cli.bench.runner import run_bench

    prof = write_profile(tmp_path, linear_profile(num_gpu_blocks=4000, max_model_len=8192))
    res = run_bench(BenchConfig.flat(virtual=True, profile=prof, instances=1, workload="mooncake",
                                     path=str(_trace(tmp_path)), num_requests=6, max_prompt_tokens=8192,
                                     max_total_tokens=8192, arrival="trace", policies=["round_robin"],
                                     oracle_lengths=True))
    assert res.exit_code == 0
    (run,) = res.runs
    queries = sum(n for _, n, _, _ in ROWS)  # 6708
    assert run.extras["prefix_cache_queries_tokens"] == queries
    assert run.extras["prefix_cache_hits_tokens"] == sum(HITS)  # 3744
    assert run.extras["prefix_cache_hits_tokens"] / queries == pytest.approx(3744 / 6708)


def test_virtual_time_scale_stretches_the_trace(tmp_path) -> None:
    from rps_astro_cli.bench.runner import run_bench

    prof = write_profile(tmp_path, linear_profile(num_gpu_blocks=4000, max_model_len=8192))
    res = run_bench(BenchConfig.flat(virtual=True, profile=prof, instances=1, workload="mooncake",
                                     path=str(_trace(tmp_path)), num_requests=6, max_prompt_tokens=8192,
                                     max_total_tokens=8192, arrival="trace", time_scale=0.5,
                                     policies=["round_robin"], oracle_lengths=True))
    (run,) = res.runs
    sched = sorted(r.scheduled_s for r in run.records)
    assert sched == pytest.approx([0.0, 5.0, 10.0, 15.0, 20.0, 25.0])


def test_real_trace_blocks_follow_hash_ids() -> None:
    from rps_astro_cli.data_paths import data_dir

    d = data_dir()
    f = None if d is None else d / "traces/mooncake/conversation_trace.jsonl"
    if f is None or not f.is_file():
        pytest.skip("no Mooncake trace in the data folder")
    wl = load_workload("mooncake", WorkloadOptions(path=f, num_requests=40, max_prompt_tokens=4096,
                                                   max_total_tokens=8192), np.random.default_rng(0))
    with f.open() as fh:
        rows = [json.loads(next(fh)) for _ in range(40)]
    assert len(wl.requests) == 40
    for r in wl.requests:
        row = rows[int(r.source_id)]
        ids = token_ids_fallback(r.prompt)
        assert len(ids) == mooncake_prompt_tokens(row["input_length"], 4096)
        for j in range(len(ids) // 512):
            assert ids[512 * j:512 * (j + 1)] == token_ids_fallback(mooncake_block_text(row["hash_ids"][j]))


def test_simulate_replays_a_mooncake_trace_with_its_sharing(tmp_path) -> None:
    """`astro simulate --path FILE.jsonl`: the same prompts (Poisson arrivals at 0.001
    req/s with seed 0: no two requests overlap), so the same hand-worked hits."""
    from typer.testing import CliRunner

    from rps_astro_cli.cli.main import app

    prof = write_profile(tmp_path, linear_profile(num_gpu_blocks=4000, max_model_len=8192))
    out = tmp_path / "rec.jsonl"
    res = CliRunner().invoke(app, ["simulate", "--path", str(_trace(tmp_path)), "--instances", "1", "--profile",
                                   prof, "--request-rate", "0.001", "-n", "100", "--out", str(out)],
                             env={"COLUMNS": "200"}, terminal_width=200)
    assert res.exit_code == 0, res.output
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["prompt_tokens"] for r in recs] == [1536, 1536, 700, 1536, 300, 1100]  # rows are not cycled
    assert [r["cached_tokens"] for r in recs] == HITS
    assert f"prefix-cache hits {3744 / 6708:.1%} of prompt tokens" in " ".join(res.output.split())


@pytest.mark.slow
def test_live_replay_hits_match_the_trace_sharing(tmp_path) -> None:
    """`astro bench -w mooncake --cluster ...` against a 1-instance sim fleet (`astro serve`,
    20× time): the engine's own prefix-cache counters (`vllm:prefix_cache_*_total`) show the
    hand-worked hits. The completions endpoint sends the prompt text alone, so the engine's
    token ids are the prompt's (the chat endpoint would prepend the role's)."""
    import signal
    import subprocess
    import sys
    import time

    import httpx

    from conftest import prom_sum
    from rps_astro_cli.bench.runner import run_bench

    cj = tmp_path / "cluster.json"
    log = open(tmp_path / "serve.out", "w")
    proc = subprocess.Popen([sys.executable, "-m", "rps_astro_cli.cli.main", "serve", "--instances", "1",
                             "--time-scale", "0.05", "--run-dir", str(tmp_path / "run"), "--cluster-json", str(cj)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not cj.exists():
            assert proc.poll() is None, (tmp_path / "serve.out").read_text()
            assert time.monotonic() < deadline, "cluster did not start"
            time.sleep(0.2)
        info = json.loads(cj.read_text())
        token = Path(info["internal_token_file"]).read_text().strip()

        def counters() -> tuple[float, float]:
            text = httpx.get(info["instances"][0]["engine_url"] + "/metrics", timeout=10,
                             headers={"x-astro-internal-token": token}).text
            return (prom_sum(text, "vllm:prefix_cache_queries_total"), prom_sum(text, "vllm:prefix_cache_hits_total"))

        # one request first: a cold fleet's first request waits seconds (loading the tagger's
        # model and the look-ahead), which bunched the trace's requests into one batch, where
        # a later row cannot hit what an earlier row of the same step is still computing
        r = httpx.post(info["scheduler"]["url"] + "/v1/completions", timeout=60,
                       json={"model": info["model"], "prompt": "warm up", "max_tokens": 1})
        assert r.status_code == 200, r.text
        q0, h0 = counters()
        res = run_bench(BenchConfig.flat(cluster=str(cj), workload="mooncake", path=str(_trace(tmp_path)),
                                         num_requests=6, max_prompt_tokens=8192, max_total_tokens=8192,
                                         arrival="trace", time_scale=0.05, endpoint="completions"))
        assert res.exit_code == 0
        assert all(r.success for r in res.runs[0].records)
        q1, h1 = counters()
        assert q1 - q0 == sum(n for _, n, _, _ in ROWS)
        assert h1 - h0 == sum(HITS)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(30)
        log.close()


def _trace_hit_share(rows: list[dict], max_prompt_tokens: int) -> float:
    """The trace's own sharing, by the hit rule on whole 512-token blocks: prompts cut by
    the fitting rule; a request hits its leading blocks whose id prefix an earlier request
    held (ids name blocks, and a block's tokens depend on the ids before it, so a prefix of
    ids is what a cache matches), never its last token; hits / prompt tokens."""
    seen: set[tuple[int, ...]] = set()
    hits = queries = 0
    for r in rows:
        p = mooncake_prompt_tokens(r["input_length"], max_prompt_tokens)
        ids = tuple(r["hash_ids"][: -(-p // 512)])
        k = 0
        while k < len(ids) and ids[: k + 1] in seen:
            k += 1
        hits += min(512 * k, (p - 1) // 16 * 16)
        queries += p
        seen.update(ids[: j + 1] for j in range(len(ids)))
    return hits / queries


def test_real_trace_virtual_hit_share_is_the_traces_own(tmp_path) -> None:
    """The first 300 rows of the real trace on one instance whose KV never evicts: the
    virtual run's prefix-cache hit share is the one `_trace_hit_share` reads off the ids."""
    from rps_astro_cli.bench.runner import run_bench
    from rps_astro_cli.data_paths import data_dir

    d = data_dir()
    f = None if d is None else d / "traces/mooncake/conversation_trace.jsonl"
    if f is None or not f.is_file():
        pytest.skip("no Mooncake trace in the data folder")
    with f.open() as fh:
        rows = [json.loads(next(fh)) for _ in range(300)]
    prof = write_profile(tmp_path, linear_profile(num_gpu_blocks=100_000, max_model_len=4096))
    res = run_bench(BenchConfig.flat(virtual=True, profile=prof, instances=1, workload="mooncake", path=str(f),
                                     num_requests=300, max_prompt_tokens=3584, max_total_tokens=4096,
                                     arrival="trace", time_scale=20.0, policies=["round_robin"],
                                     oracle_lengths=True))
    e = res.runs[0].extras
    assert res.runs[0].extras["preemptions_total"] == 0
    want = _trace_hit_share(rows, 3584)
    assert want > 0.2  # the trace shares (≈ 0.23 on these rows)
    assert e["prefix_cache_hits_tokens"] / e["prefix_cache_queries_tokens"] == pytest.approx(want, abs=1e-12)
