"""Preemption under `rps` in the Predictor's look-ahead (issue 15).

- The victim: `rps` names it by a key of each class's youngest (`victim_merge_key`), so
  the look-ahead never calls `preemption_victim`; its estimates must equal, bit for bit,
  those of the policy asked among the classes' youngest (no merge key) and among all
  running requests (no groups), and the step-by-step reference.
- Waiting-side preemption (`rps preempt_waiting=true`): the look-ahead predicts what the
  engine does (a hand-computed case, and jump = step by step under KV pressure).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from conftest import linear_profile
from rps_astro_cli.policies import make_policy
from rps_astro_cli.policies.rps import RPSPolicy
from rps_astro_cli.sim import lookahead
from rps_astro_cli.sim.latency import LatencyModel
from rps_astro_cli.sim.lookahead import predict, predict_stepwise
from rps_astro_cli.sim.profile import load_profile
from rps_astro_cli.sim.request import SimRequest
from rps_astro_cli.types import CandidateRequest, InstanceConfig, InstanceStatus, RequestStatus

MODALITIES = ("text", "image", "video")
VISION = {"text": 0, "image": 729, "video": 1568}


class RPSAskedAmongReps(RPSPolicy):
    """`rps` without `victim_merge_key`: the look-ahead asks `preemption_victim` among
    the classes' youngest."""

    def victim_merge_key(self, requests):  # type: ignore[override]
        return None


class RPSAskedAmongAll(RPSAskedAmongReps):
    """`rps` without `victim_groups` either: asked among all running requests."""

    def victim_groups(self, requests):  # type: ignore[override]
        return None


def test_rps_victim_is_the_smallest_victim_rank_among_class_youngest() -> None:
    # The `victim_merge_key` contract: any subset, any running order, times from "just
    # arrived" to saturated P; arrivals on a grid (ties inside and across classes), and
    # equal regulator parameters for every class (P ties across classes too).
    g = np.random.default_rng(3)
    for params in ({}, {"static_priority": [0.2, 0.2, 0.2], "alpha": [2.0, 2.0, 2.0], "beta": [0.5, 0.5, 0.5]}):
        pol = make_policy("rps", **params)
        for _ in range(300):
            reqs = [SimRequest(f"q{i}", float(g.integers(0, 40)) * 0.25, int(g.integers(1, 300)), 10,
                               modality=str(g.choice(MODALITIES))) for i in range(int(g.integers(1, 30)))]
            vgroups, key = pol.victim_groups(reqs), pol.victim_merge_key(reqs)
            for now in (0.5, 10.0, 12.3, 60.0, 1e4):
                sub = [r for r in reqs if g.random() < 0.7] or reqs[:1]
                g.shuffle(sub)
                best: dict = {}
                for i, r in enumerate(sub):
                    c, k = vgroups(r)
                    if c not in best or not k < vgroups(sub[best[c]])[1]:
                        best[c] = i
                idxs = sorted(best.values())
                # smallest key, the latest in running order on equal keys
                pick = min(idxs, key=lambda i: (key(sub[i], now), -i))
                assert pol.preemption_victim(sub, now) is sub[pick]


def _snapshot(g: np.random.Generator, cfg: InstanceConfig, n_run: int, n_wait: int, now: float = 2.0):
    """A mixed-class snapshot whose KV pool runs short: running requests caught mid-decode
    (some mid-prefill), queued ones (some preempted before: generated tokens), arrivals
    on a 0.1 s grid over the last 2 s (ties), a candidate of any class."""
    bs = cfg.block_size
    running, used = [], 0
    for i in range(n_run):
        m = str(g.choice(MODALITIES, p=[0.4, 0.4, 0.2]))
        p = int(g.integers(20, 600)) + VISION[m]
        gen = int(g.integers(1, 200))
        c = p + gen - 1 if g.random() < 0.85 else int(g.integers(1, p))
        gen = gen if c >= p else 0
        kv = -(-c // bs)
        if used + kv > cfg.num_gpu_blocks - 4 or p + gen + 300 > cfg.max_model_len:
            break
        used += kv
        running.append(RequestStatus(f"r{i}", float(g.integers(0, 20)) * 0.1, p, c, gen, int(g.integers(2, 300)),
                                     kv_blocks=kv, modality=m, vision_tokens=VISION[m]))
    waiting = []
    for i in range(n_wait):
        m = str(g.choice(MODALITIES, p=[0.4, 0.4, 0.2]))
        gen = int(g.choice([0, 0, 0, 0, 5]))
        waiting.append(RequestStatus(f"w{i}", float(g.integers(0, 20)) * 0.1, int(g.integers(20, 900)) + VISION[m],
                                     0, gen, int(g.integers(1, 300)), modality=m, vision_tokens=VISION[m]))
    m = str(g.choice(MODALITIES))
    cand = CandidateRequest(int(g.integers(20, 600)) + VISION[m], int(g.integers(1, 200)), modality=m,
                            vision_tokens=VISION[m], preprocess_s=float(g.choice([0.0, 0.3])))
    return InstanceStatus("i", now, cfg, cfg.num_gpu_blocks - used, tuple(running), tuple(waiting)), cand


def _preemptions(status: InstanceStatus, cand: CandidateRequest, lat: LatencyModel, pol) -> int:
    """Preemptions in the look-ahead's run (its requests' counters afterwards)."""
    eng = lookahead.engine
    run = eng.lreqs_from_status(status.running, 10, 256)
    wait = eng.lreqs_from_status(status.waiting, 10, 256)
    c = eng.lreq_candidate(lookahead.candidate_to_sim(cand, status.time_s))
    eng.FastLookahead(status.limits, lat, pol, run, wait, status.kv_blocks_free).run(c, status.time_s)
    return sum(r.num_preemptions for r in [*run, *wait, c])


@pytest.mark.parametrize("profile", ["llama-2-7b-a30", "llava-onevision-7b-a100"])
def test_rps_victim_paths_agree_bit_for_bit_under_kv_pressure(profile: str) -> None:
    # The text model's 1,056-block pool (the look-ahead benchmark's KV-pressure cell) and
    # the LLaVA limits with small pools; a quarter of the trials in prioritized-prefill mode.
    prof = load_profile(profile)
    lat = LatencyModel(prof)
    base = InstanceConfig.from_profile(prof)
    g = np.random.default_rng(21)
    preempted = 0
    for trial in range(16):
        blocks = base.num_gpu_blocks if profile.startswith("llama") else int(g.choice([300, 500]))
        cfg = dataclasses.replace(base, num_gpu_blocks=blocks, max_model_len=4096,
                                  chunked_prefill=trial % 4 != 3)
        status, cand = _snapshot(g, cfg, int(g.integers(4, 40)), int(g.integers(2, 40)))
        fast = predict(status, cand, lat, make_policy("rps"))
        assert predict(status, cand, lat, RPSAskedAmongReps()) == fast
        assert predict(status, cand, lat, RPSAskedAmongAll()) == fast
        ref = predict_stepwise(status, cand, lat, make_policy("rps"))
        assert fast.steps_simulated == ref.steps_simulated
        assert fast.ttft_s == pytest.approx(ref.ttft_s, rel=1e-9, abs=1e-12)
        assert fast.e2e_s == pytest.approx(ref.e2e_s, rel=1e-9, abs=1e-12)
        preempted += _preemptions(status, cand, lat, make_policy("rps"))
    assert preempted >= 50  # the preemption pass is what was compared


# --- waiting-side preemption (`preempt_waiting`) ------------------------------------

def _pwait_case() -> tuple[InstanceStatus, CandidateRequest, LatencyModel]:
    """10 KV blocks of 16 tokens, all held by R: a video request (rocks), prompt 150, one
    token generated, 150 computed (10 blocks), predicted 3 tokens, arrived 1 s ago. The
    candidate: a 20-token text prompt (sand), 2 predicted tokens, arriving now. Step time
    10 ms + 0.1 ms per token."""
    cfg = InstanceConfig(block_size=16, num_gpu_blocks=10, max_num_seqs=8, max_num_batched_tokens=512,
                         max_model_len=160)
    r = RequestStatus("R", 1.0, 150, 150, 1, 3, kv_blocks=10, modality="video", vision_tokens=100)
    return (InstanceStatus("i", 2.0, cfg, 0, (r,)), CandidateRequest(20, 2),
            LatencyModel(linear_profile()))


@pytest.mark.parametrize("fn", [predict, predict_stepwise])
def test_preempt_waiting_hand_computed(fn) -> None:
    status, cand, lat = _pwait_case()
    # Without it (vLLM's rule): R's two decodes run (151 and 152 tokens need no new
    # block: 0.0101 s each, R done, its 10 blocks free), then the candidate's 20-token
    # prefill (0.012 s, first token) and its decode (0.0101 s).
    off = fn(status, cand, lat, make_policy("rps"))
    assert off.ttft_s == pytest.approx(0.0101 + 0.0101 + 0.012, abs=1e-12)
    assert off.e2e_s == pytest.approx(0.0101 + 0.0101 + 0.012 + 0.0101, abs=1e-12)
    assert off.steps_simulated == 4
    # With it: step 1 schedules R's decode, then the candidate needs 2 blocks, none are
    # free, the victim is R, and sand P(0) = 0.1 > rocks P(1 s) = 1 − e^−0.00075: R is
    # preempted (out of the step, its 10 blocks free) and the candidate's 20 tokens run
    # alone (0.012 s, first token). Step 2: its decode; R (recompute: 151 tokens, 10
    # blocks, 8 free) does not fit and does not outrank it (P ≈ 0.00076 < 0.1): 0.0101 s.
    on = fn(status, cand, lat, make_policy("rps", preempt_waiting=True))
    assert on.ttft_s == pytest.approx(0.012, abs=1e-12)
    assert on.e2e_s == pytest.approx(0.012 + 0.0101, abs=1e-12)
    assert on.steps_simulated == 2


def test_preempt_waiting_lookahead_equals_stepwise() -> None:
    # The jump look-ahead against `InstanceSim` stepping the same snapshot (the engine's
    # own scheduler), with waiting-side preemption on, under KV pressure; regulator
    # parameters that make classes cross within the look-ahead's horizon as well as the
    # paper's. Both chunked and prioritized prefill.
    g = np.random.default_rng(77)
    prof = load_profile("llava-onevision-7b-a100")
    lat = LatencyModel(prof)
    base = InstanceConfig.from_profile(prof)
    fired = 0
    for trial in range(24):
        cfg = dataclasses.replace(base, num_gpu_blocks=int(g.choice([300, 600, 1200])), max_model_len=4096,
                                  chunked_prefill=trial % 4 != 3)
        status, cand = _snapshot(g, cfg, int(g.integers(0, 24)), int(g.integers(1, 30)))
        params = {} if trial % 2 else {"alpha": [1.0, 1.0, 1.0], "beta": [2.0, 1.0, 0.5]}
        on = make_policy("rps", preempt_waiting=True, **params)
        ref = predict_stepwise(status, cand, lat, on)
        got = predict(status, cand, lat, make_policy("rps", preempt_waiting=True, **params))
        assert got.steps_simulated == ref.steps_simulated
        assert got.ttft_s == pytest.approx(ref.ttft_s, rel=1e-9, abs=1e-12)
        assert got.e2e_s == pytest.approx(ref.e2e_s, rel=1e-9, abs=1e-12)
        off = predict_stepwise(status, cand, lat, make_policy("rps", **params))
        fired += (off.ttft_s, off.e2e_s) != (ref.ttft_s, ref.e2e_s)
    assert fired >= 4  # waiting-side preemption changed the prediction in enough trials
