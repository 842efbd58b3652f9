"""benchmarks/peer_routers.py: the run order, the summary arithmetic, how each router
family receives the true length, and one end-to-end run on a tiny sim fleet (astro arms
always; a vllm-router arm when `.[peers]` is installed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from conftest import load_script
from rps_astro_cli.bench.client import build_body
from rps_astro_cli.bench.workload_base import BenchRequest, WorkloadOptions
from rps_astro_cli.bench.workloads import load_workload
from rps_astro_cli.data_paths import data_dir

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "peer_routers.py"

pr = load_script("benchmarks/peer_routers.py", "peer_routers")


def test_schedule_interleaves_and_rotates_each_repeat() -> None:
    a, b, c = (pr.Arm(n, "astro", n) for n in "abc")
    plan = pr.schedule([a, b, c], [5.0], repeats=3)
    # offsets ⌊r·3/3⌋ = 0, 1, 2: every arm once per repeat, first / middle / last once each
    assert [x[2].name for x in plan] == list("abc" "bca" "cab")
    assert [x[0] for x in plan] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    two = pr.schedule([a, b], [5.0, 9.0], repeats=1)  # loads interleave, shifted by the load index
    assert [(x[1], x[2].name) for x in two] == [(0, "a"), (0, "b"), (1, "b"), (1, "a")]


def test_summary_medians_spread_and_paired_ratio_skip_rejected_runs() -> None:
    ref, x = pr.Arm("ref", "astro", "p"), pr.Arm("x", "vllm-router", "q")

    def run(arm, rep, p99, status="ok"):
        return {"arm": arm, "repeat": rep, "load_index": 0, "status": status, "ttft_p99_s": p99,
                "ttft_mean_s": p99 / 2, "e2e_mean_s": p99 * 3, "throughput_rps": 9.0, "reason": "lag"}

    runs = [run("ref", 0, 2.0), run("ref", 1, 4.0), run("ref", 2, 5.0),
            run("x", 0, 1.0), run("x", 1, 4.0), run("x", 2, 10.0), run("x", 2, 99.0, "rejected")]
    rows = {r["arm"]: r for r in pr.summarize(runs, [ref, x], [9.5], "ref")}
    assert rows["x"]["runs_ok"] == 3 and rows["x"]["runs_total"] == 4 and rows["x"]["rejected"] == ["lag"]
    assert rows["x"]["ttft_p99_s"] == {"median": 4.0, "min": 1.0, "max": 10.0, "n": 3}
    assert rows["x"]["e2e_mean_s"]["median"] == 12.0
    # per-repeat ratios 1/2, 4/4, 10/5 → median 1.0, spread 0.5–2.0
    assert rows["x"]["ttft_p99_vs_ref"] == {"median": 1.0, "min": 0.5, "max": 2.0, "n": 3}
    assert rows["ref"]["ttft_p99_vs_ref"]["median"] == 1.0
    md = pr.markdown(list(rows.values()), [0.95], "ref", {"instances": 4, "profile": "p", "time_scale": 1.0,
                                                           "workload": "sharegpt", "num_requests": 9,
                                                           "repeats": 3, "seed": 0})
    assert "| 95% (9.5 req/s) | `x` | none | 3/4 | 4 [1–10] | 1.00 [0.50–2.00] | 2 [0.5–5] | 12 [3–30] |" in md
    assert "- `x` @ 9.5 req/s: lag" in md


def test_verdict_rejects_lag_at_threshold_failures_and_wrong_lengths() -> None:
    assert pr.verdict(0.249, 0, 0, 0.25) == ""
    assert pr.verdict(0.25, 0, 0, 0.25) == "engine lag 0.250 s ≥ 0.25 s"
    assert pr.verdict(0.0, 2, 1, 0.25) == "2 failed requests; 1 requests not at their true length"
    assert pr.verdict(0.0, 0, 0, 0.25, send_p99_s=1.0, max_send_delay_s=1.0) == ""
    assert pr.verdict(0.0, 0, 0, 0.25, send_p99_s=1.5, max_send_delay_s=1.0) == "client sent late: P99 1.50 s > 1 s"


def test_true_length_encoding_per_router_family() -> None:
    req = BenchRequest("sharegpt-1", "hello", 1, 37)
    _, astro = build_body(req, pr.client_opts(pr.ARMS["astro/power_of_k"], "http://x", "m", 5.0))
    _, vllm = build_body(req, pr.client_opts(pr.ARMS["vllm-router/power_of_two"], "http://x", "m", 5.0))
    _, sgl = build_body(req, pr.client_opts(pr.ARMS["sglang-router/power_of_two"], "http://x", "m", 5.0))
    # astro's scheduler would clip its prediction by max_tokens: it must not get one
    assert "max_tokens" not in astro and astro["vllm_xargs"] == {"astro_output_tokens": 37}
    assert vllm == astro
    # sglang-router drops vllm_xargs: the length travels as max_tokens under ignore_eos
    assert sgl["max_tokens"] == 37 and sgl["ignore_eos"] is True


def test_bad_arm_is_a_one_line_error(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        pr.parse_args(["--arms", "astro/bogus"])
    assert exc.value.code == 2
    assert "--arms: unknown arm(s) astro/bogus" in capsys.readouterr().err


HETERO = ["llama-2-7b-a100", "llama-2-7b-a100", "llama-2-7b-a30", "llama-2-7b-a30"]


def test_heterogeneous_fleet_from_profile_list_or_recipe(capsys) -> None:
    """`--profile P1,…,PN` (or a recipe's `instances:` groups) gives each engine its own
    profile through `with_fleet`, Predictor sidecars on; a count that is not `--instances`
    is one line naming `--profile` (no usage, no traceback)."""
    from rps_astro_cli.services.config import instance_specs

    for argv in (["--instances", "4", "--profile", ",".join(HETERO)], ["--profile", ",".join(HETERO)],
                 ["--recipe", "hetero-2xa100-2xa30-llama2-7b"]):
        args = pr.parse_args(argv + ["--arms", "astro/round_robin", "--time-scale", "0.5"])
        assert args.instances == 4 and args.profiles == HETERO and args.profile == ",".join(HETERO)
        assert [s.profile for s in instance_specs(args.fleet_cfg)] == HETERO
        assert args.fleet_cfg.predictor.in_process is False and args.fleet_cfg.internal_token is False
        assert {s.engine.time_scale for s in instance_specs(args.fleet_cfg)} == {0.5}
    meta = {"instances": 4, "profile": args.profile, "profiles": HETERO}
    assert pr.fleet_text(meta) == "2 × sim `llama-2-7b-a100` + 2 × sim `llama-2-7b-a30`"
    assert pr.fleet_text({"instances": 4, "profile": "p"}) == "4 × sim `p`"  # an older JSON
    one = pr.parse_args(["--arms", "astro/round_robin"])
    assert one.instances == 4 and one.profiles == ["llama-2-7b-a30"] * 4 and one.profile == "llama-2-7b-a30"
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        pr.parse_args(["--instances", "4", "--profile", ",".join(HETERO[:2]), "--arms", "astro/round_robin"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--profile lists 2 profiles for 4 instances" in err


def _worker_sigterm_is_default(_: int) -> bool:
    import signal

    return signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_load_generator_pool_workers_die_on_sigterm_and_stop_without_hanging() -> None:
    """The harness installs SIGTERM → KeyboardInterrupt in itself; its forked client workers
    must not inherit it (a worker killed inside the queue lock hung `Pool.terminate`)."""
    import multiprocessing as mp
    import signal
    import time

    old = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        pool = mp.get_context("fork").Pool(3, initializer=pr._client_worker_init)
        assert pool.map(_worker_sigterm_is_default, range(6)) == [True] * 6
        workers = list(pool._pool)
        t0 = time.monotonic()
        pr.stop_pool(pool, timeout_s=10.0)
        assert time.monotonic() - t0 < 10.0
        assert not any(w.is_alive() for w in workers)
    finally:
        signal.signal(signal.SIGTERM, old)


@pytest.mark.slow
@pytest.mark.skipif(data_dir() is None, reason="needs ../shared/data (developer machines and CI)")
def test_tiny_fleet_every_request_accounted_for_and_identical_across_arms(tmp_path: Path) -> None:
    arms = ["astro/round_robin", "astro/power_of_k"]
    if pr.peer_binary("vllm-router"):
        arms.append("vllm-router/round_robin")
    n = 6
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--instances", "2", "-n", str(n), "--loads", "0.4", "--capacity-requests", "60",
         "--repeats", "2",
         "--time-scale", "0.1", "--max-lag-s", "30", "--run-timeout-s", "120",
         "--max-send-delay-s", "1000", "--arms", ",".join(arms), "--out", str(out)],
        capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    doc = json.loads((out / "peer_routers.json").read_text())
    assert doc["complete"] is True and doc["fleet_starts"] == 1
    # the load point is the asked fraction of the same fleet's virtual SLO capacity
    assert doc["capacity"]["goal"] == "P99 ttft ≤ 10 s" and doc["capacity"]["capacity_rps"] > 0
    assert doc["rates_rps"] == [pytest.approx(0.4 * doc["capacity"]["capacity_rps"])]
    load = f"| 40% ({doc['rates_rps'][0]:.3g} req/s) |"
    runs = doc["runs"]
    assert sorted((r["repeat"], r["arm"]) for r in runs) == sorted((rep, a) for rep in (0, 1) for a in arms)
    for rep in (0, 1):
        wl = load_workload("sharegpt", WorkloadOptions(num_requests=n), np.random.default_rng(rep))
        ids = [q.request_id for q in wl.requests]
        mine = [r for r in runs if r["repeat"] == rep]
        assert len({r["digest"] for r in mine}) == 1  # the identical request list in every arm
        for r in mine:
            assert r["status"] == "ok", r.get("reason")
            assert r["request_ids"] == ids and r["completed"] == n and r["failed"] == 0
            assert r["length_mismatches"] == 0  # every reply streamed exactly its true length
            # the engines' own counters: every request reached exactly one engine
            assert sum(r["served_per_engine"]) == n
            assert 0 < r["ttft_mean_s"] <= r["ttft_p99_s"] and r["e2e_mean_s"] > r["ttft_mean_s"]
            # the engines' own view starts at arrival at the engine, after the client's send (its
            # TTFT may dip below 0: a step that catches up on a late loop can end before an arrival)
            assert r["engine_ttft_mean_s"] < r["engine_e2e_mean_s"] <= r["e2e_mean_s"]
            if r["arm"].endswith("round_robin"):
                assert r["served_per_engine"] == [n / 2, n / 2]
            # every reply's tokens went through the front door, which used some CPU for them
            wl_tokens = sum(q.output_tokens for q in wl.requests)
            assert r["tokens_relayed"] == wl_tokens and r["router_cpu_s"] > 0
            assert r["router_cpu_ms_per_token"] == pytest.approx(1e3 * r["router_cpu_s"] / wl_tokens)
            if r["router"] == "astro":  # its own decision record for each request (+ the warm-up's)
                dc = r["decision_cost"]
                assert dc["all_n"] >= n and dc["refused_n"] == 0 and dc["refused_decide_ms_p99"] is None
                assert 0 < dc["all_decide_ms_p50"] <= dc["all_decide_ms_p99"] <= dc["all_decide_ms_max"]
                assert dc["all_decide_ms_p50"] <= dc["all_overhead_ms_p50"]  # the decision is part of it
                assert 0 <= dc["all_tag_wait_ms_p50"] <= dc["all_tag_wait_ms_max"]
            else:
                assert "decision_cost" not in r
    assert {r["digest"] for r in runs if r["repeat"] == 0} != {r["digest"] for r in runs if r["repeat"] == 1}
    md = (out / "peer_routers.md").read_text()
    for a in arms:
        assert f"{load} `{a}` |" in md
    assert f"{load} `astro/power_of_k` | predicted | 2/2 |" in md
    again = subprocess.run([sys.executable, str(SCRIPT), "--from-json", str(out / "peer_routers.json")],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stdout == md  # the table re-renders from the JSON alone


def test_reset_prefix_caches_empties_a_drained_engines_cache() -> None:
    """--prefix-cache: before each run the harness resets every drained engine's cache, so
    the next arm's first request hits nothing (vllm:prefix_cache_hits_total stays put)."""
    import httpx

    from rps_astro_cli.engine import sim_server
    from rps_astro_cli.engine.sim_engine import SimEngine
    from rps_astro_cli.protocol.http_server import ServerThread
    from rps_astro_cli.sim.profile import load_profile

    body = {"prompt": "abcd " * 40, "max_tokens": 2, "ignore_eos": True}

    def hits(url: str) -> float:
        text = httpx.get(url + "/metrics").text
        return sum(float(line.split()[-1]) for line in text.splitlines()
                   if line.startswith("vllm:prefix_cache_hits_total"))

    with ServerThread(sim_server.create_app(SimEngine(load_profile("llama-2-7b-a30"), time_scale=0.01))) as srv:
        for _ in range(2):
            assert httpx.post(srv.url + "/v1/completions", json=body, timeout=30).status_code == 200
        before = hits(srv.url)
        assert before == 32  # the second send hit 2 full 16-token blocks of 40 tokens
        pr.reset_prefix_caches([srv.url])
        assert httpx.post(srv.url + "/v1/completions", json=body, timeout=30).status_code == 200
        assert hits(srv.url) == before


# -- multi-turn sessions (issue 14) ------------------------------------------------------------

def _turn(sid: str, t: int, think: float = 0.0, p: int = 10) -> BenchRequest:
    return BenchRequest(f"s{sid}-t{t}", "x", p, 3, session_id=sid, turn=t, think_s=think)


def test_split_parts_keeps_each_session_in_one_process_with_its_start_time() -> None:
    reqs = [_turn("a", 0), _turn("a", 1), _turn("b", 0), _turn("c", 0), _turn("b", 1), _turn("c", 1), _turn("a", 2)]
    times = [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    # sessions start in the order a, b, c: a → process 0 (time 0), b → 1 (time 1), c → 0 (time 2)
    assert pr.split_parts(reqs, times, 2) == [([0, 1, 3, 5, 6], [0.0, 2.0]), ([2, 4], [1.0])]
    # without sessions: request i from process i mod P at its own time (as before)
    flat = [BenchRequest(f"r{i}", "x", 1, 1) for i in range(5)]
    assert pr.split_parts(flat, [0.0, 1.0, 2.0, 3.0, 4.0], 2) == [([0, 2, 4], [0.0, 2.0, 4.0]), ([1, 3], [1.0, 3.0])]
    with pytest.raises(ValueError, match="no turn 0"):
        pr.split_parts([_turn("a", 0), _turn("z", 1)], [0.0, 1.0], 2)


def test_first_sessions_takes_whole_sessions_in_start_order() -> None:
    reqs = [_turn("a", 0), _turn("b", 0), _turn("a", 1), _turn("c", 0), _turn("b", 1)]
    assert [q.request_id for q in pr.first_sessions(reqs, 2)] == ["sa-t0", "sb-t0", "sa-t1", "sb-t1"]


def test_session_metrics_later_turns_closed_loop_slack_and_hit_rate() -> None:
    from rps_astro_cli.bench.records import RequestRecord

    reqs = [_turn("a", 0), _turn("a", 1, think=0.5), _turn("b", 0)]

    def rec(q, sent, first, fin):
        return RequestRecord(request_id=q.request_id, modality="text", req_class="sand", prompt_tokens=10,
                             expected_output_tokens=3, scheduled_s=sent, sent_s=sent, first_token_s=first,
                             finish_s=fin, success=True)

    recs = [rec(reqs[0], 0.0, 0.2, 1.0), rec(reqs[1], 1.6, 1.9, 2.5), rec(reqs[2], 0.1, 0.4, 0.9)]
    before = [{"vllm:prefix_cache_queries_total": 100.0, "vllm:prefix_cache_hits_total": 10.0}, None]
    after = [{"vllm:prefix_cache_queries_total": 300.0, "vllm:prefix_cache_hits_total": 60.0}, None]
    m = pr.session_metrics(reqs, recs, before, after)
    assert m["later_turns"] == 1 and m["ttft_later_mean_s"] == pytest.approx(0.3)
    assert m["closed_loop_slack_min_s"] == pytest.approx(0.1)  # sent 1.6 = end 1.0 + think 0.5 + 0.1
    # (60 − 10) hit tokens of (300 − 100) queried
    assert m["prefix_cache_hits_tokens"] == 50 and m["prefix_hit_rate"] == pytest.approx(0.25)


def test_multi_turn_flags_are_checked(capsys) -> None:
    for argv, msg in ((["--sessions", "3"], "--sessions / --think-time: only with --multi-turn"),
                      (["--multi-turn", "-w", "synthetic"], "--multi-turn: replays ShareGPT conversations"),
                      (["--multi-turn", "--think-time", "-1"], "--think-time: must be ≥ 0")):
        with pytest.raises(SystemExit) as exc:  # an astro arm: the default arms need `.[peers]`
            pr.parse_args(argv + ["--arms", "astro/round_robin"])
        assert exc.value.code == 2
        assert msg in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(data_dir() is None, reason="needs ../shared/data (developer machines and CI)")
def test_tiny_fleet_multi_turn_hits_exactly_the_previous_turns_full_blocks(tmp_path: Path) -> None:
    """One engine, prefix caching on, 4 ShareGPT sessions closed loop from 2 client
    processes: every arm sends every turn after its previous reply + think time, and the
    engine's hit tokens are exactly Σ over turns ≥ 2 of the previous turn's prompt in full
    16-token blocks (its prompt is a prefix of this one; the sim engine's generated tokens
    are not the reply's, so only prompt blocks hit) — for the second arm too, so the
    harness's cache reset between runs left nothing of the first arm behind."""
    arms = ["astro/cache_aware", "vllm-router/cache_aware" if pr.peer_binary("vllm-router") else "astro/round_robin"]
    out = tmp_path / "out"
    flags = ["--multi-turn", "--sessions", "4", "--think-time", "0.5", "--max-total-tokens", "4096"]
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--instances", "1", *flags, "--prefix-cache", "--rates", "0.5",
         "--repeats", "1", "--time-scale", "0.1", "--max-lag-s", "30", "--run-timeout-s", "120",
         "--client-procs", "2", "--arms", ",".join(arms), "--out", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    args = pr.parse_args(flags + ["--rates", "0.5", "--arms", ",".join(arms)])
    wl = pr.first_sessions(load_workload("sharegpt", pr.workload_options(args), np.random.default_rng(0)).requests, 4)
    later = [q for q in wl if q.turn >= 1]
    assert len({q.session_id for q in wl}) == 4 and later  # the sample has later turns to hit
    prompt = {(q.session_id, q.turn): q.prompt_tokens for q in wl}
    want_hits = sum(16 * (prompt[(q.session_id, q.turn - 1)] // 16) for q in later)
    doc = json.loads((out / "peer_routers.json").read_text())
    assert [r["arm"] for r in doc["runs"]] == arms and len({r["digest"] for r in doc["runs"]}) == 1
    for r in doc["runs"]:
        assert r["status"] == "ok", r.get("reason")
        assert r["request_ids"] == [q.request_id for q in wl] and r["completed"] == len(wl)
        assert r["later_turns"] == len(later) and r["closed_loop_slack_min_s"] >= -1e-6
        assert r["prefix_cache_hits_tokens"] == want_hits
        assert r["prefix_hit_rate"] == pytest.approx(want_hits / r["prefix_cache_queries_tokens"])
    md = (out / "peer_routers.md").read_text()
    assert "4 sessions/run" in md and f"| 0.5 sessions/s | `{arms[0]}` | none | 1/1 |" in md
    again = subprocess.run([sys.executable, str(SCRIPT), "--from-json", str(out / "peer_routers.json")],
                           capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stdout == md


# -- per-request SLO classes and goodput (issue 33's live acceptance) ----------------------------

SLO_SPECS = ["interactive:ttft_ms=1000,tpot_ms=100,share=0.7,priority=0", "batch:ttft_ms=30000,share=0.3,priority=1"]


def test_the_script_under_test_is_this_checkout() -> None:
    # the venv's editable install points at another checkout's src/; the harness must be this one's
    assert Path(pr.__file__).resolve() == SCRIPT


def test_slo_classes_drawn_by_share_hand_checked_and_identical_for_every_arm() -> None:
    from rps_astro_cli.bench.client import _prepare
    from rps_astro_cli.bench.slo import parse_slo_classes

    classes = parse_slo_classes(["interactive:ttft_ms=1000,tpot_ms=100,share=0.7,priority=0",
                                 "batch:ttft_ms=30000,share=0.2,priority=1"])
    reqs = [BenchRequest(f"r{i}", "hello", 3, 5) for i in range(10)]
    got = pr.slo_assignment(reqs, classes, seed=5)
    # default_rng([5, 33]).random(10) = .151 .267 .913 .549 .764 .941 .449 .382 .887 .947;
    # edges 0.7 (interactive), 0.9 (batch), above: no class
    want = ["interactive", "interactive", None, "interactive", "batch", None, "interactive", "interactive",
            "batch", None]
    assert [got[q.request_id].name if q.request_id in got else None for q in reqs] == want
    assert pr.slo_assignment(reqs, classes, seed=5) == got  # a repeat's seed alone decides
    assert pr.slo_assignment(reqs, classes, seed=6) != got
    # every arm sends each request the same class: the same headers and priority, whatever the router
    arms = [pr.ARMS[a] for a in ("astro/power_of_k-local", "astro/power_of_k-local-queue",
                                 "vllm-router/power_of_two", "sglang-router/cache_aware")]
    for q in reqs:
        seen = []
        for arm in arms:
            _, body, headers, rec, _ = _prepare(q, pr.client_opts(arm, "http://x", "m", 5.0, got), 0.0)
            seen.append(({k: v for k, v in headers.items() if k.startswith("x-slo")},
                         json.loads(body).get("priority"), rec.slo_class, rec.slo_ttft_s, rec.slo_tpot_s))
        assert all(s == seen[0] for s in seen)
        c = got.get(q.request_id)
        if c is None:
            assert seen[0] == ({}, None, None, None, None)
        elif c.name == "interactive":
            assert seen[0] == ({"x-slo-class": "interactive", "x-slo-ttft-ms": "1000", "x-slo-tpot-ms": "100"},
                               0, "interactive", 1.0, 0.1)
        else:
            assert seen[0] == ({"x-slo-class": "batch", "x-slo-ttft-ms": "30000"}, 1, "batch", 30.0, None)
    # the shares hold on a large list (70 / 30 %)
    big = pr.slo_assignment([BenchRequest(f"q{i}", "x", 1, 1) for i in range(4000)],
                            parse_slo_classes(SLO_SPECS), seed=0)
    assert len(big) == 4000
    assert abs(sum(c.name == "interactive" for c in big.values()) / 4000 - 0.7) < 0.03


def _slo_rec(rid: str, cls: str | None, sent: float, first: float | None, fin: float, n: int, *,
             ok: bool = True, refused: bool = False, error: str | None = None):
    from rps_astro_cli.bench.records import RequestRecord

    ttft, tpot = {"interactive": (1.0, 0.1), "batch": (30.0, None), None: (None, None)}[cls]
    return RequestRecord(request_id=rid, prompt_tokens=10, output_tokens=n if ok else 0, expected_output_tokens=n,
                         scheduled_s=sent, sent_s=sent, first_token_s=first, finish_s=fin, success=ok,
                         refused=refused, error=error, slo_class=cls, slo_ttft_s=ttft, slo_tpot_s=tpot)


def test_goodput_of_hand_built_records_met_late_refused_and_cut() -> None:
    recs = [
        _slo_rec("met", "interactive", 0.0, 0.5, 2.3, 21),  # TTFT 0.5 s, TPOT 1.8 / 20 = 0.09 s: met
        _slo_rec("late", "interactive", 1.0, 2.5, 3.0, 6),  # TTFT 1.5 s > 1 s
        _slo_rec("slow", "interactive", 2.0, 2.2, 6.2, 21),  # TPOT 4.0 / 20 = 0.2 s > 0.1 s
        _slo_rec("refused", "batch", 3.0, None, 3.01, 9, ok=False, refused=True, error="HTTP 429: slo"),
        _slo_rec("batch", "batch", 4.0, 20.0, 30.0, 50),  # TTFT 16 s ≤ 30 s, no TPOT target: met
        _slo_rec("cut", "batch", 5.0, 40.0, 305.0, 9, ok=False,
                 error=f"{pr.TIMED_OUT} --request-timeout 300 s of being sent"),
        _slo_rec("plain", None, 6.0, 6.5, 7.0, 3),  # no class: in T and the window, in no SLO count
    ]
    m = pr.slo_metrics(recs, ["interactive", "batch"])
    # T = last finish − first send = 305 − 0; window = last − first scheduled send = 6 − 0; met: 2 of 6
    assert m["met"] == 2 and m["slo_requests"] == 6 and m["requests_without_class"] == 1
    assert m["goodput_rps"] == pytest.approx(2 / 305.0)
    assert m["goodput_window_rps"] == pytest.approx(2 / 6.0)
    assert m["slo_attainment"] == pytest.approx(2 / 6)
    assert (m["refused"], m["cut"], m["slo_errors"]) == (1, 1, 0)
    assert m["refused_share"] == pytest.approx(1 / 6) and m["cut_share"] == pytest.approx(1 / 6)
    i, b = m["slo_classes"]["interactive"], m["slo_classes"]["batch"]
    assert list(m["slo_classes"]) == ["interactive", "batch"]
    assert (i["requests"], i["met"], i["refused"], i["cut"]) == (3, 1, 0, 0)
    assert i["slo_attainment"] == pytest.approx(1 / 3) and i["goodput_rps"] == pytest.approx(1 / 305.0)
    assert (b["requests"], b["met"], b["refused"], b["cut"]) == (3, 1, 1, 1)
    assert b["goodput_window_rps"] == pytest.approx(1 / 6.0)
    assert pr.slo_metrics([_slo_rec("plain", None, 0.0, 0.1, 1.0, 3)]) == {}  # no class: no SLO figures


def test_goodput_summary_pairs_each_peer_by_repeat_and_renders_the_table() -> None:
    a = pr.ARMS["astro/power_of_k-local"]
    v, s = pr.ARMS["vllm-router/power_of_two"], pr.ARMS["sglang-router/cache_aware"]

    def run(arm, rep, good, window, status="ok"):
        return {"arm": arm, "repeat": rep, "load_index": 0, "status": status, "ttft_p99_s": 1.0,
                "goodput_rps": good, "goodput_window_rps": window, "slo_attainment": 0.5, "refused_share": 0.1,
                "cut_share": 0.0, "reason": "lag",
                "slo_classes": {"interactive": {"slo_attainment": 0.8}, "batch": {"slo_attainment": 0.2}}}

    runs = [run(a.name, 0, 6.0, 8.0), run(a.name, 1, 9.0, 9.0), run(a.name, 2, 4.0, 4.0),
            run(v.name, 0, 3.0, 4.0), run(v.name, 1, 3.0, 3.0), run(v.name, 2, 2.0, 1.0, "rejected"),
            run(s.name, 0, 2.0, 2.0), run(s.name, 1, 6.0, 6.0), run(s.name, 2, 4.0, 2.0)]
    rows = {r["arm"]: r for r in pr.summarize(runs, [a, v, s], [9.0], a.name)}
    ra = rows[a.name]
    assert ra["admission"] == "reject" and rows[v.name]["admission"] == "none"
    assert ra["goodput_rps"] == {"median": 6.0, "min": 4.0, "max": 9.0, "n": 3}
    # ÷ vllm-router in repeats 0 and 1 (its repeat 2 was rejected): 6/3, 9/3
    assert ra["goodput_vs"][v.name] == {"median": 2.5, "min": 2.0, "max": 3.0, "n": 2}
    assert ra["goodput_window_vs"][v.name] == {"median": 2.5, "min": 2.0, "max": 3.0, "n": 2}
    # ÷ sglang-router: 6/2, 9/6, 4/4 → 3, 1.5, 1 (window: 8/2, 9/6, 4/2 → 4, 1.5, 2)
    assert ra["goodput_vs"][s.name] == {"median": 1.5, "min": 1.0, "max": 3.0, "n": 3}
    assert ra["class_attainment"]["interactive"]["median"] == 0.8
    meta = {"instances": 4, "profile": "p", "time_scale": 1.0, "workload": "sharegpt", "num_requests": 9,
            "repeats": 3, "seed": 0, "slo_classes": pr.slo_classes_meta(SLO_SPECS), "request_deadline_s": 300.0}
    md = pr.markdown(list(rows.values()), [1.2], a.name, meta)
    assert "`interactive` 70% (TTFT ≤ 1000 ms, TPOT ≤ 100 ms, priority 0)" in md
    assert "cut ones (not finished 300 engine s after being sent)" in md
    assert ("| load | arm | admission | runs ok | goodput (req/s) | goodput, window (req/s) | attainment | "
            "`interactive` attainment | `batch` attainment | refused | cut | "
            "× `vllm-router/power_of_two` (T; window) | × `sglang-router/cache_aware` (T; window) |") in md
    assert ("| 120% (9 req/s) | `astro/power_of_k-local` | reject | 3/3 | 6 [4–9] | 8 [4–9] | 50% [50%–50%] | "
            "80% [80%–80%] | 20% [20%–20%] | 10% [10%–10%] | 0% [0%–0%] | 2.50 [2.00–3.00]; 2.50 [2.00–3.00] | "
            "1.50 [1.00–3.00]; 2.00 [1.50–4.00] |") in md
    assert "| 120% (9 req/s) | `vllm-router/power_of_two` | none | 2/3 |" in md
    # without classes the latency table alone, as before
    plain = pr.summarize([{k: v for k, v in r.items() if k == "arm" or k in ("repeat", "load_index", "status",
                                                                                 "ttft_p99_s")} for r in runs],
                         [a, v, s], [9.0], a.name)
    assert "goodput_rps" not in plain[0]
    assert "goodput" not in pr.markdown(plain, [1.2], a.name, {**meta, "slo_classes": []})


def test_slo_flags_are_checked_and_default_the_deadline(capsys) -> None:
    args = pr.parse_args(["--arms", "astro/power_of_k-local", *sum((["--slo-class", s] for s in SLO_SPECS), [])])
    assert [c.name for c in args.slo_classes] == ["interactive", "batch"]
    assert args.request_timeout_s == pr.DEFAULT_SLO_DEADLINE_S
    assert pr.parse_args(["--arms", "astro/round_robin"]).slo_classes == []
    # the ablation is opt-in (--skip-missing: a venv without the peers extra parses the default too)
    assert "astro/power_of_k-local-queue" not in pr.parse_args(["--skip-missing"]).arms.split(",")
    for argv, msg in ((["--slo-class", "x:ttft_ms=1000,share=1.5"], "--slo-class"),
                      (["--slo-class", SLO_SPECS[0], "--slo-class", SLO_SPECS[0]], "given twice"),
                      (["--request-timeout-s", "60"], "--request-timeout-s: only with --slo-class"),
                      (["--slo-class", SLO_SPECS[0], "--request-timeout-s", "0"], "--request-timeout-s: must be > 0"),
                      (["--slo-class", SLO_SPECS[0], "--multi-turn"], "--slo-class: not with --multi-turn")):
        with pytest.raises(SystemExit) as exc:
            pr.parse_args(argv + ["--arms", "astro/round_robin"])
        assert exc.value.code == 2
        assert msg in capsys.readouterr().err


def test_main_gives_every_arm_of_a_repeat_the_same_classes_and_the_deadline(tmp_path: Path, monkeypatch) -> None:
    """main's plumbing without processes: a stand-in fleet and run_one record what each run got."""
    seen = []

    class FakeFleet:
        def __init__(self, *a, **k):
            self.starts, self.pins = 0, {}

        def start(self):
            self.starts += 1

        def stop(self):
            pass

        restart = start

    def fake_run_one(arm, fleet, requests, times_s, **kw):
        seen.append((kw["seed"], arm.name, [q.request_id for q in requests], kw))
        return {"arm": arm.name, "status": "ok", "ttft_p99_s": 1.0, "num_requests": len(requests)}

    monkeypatch.setattr(pr, "Fleet", FakeFleet)
    monkeypatch.setattr(pr, "run_one", fake_run_one)
    arms = ["astro/power_of_k-local", "astro/power_of_k-local-queue", "astro/round_robin"]
    argv = ["-w", "synthetic", "-n", "40", "--rates", "2,3", "--repeats", "2", "--client-procs", "1",
            "--arms", ",".join(arms), "--out", str(tmp_path), "--request-timeout-s", "120",
            *sum((["--slo-class", s] for s in SLO_SPECS), [])]
    assert pr.main(argv) == 0
    assert len(seen) == 2 * 2 * 3
    for rep in (0, 1):
        mine = [s for s in seen if s[0] == rep]
        assert len(mine) == 6 and all(s[3]["deadline_s"] == 120.0 for s in mine)
        assert all(s[3]["class_names"] == ["interactive", "batch"] for s in mine)
        slo_of = mine[0][3]["slo_of"]
        assert all(s[3]["slo_of"] == slo_of for s in mine)  # every arm and load of the repeat
        assert set(slo_of) == set(mine[0][2]) and {c.name for c in slo_of.values()} == {"interactive", "batch"}
    assert seen[0][3]["slo_of"] != [s for s in seen if s[0] == 1][0][3]["slo_of"]  # repeats differ
    doc = json.loads((tmp_path / "peer_routers.json").read_text())
    assert doc["config"]["slo_class"] == SLO_SPECS and doc["config"]["request_timeout_s"] == 120.0


def test_astro_arms_get_the_admission_flags_and_the_fleet_time_scale(tmp_path: Path, monkeypatch) -> None:
    cmds = []

    class FakePopen:
        def __init__(self, cmd, **kw):
            cmds.append(cmd)

    monkeypatch.setattr(pr.subprocess, "Popen", FakePopen)
    fleet = {"instances": [{"engine_url": "http://e0", "predictor_url": "http://p0", "profile": "p"}],
             "profile": "p", "time_scale": 0.5}
    for name in ("astro/power_of_k-local", "astro/power_of_k-local-queue", "astro/power_of_k-local-off"):
        pr.Router(pr.ARMS[name], fleet, tmp_path / "r.log", 0)
    local, queue, off = cmds
    assert "--admission" not in local and pr.admission_of(pr.ARMS["astro/power_of_k-local"]) == "reject"
    assert queue[queue.index("--admission") + 1] == "queue" and off[off.index("--admission") + 1] == "off"
    assert all(c[c.index("--time-scale") + 1] == "0.5" and "--predict-in-process" in c for c in cmds)
    pr.Router(pr.ARMS["astro/power_of_k"], {**fleet, "time_scale": 1.0}, tmp_path / "r.log", 0)
    assert "--time-scale" not in cmds[-1]
    # with a tagger service: every arm asks it but the in-process tagging ones
    tagged = {**fleet, "tagger": {"url": "http://t0"}}
    for name in ("astro/power_of_k-local", "astro/power_of_k-inproc"):
        pr.Router(pr.ARMS[name], tagged, tmp_path / "r.log", 0)
    local, inproc = cmds[-2:]
    assert local[local.index("--tagger") + 1] == "http://t0" and "--tagger" not in inproc
    assert "--predict-in-process" not in inproc


def test_tree_cpu_s_counts_a_childs_cpu_seconds() -> None:
    """A shell whose child burns 0.4 s of CPU (its own process_time) and then sleeps: the
    tree's CPU seconds, read from /proc, hold that child's ~0.4 s; an exited pid is 0."""
    burn = ("import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4:\n    pass\n"
            "print('done', flush=True)\ntime.sleep(30)")
    sh = subprocess.Popen(["sh", "-c", f"{sys.executable} -c \"$0\"; sleep 30", burn],
                          stdout=subprocess.PIPE, text=True)
    try:
        assert sh.stdout is not None and sh.stdout.readline().strip() == "done"
        used = pr.tree_cpu_s([sh.pid])
        assert 0.38 <= used <= 0.4 + 0.3  # the child's burn, + interpreter start-up
    finally:
        for p in reversed(pr.process_tree(sh.pid)):
            subprocess.run(["kill", str(p)], check=False)
        sh.wait(10)
    assert pr.tree_cpu_s([sh.pid]) == 0.0


def test_an_arm_of_another_build_runs_from_its_source_tree(tmp_path) -> None:
    # NAME@SRC: the astro arm NAME, its scheduler on PYTHONPATH=SRC (an A/B of two builds)
    src = tmp_path / "src"
    (src / "rps_astro_cli").mkdir(parents=True)
    (src / "rps_astro_cli" / "__init__.py").write_text("")
    arm = pr.arm_of(f"astro/power_of_k-local@{src}")
    assert arm.name == f"astro/power_of_k-local@{src}" and arm.src == str(src.resolve())
    assert arm.args == pr.ARMS["astro/power_of_k-local"].args and pr.ARMS["astro/power_of_k-local"].src is None
    assert pr.arm_of("astro/llumnix") is pr.ARMS["astro/llumnix"]
    with pytest.raises(pr.HarnessError, match="no rps_astro_cli package"):
        pr.arm_of(f"astro/llumnix@{tmp_path}")
    with pytest.raises(pr.HarnessError, match="only an astro arm"):
        pr.arm_of(f"vllm-router/power_of_two@{src}")
    with pytest.raises(KeyError):
        pr.arm_of("astro/nope@/tmp")
