"""The look-ahead's conditional remaining length (`sim/remaining.py`, issue 13 §2):
hand-computed conditional means/quantiles, and a hand-computed look-ahead that uses it."""

from __future__ import annotations

import json

import pytest

from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.sim.fcfs import FCFSPolicy
from rps_astro_cli.sim.instance import InstanceSim
from rps_astro_cli.sim.latency import LatencyModel
from rps_astro_cli.sim.lookahead import predict_instance
from rps_astro_cli.sim.profile import ExecutionProfile
from rps_astro_cli.sim.remaining import RemainingLength, equal_probability_atoms, load_remaining
from rps_astro_cli.sim.request import SimRequest
from rps_astro_cli.types import CandidateRequest, InstanceConfig

RATIO = RemainingLength("ratio", (2.0, 0.5, 4.0, 1.0))  # unsorted on purpose


def test_conditional_mean_given_longer_than_g() -> None:
    # predicted 100 → atoms 50, 100, 200, 400 (each probability 1/4)
    assert RATIO.expected_total(100, 0) == 188  # (50 + 100 + 200 + 400) / 4 = 187.5 → ceil
    assert RATIO.expected_total(100, 60) == 234  # L > 60: (100 + 200 + 400) / 3 = 233.3…
    assert RATIO.expected_total(100, 100) == 300  # L > 100 rules out the atom at 100: (200 + 400) / 2
    assert RATIO.expected_total(100, 150, cap=250) == 225  # (min(200, 250) + min(400, 250)) / 2
    assert RATIO.expected_total(100, 400) == 410  # past the last atom: g + 10 (auto-extension)
    assert RATIO.expected_total(100, 400, cap=405) == 405
    assert RATIO.expected_total(None, 0) == 480  # no prediction → 256 × (0.5+1+2+4)/4 = 480


def test_conditional_quantiles_and_empirical_kind() -> None:
    q50, q90 = RATIO.with_statistic("q50"), RATIO.with_statistic("q90")
    # L > 120 leaves atoms 200, 400: q50 → rank ceil(0.5·2) = 1st → 200; q90 → ceil(1.8) = 2nd → 400
    assert q50.expected_total(100, 120) == 200
    assert q90.expected_total(100, 120) == 400
    emp = RemainingLength("empirical", (10, 20, 30, 40))  # tokens; the prediction is ignored
    assert emp.expected_total(999, 15) == 30  # (20 + 30 + 40) / 3
    assert emp.expected_total(1, 0) == 25


def test_bad_tables_are_user_errors(tmp_path) -> None:
    with pytest.raises(AstroUserError, match="statistic"):
        RemainingLength("ratio", (1.0,), "p90")
    with pytest.raises(AstroUserError, match="kind"):
        RemainingLength("bins", (1.0,))
    with pytest.raises(AstroUserError, match="atoms"):
        RemainingLength("ratio", (0.0, 1.0))
    with pytest.raises(AstroUserError, match="no such"):
        load_remaining(tmp_path / "nope.json")


def test_load_remaining_picks_kind_and_statistic(tmp_path) -> None:
    f = tmp_path / "t.json"
    f.write_text(json.dumps({"default_kind": "ratio", "tables": {
        "ratio": {"kind": "ratio", "atoms": [1, 3]}, "empirical": {"kind": "empirical", "atoms": [5, 7]}}}))
    assert load_remaining(f).expected_total(10, 0) == 20  # (10 + 30) / 2
    assert load_remaining(f"{f}:empirical@q100").expected_total(10, 0) == 7


def test_equal_probability_atoms() -> None:
    # mid-point quantiles (0.25, 0.75) of 0..4 with linear interpolation: 1.0 and 3.0
    assert equal_probability_atoms([0, 1, 2, 3, 4], 2) == (1.0, 3.0)


def test_shipped_table_loads() -> None:
    t = load_remaining("default")
    assert t.kind == "ratio" and len(t.atoms) >= 10
    assert t.expected_total(100, 0) > 1


HAND = ExecutionProfile(
    profile_id="hand", model="hand", gpu="paper", tp=1,
    base_s=0.01, per_seq_s=0.0, token_knots=(0, 1000), token_s=(0.0, 0.1),
    decode_attn_s_per_ctx_token=0.0, prefill_attn_s_per_token_pair=0.0,
)


def test_lookahead_uses_the_conditional_length() -> None:
    # Running R: prompt 10, 5 generated, predicted 7. Ratio atoms (0.5, 1, 2, 4) → 3.5, 7, 14,
    # 28; L > 5 → (7 + 14 + 28) / 3 = 16.3 → 17 tokens, so R decodes past the candidate.
    # Candidate: 100-token prompt, 3 tokens, arriving now; step = 10 ms + 0.1 ms/token.
    # step 1: R 1 + cand 100 → 0.0201 (cand's 1st token)   step 2: R 1 + cand 1 → 0.0102
    # step 3: R 1 + cand 1 → 0.0102 (cand done). TTFT 0.0201, E2E 0.0405.
    # (Point estimate + auto-extension: R ends at step 2, step 3 = cand alone → E2E 0.0404.)
    cfg = InstanceConfig(max_model_len=4096)
    lat = LatencyModel(HAND)
    inst = InstanceSim(cfg, lat, FCFSPolicy())
    r = SimRequest("R", 1.0, 10, 500, predicted_output_tokens=7)
    r.num_computed_tokens, r.num_generated_tokens, r.kv_blocks = 14, 5, 1
    inst.running = [r]
    inst.free_blocks = cfg.num_gpu_blocks - 1
    cand = CandidateRequest(100, 3)
    with_table = predict_instance(inst, 2.0, cand, remaining=RATIO)
    assert with_table.ttft_s == pytest.approx(0.0201, abs=1e-12)
    assert with_table.e2e_s == pytest.approx(0.0405, abs=1e-12)
    plain = predict_instance(inst, 2.0, cand)
    assert plain.e2e_s == pytest.approx(0.0404, abs=1e-12)


def test_online_table_refits_from_finished_requests() -> None:
    from rps_astro_cli.sim.remaining import OnlineRemaining

    on = OnlineRemaining(RemainingLength("ratio", (1.0, 1.0)), window=2, refit_every=2)
    assert on.expected_total(100, 0) == 100
    on.observe(100, 300)  # ratio 3
    assert on.expected_total(100, 0) == 100  # no refit before `refit_every` observations
    on.observe(50, 150)  # ratio 3 → pool (1, 1, 3, 3): mid-point quantiles 0.25, 0.75 → 1.0, 3.0
    assert on.current.atoms == (1.0, 3.0)
    assert on.expected_total(100, 0) == 200  # (100 + 300) / 2
    on.observe(10, 10)  # ratio 1 replaces the oldest (window 2): buffer (1, 3)
    on.observe(10, 10)  # buffer (1, 1) → pool (1, 1, 1, 1)
    assert on.current.atoms == (1.0, 1.0) and on.observed == 4


def test_snapshot_paths_use_the_conditional_length() -> None:
    # The case of test_lookahead_uses_the_conditional_length as a /status snapshot: the jump
    # look-ahead and the step-by-step reference both give TTFT 0.0201, E2E 0.0405.
    from rps_astro_cli.sim.lookahead import predict, predict_stepwise
    from rps_astro_cli.types import InstanceStatus, RequestStatus

    cfg = InstanceConfig(max_model_len=4096)
    status = InstanceStatus("i", 2.0, cfg, cfg.num_gpu_blocks - 1,
                            (RequestStatus("R", 1.0, 10, 14, 5, 7, kv_blocks=1),))
    for fn in (predict, predict_stepwise):
        est = fn(status, CandidateRequest(100, 3), LatencyModel(HAND), FCFSPolicy(), remaining=RATIO)
        assert est.ttft_s == pytest.approx(0.0201, abs=1e-12)
        assert est.e2e_s == pytest.approx(0.0405, abs=1e-12)


def test_bench_picks_the_remaining_rule(tmp_path) -> None:
    from types import SimpleNamespace

    from rps_astro_cli.bench.virtual import bench_remaining
    from rps_astro_cli.dispatch import make_dispatch

    def cfg(spec, oracle=False):
        return SimpleNamespace(cluster=SimpleNamespace(remaining_length=spec, oracle_lengths=oracle))

    pok, llx = make_dispatch("power_of_k"), make_dispatch("llumnix")
    from rps_astro_cli.bench.config import ClusterSection

    assert ClusterSection().remaining_length == "none"  # not the default: it did not win (BENCHMARKS.md)
    assert isinstance(bench_remaining(cfg("default"), pok), RemainingLength)
    assert bench_remaining(cfg("none"), pok) is None  # auto-extension
    assert bench_remaining(cfg("default", oracle=True), pok) is None  # true lengths: no conditioning
    assert bench_remaining(cfg("default"), llx) is None  # does not predict
    with pytest.raises(AstroUserError) as exc:
        bench_remaining(cfg(str(tmp_path / "missing.json")), pok)
    assert exc.value.field == "--remaining-length"
