"""`cache_aware` and `session_affinity` on hand-made loads (issue 14)."""

from __future__ import annotations

import numpy as np
import pytest

from rps_astro_cli.dispatch import InstanceLoad, decide, make_dispatch
from rps_astro_cli.errors import AstroUserError


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
    assert pol.needs_status and not pol.needs_predictions
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
