"""`cache_aware` and `session_affinity` on hand-made loads (issue 14)."""

from __future__ import annotations

import numpy as np
import pytest

from rps_astro_cli.dispatch import decide, make_dispatch
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.types import InstanceLoad


def load(i: int, outstanding: int, hit: int | None = 0, prompt: int = 100, home: bool = False) -> InstanceLoad:
    return InstanceLoad(i, True, outstanding, 500, 1000, 0, 0, 0, hit, prompt, home)


def pick(policy, loads, seed: int = 0) -> int:
    return decide(policy, loads, np.random.default_rng(seed), lambda c: {}).choice


def test_cache_aware_takes_the_longest_match_above_the_threshold() -> None:
    pol = make_dispatch("cache_aware")
    # hits 64 / 48 / 0 of a 100-token prompt: 0.64 > 0.5 → instance 0 despite more load
    assert pick(pol, [load(0, 10, 64), load(1, 2, 48), load(2, 0, 0)]) == 0
    # best match 48 / 100 = 0.48 ≤ 0.5 → least loaded (instance 2)
    assert pick(pol, [load(0, 10, 48), load(1, 2, 16), load(2, 0, 0)]) == 2
    # equal hits: fewer outstanding wins
    assert pick(pol, [load(0, 5, 80), load(1, 3, 80), load(2, 0, 0)]) == 1


def test_cache_aware_load_guard_overrides_the_match() -> None:
    pol = make_dispatch("cache_aware")
    # max − min = 40 > 32 and 40 > 1.5 × 0 → imbalanced: least loaded, whatever the hits
    assert pick(pol, [load(0, 40, 96), load(1, 0, 0)]) == 1
    # 40 − 10 = 30 ≤ 32: balanced enough, the match decides
    assert pick(pol, [load(0, 40, 96), load(1, 10, 0)]) == 0
    # 100 − 66 = 34 > 32 but 100 ≤ 1.5 × 66 = 99? no: 100 > 99 → imbalanced
    assert pick(pol, [load(0, 100, 96), load(1, 66, 0)]) == 1
    # 100 − 67 = 33 > 32 and 100 ≤ 1.5 × 67 = 100.5 → not imbalanced: the match
    assert pick(pol, [load(0, 100, 96), load(1, 67, 0)]) == 0


def test_cache_aware_unknown_hits_are_no_hits_and_params_are_checked() -> None:
    pol = make_dispatch("cache_aware", cache_threshold=0.1)
    assert pick(pol, [load(0, 3, None), load(1, 1, None)]) == 1
    assert pol.inputs == {"prefix_hits"}
    with pytest.raises(AstroUserError, match="cache_threshold"):
        make_dispatch("cache_aware", cache_threshold="1.5")


def test_session_affinity_sticks_to_the_previous_turns_instance() -> None:
    pol = make_dispatch("session_affinity")
    assert pick(pol, [load(0, 1), load(1, 9, home=True), load(2, 0)]) == 1
    # no home (a first turn): fewest outstanding
    assert pick(pol, [load(0, 1), load(1, 9), load(2, 0)]) == 2
    # the home is unhealthy: the health filter drops it
    sick = InstanceLoad(1, False, 9, served_session=True)
    assert pick(pol, [load(0, 1), sick, load(2, 4)]) == 0


# -- power_of_k's cache pin (issue 14) ------------------------------------------------------
def _cands(pol, loads, seed: int) -> list[int]:
    """The candidates `decide` asks predictions for."""
    asked: list[list[int]] = []
    decide(pol, loads, np.random.default_rng(seed), lambda c: asked.append(list(c)) or {})
    return asked[0]


def test_power_of_k_always_samples_the_longest_cached_prefix() -> None:
    pol = make_dispatch("power_of_k", k=2, kv_reserve_frac=0, tie_tolerance_s=0)
    assert pol.inputs == {"prefix_hits", "predictions"}  # the pin alone needs no engine status
    assert "status" in make_dispatch("power_of_k", k=2).inputs  # the default KV gate does
    loads = [load(0, 0, 0), load(1, 9, 0), load(2, 7, 48), load(3, 0, 16), load(4, 0, 0), load(5, 0, 0)]
    for seed in range(20):
        c = _cands(pol, loads, seed)
        # instance 2 (48 hit tokens) first, plus one drawn from the other five
        assert c[0] == 2 and len(c) == 2 and c[1] != 2
    # the other one is uniform over the rest: one draw of size 1 from 5
    assert {_cands(pol, loads, s)[1] for s in range(60)} == {0, 1, 3, 4, 5}
    # equal hits: the one with fewer outstanding requests is pinned
    tie = [load(0, 5, 32), load(1, 2, 32), load(2, 9, 0), load(3, 0, 0)]
    assert all(_cands(pol, tie, s)[0] == 1 for s in range(10))


def test_power_of_k_without_hits_draws_exactly_as_before() -> None:
    # no hit anywhere (or unknown): the plain k-of-n draw, same Generator stream
    pinned, plain = make_dispatch("power_of_k", k=2), make_dispatch("power_of_k", k=2, pin_cached="false")
    assert "prefix_hits" not in plain.inputs
    for hits in (0, None):
        loads = [load(i, i, hits) for i in range(5)]
        for seed in range(10):
            want = np.random.default_rng(seed).choice(5, size=2, replace=False).tolist()
            assert _cands(pinned, loads, seed) == _cands(plain, loads, seed) == want
    # k ≥ the pool, or "all": every instance, pin or not
    assert _cands(make_dispatch("power_of_k", k="all"), [load(0, 0, 64), load(1, 0)], 0) == [0, 1]
    # k = 1 with a hit: only the pinned instance
    assert _cands(make_dispatch("power_of_k", k=1), [load(0, 0), load(1, 0, 64), load(2, 0)], 3) == [1]
