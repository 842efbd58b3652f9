"""SLO capacity must only count rates that reached steady state (not an absorbed burst)."""

from __future__ import annotations

import json

import pytest

from rps_astro_cli.bench.capacity import CapacityGoal, search_capacity, steady_state
from rps_astro_cli.bench.records import RequestRecord


def _rec(i: int, arrival: float, finish: float) -> RequestRecord:
    return RequestRecord(str(i), scheduled_s=arrival, sent_s=arrival, first_token_s=arrival + 0.1,
                         finish_s=finish, success=True, output_tokens=2)


def test_steady_state_hand_computed():
    # 10 arrivals at 0..9 s, each done 0.5 s later: window 9 s, second half (4.5, 9]:
    # arrivals 5..9 → 5 / 4.5 s; completions at 5.5..8.5 → 4 / 4.5 s; 4/5 = 0.8 ≥ 0.8 → steady
    st = steady_state([_rec(i, i, i + 0.5) for i in range(10)])
    assert st.window_s == 9 and st.offered_rps == pytest.approx(5 / 4.5)
    assert st.achieved_rps == pytest.approx(4 / 4.5) and st.steady
    assert st.mean_e2e_s == pytest.approx(0.5) and not st.short  # 9 s ≥ 10 × 0.5 s
    # the same arrivals absorbed as a burst: all finish at 20..29 s → 0 completions in (4.5, 9]
    burst = steady_state([_rec(i, i, 20 + i) for i in range(10)])
    assert burst.achieved_rps == 0 and not burst.steady
    assert burst.mean_e2e_s == pytest.approx(20) and burst.short  # 9 s < 10 × 20 s


def test_search_fails_an_unsteady_rate_that_meets_the_latency_goal():
    # latency always meets the goal, but only rates ≤ 10 are steady
    res = search_capacity(lambda r: (0.5, r <= 10), CapacityGoal(threshold_s=1.0), start_rps=4, tolerance=0.01)
    assert 10 * 0.99 <= res.capacity_rps <= 10
    assert "not steady at" in res.note and "16 req/s" in res.note


PROFILE = {"profile_id": "hand", "model": "m", "gpu": "g", "tp": 1,
           "coefficients": {"base_s": 0.010, "per_seq_s": 0.0, "token_knots": [0, 10000], "token_s": [0.0, 1.0],
                            "decode_attn_s_per_ctx_token": 0.0, "prefill_attn_s_per_token_pair": 0.0},
           "limits": {"block_size": 16, "num_gpu_blocks": 4096, "max_num_seqs": 64,
                      "max_num_batched_tokens": 512, "max_model_len": 4096}}


def test_burst_that_fits_the_batch_is_not_capacity(tmp_path):
    from rps_astro_cli.bench.config import BenchConfig
    from rps_astro_cli.bench.runner import run_bench

    prof = tmp_path / "hand.json"
    prof.write_text(json.dumps(PROFILE))
    # 30 requests of 100 prompt + 300 output tokens fit one instance's 64 slots at once.
    trace = tmp_path / "lt.csv"
    trace.write_text("num_prefill_tokens,num_decode_tokens\n" + "100,300\n" * 30)
    # Decode of 30 sequences: a step is 10 ms + 30 × 0.1 ms = 13 ms for 30 tokens, so one
    # request needs ≥ 300 × 13 ms = 3.9 s and the instance completes ≤ 30 / 3.9 s ≈ 7.7 req/s.
    # TTFT stays ≤ 30 × 100 tokens / 512 per step ≈ 6 steps × 61 ms ≈ 0.4 s < 2 s at any rate,
    # so without the steady-state rule every rate up to 256 req/s "met" the goal.
    res = run_bench(BenchConfig.flat(virtual=True, profile=str(prof), instances=1, workload="length-trace",
                                path=str(trace), num_requests=30, policies=["round_robin"], oracle_lengths=True,
                                capacity=True, capacity_threshold_s=2.0, capacity_start_rps=4))
    cap = res.capacity[0]
    assert cap.capacity_rps is not None and cap.capacity_rps < 10
    assert "not steady" in cap.note and cap.interpolated_rps is None  # no latency crossing to interpolate
    assert any("too short to show steady state" in w for w in res.warnings)
    # every probe of 30 requests is short (arrivals over < 10 s, mean E2E ≥ 3.9 s): the
    # capacity found is one of them, so its note says it is provisional, with the -n that
    # would span 10 mean E2Es at the highest passing rate
    assert "Provisional" in cap.note and "raise -n to at least" in cap.note, cap.note
    need = int(cap.note.rsplit("at least ", 1)[1].rstrip("."))
    assert need >= cap.capacity_rps * 10 * 3.9 and need % 100 == 0, need


def test_requests_for_steady_state():
    from rps_astro_cli.bench.capacity import requests_for_steady_state

    assert requests_for_steady_state(14.0, 9.0) == 1300  # 14 req/s × 10 × 9 s = 1,260 → 1,300
    assert requests_for_steady_state(2.0, 5.0) == 100  # exactly 100
    assert requests_for_steady_state(0.5, 1.0) == 100  # never fewer than 100


def test_capacity_notes_name_real_flags():
    import re

    import rps_astro_cli.cli.bench as cli_bench

    src = open(cli_bench.__file__).read()
    flags = set(re.findall(r'typer\.Option\("(--[a-z-]+)"', src))
    up = search_capacity(lambda r: 0.1, CapacityGoal(threshold_s=1.0), start_rps=4, max_rps=16)
    down = search_capacity(lambda r: 5.0, CapacityGoal(threshold_s=1.0), start_rps=4, min_rps=1)
    assert "16 req/s" in up.note and "1 req/s" in down.note
    for note in (up.note, down.note):
        named = set(re.findall(r"--[a-z-]+", note))
        assert named <= flags, f"{note!r} names unknown flags {named - flags}"
    assert "--capacity-max-rate" in up.note
