"""The dispatch pipeline (filters → sampler → scorers → picker), declared parameters and
loud plug-in registration, on hand-made loads."""

from __future__ import annotations

import inspect
import sys

import numpy as np
import pytest

from rps_astro_cli.dispatch import DISPATCH_POLICIES, DispatchPolicy, decide, make_dispatch
from rps_astro_cli.dispatch.stages import HealthFilter, KvHeadroomFilter, KvRoomFilter, OutstandingScorer, Scorer
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.params import Param, ParamError, check_params, parse_assignments
from rps_astro_cli.policies import INSTANCE_POLICIES
from rps_astro_cli.registry import PluginImportError, import_plugins
from rps_astro_cli.types import InstanceLoad, LatencyEstimate


# -- declared parameters -------------------------------------------------------------------
def test_param_converts_flag_strings_and_checks_bounds():
    k = Param("k", int, 2, "sample size", ge=1, keywords=("all",))
    assert k.convert("3") == 3 and k.convert(4) == 4 and k.convert("ALL") == "all"
    for bad in ("x", 0, 1.5, True):
        with pytest.raises(ParamError, match="must be an integer ≥ 1 or 'all'"):
            k.convert(bad)
    frac = Param("f", float, 0.01, "fraction", ge=0.0, lt=1.0)
    assert frac.convert("0.5") == 0.5 and frac.convert(0) == 0.0
    with pytest.raises(ParamError, match=r"must be a number ≥ 0 and < 1, got 1"):
        frac.convert(1)
    with pytest.raises(ParamError):
        frac.convert("nan")
    flag = Param("b", bool, False, "switch")
    assert flag.convert("true") is True and flag.convert("0") is False
    obj = Param("ab", str, "e2e", "objective", choices=("e2e", "ttft"))
    with pytest.raises(AstroUserError) as ei:
        obj.check("fast", field="--objective")
    assert ei.value.field == "--objective" and "unknown ab 'fast'" in str(ei.value) and "e2e, ttft" in str(ei.value)


def test_check_params_names_unknown_parameters_and_lists_the_declared():
    specs = (Param("a", int, 1, "x"), Param("b", float, 1.0, "y"))
    assert check_params(specs, {"a": "2"}, owner="p") == {"a": 2}
    with pytest.raises(AstroUserError) as ei:
        check_params(specs, {"c": 1}, owner="dispatch policy p", fields={"c": "--param c"})
    assert ei.value.field == "--param c" and "its parameters are: a, b" in str(ei.value)
    assert parse_assignments(["a=1", " b = x=y "]) == {"a": "1", "b": "x=y"}
    with pytest.raises(AstroUserError, match="NAME=VALUE"):
        parse_assignments(["a"])


@pytest.mark.parametrize("registry", [DISPATCH_POLICIES, INSTANCE_POLICIES], ids=["dispatch", "instance"])
def test_every_policy_declares_exactly_its_constructor_parameters(registry):
    for name in registry.names():
        cls = registry.get(name)
        sig = inspect.signature(cls.__init__)
        kw = {n: p.default for n, p in sig.parameters.items()
              if n != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}  # object.__init__: none
        declared = {p.name: p.default for p in cls.params}
        assert set(kw) == set(declared), name
        for n, default in declared.items():  # the declared default is the constructor's (lists for tuples)
            d = kw[n]
            assert (list(d) if isinstance(d, tuple) else d) == default, (name, n)


# -- stages ---------------------------------------------------------------------------------
def test_health_filter_keeps_healthy_and_passes_all_when_none_is():
    by = {i: InstanceLoad(i, i % 2 == 0) for i in range(4)}
    assert HealthFilter()(by, [0, 1, 2, 3]) == [0, 2]
    none = {i: InstanceLoad(i, False) for i in range(3)}
    assert HealthFilter()(none, [0, 1, 2]) == [0, 1, 2]


def test_kv_room_filter_drops_instances_whose_queue_already_needs_the_free_blocks():
    # free − waiting need: 10 − 4 = 6 (room), 10 − 10 = 0 (none), unknown status (passes)
    by = {0: InstanceLoad(0, kv_blocks_free=10, waiting_blocks_needed=4),
          1: InstanceLoad(1, kv_blocks_free=10, waiting_blocks_needed=10),
          2: InstanceLoad(2)}
    assert KvRoomFilter()(by, [0, 1, 2]) == [0, 2]
    assert KvRoomFilter(min_free_blocks=6)(by, [0, 1]) == [0, 1]  # nobody has > 6: all pass


def _hl(i, free, need, hit=None, total=100, running=1):
    # 100 blocks of 16 tokens; the request's prompt is 33 tokens = 3 blocks (1 when 32 are cached)
    return InstanceLoad(i, kv_blocks_free=free, kv_blocks_total=total, waiting_blocks_needed=need,
                        request_prompt_tokens=33, kv_block_size=16, prefix_hit_tokens=hit, num_running=running)


def test_kv_headroom_filter_counts_the_queue_and_the_request_own_prompt():
    # reserve 10 % of 100 blocks = 10: free − waiting need − own prompt blocks ≥ 10
    by = {0: _hl(0, 20, 5),        # 20 − 5 − 3 = 12: passes
          1: _hl(1, 15, 3),        # 15 − 3 − 3 = 9: fails
          2: InstanceLoad(2),      # unknown status: passes
          3: _hl(3, 12, 0, hit=32),  # 12 − 0 − ceil(1/16) = 11: passes (9 without the hit)
          4: _hl(4, 12, 0)}        # 12 − 0 − 3 = 9: fails
    f = KvHeadroomFilter(0.1)
    assert f.headroom_blocks(by[0]) == 12 and f.headroom_blocks(by[1]) == 9 and f.headroom_blocks(by[2]) is None
    assert f(by, [0, 1, 2, 3, 4]) == [0, 2, 3]
    assert f(by, [1, 4]) == [1, 4]  # none has headroom: all pass


def test_power_of_k_with_kv_reserve_picks_the_best_prediction_among_instances_with_headroom():
    loads = [_hl(0, 20, 5), _hl(1, 15, 3), _hl(2, 40, 0)]
    est = {0: LatencyEstimate(0.30, 9.0, 1, 1), 1: LatencyEstimate(0.10, 8.0, 1, 1),
           2: LatencyEstimate(0.20, 9.5, 1, 1)}
    asked = []

    def predict(cands):
        asked.append(sorted(cands))
        return {i: est[i] for i in cands}

    rng = np.random.default_rng(0)
    pol = make_dispatch("power_of_k", k="all", objective="ttft", kv_reserve_frac=0.1)
    assert {"status", "predictions"} <= pol.inputs
    dec = decide(pol, loads, rng, predict)
    # instance 1 predicts the lowest TTFT but would keep 9 < 10 blocks free: only 0 and 2 are asked
    assert asked == [[0, 2]] and dec.choice == 2
    off = decide(make_dispatch("power_of_k", k="all", objective="ttft", kv_reserve_frac=0, tie_tolerance_s=0),
                 loads, rng, predict)
    assert off.choice == 1  # the reserve off: the plain lowest prediction
    # ties within 0.15 s: 0.30 and 0.20 s both count; Llumnix- load −(free − need) / running:
    # instance 0: −(20 − 5) / 1 = −15, instance 2 (4 running): −(40 − 0) / 4 = −10 → instance 0
    loads[2] = _hl(2, 40, 0, running=4)
    tie = make_dispatch("power_of_k", k="all", objective="ttft", kv_reserve_frac=0.1, tie_tolerance_s=0.15)
    dec = decide(tie, loads, rng, predict)
    assert dec.choice == 0 and "Llumnix" in dec.reason
    narrow = make_dispatch("power_of_k", k="all", objective="ttft", kv_reserve_frac=0.1, tie_tolerance_s=0.05)
    assert decide(narrow, loads, rng, predict).choice == 2  # 0.30 is not within 0.05 s of 0.20
    with pytest.raises(AstroUserError):
        make_dispatch("power_of_k", kv_reserve_frac=1.0)


class _FreeBlocks(Scorer):
    name = "free"
    reads = frozenset({"status"})

    def score(self, by_index, candidates, predictions):
        return {i: float(-by_index[i].kv_blocks_free) for i in candidates}


class _TwoScorers(DispatchPolicy):
    name = "two"
    scorers = ((OutstandingScorer(), 1.0), (_FreeBlocks(), 3.0))


def test_several_scorers_are_normalised_and_weighted():
    # outstanding 0, 4, 2 → normalised 0, 1, 0.5; free 10, 50, 30 → cost −10, −50, −30 →
    # normalised 1, 0, 0.5. Weighted 1×o + 3×f: 3.0, 1.0, 2.0 → instance 1.
    loads = [InstanceLoad(0, True, 0, kv_blocks_free=10), InstanceLoad(1, True, 4, kv_blocks_free=50),
             InstanceLoad(2, True, 2, kv_blocks_free=30)]
    p = _TwoScorers()
    assert p.inputs == {"status"}  # the union of its stages' reads: health and outstanding read nothing
    values, reason = p.score(loads, [0, 1, 2], {})
    assert values == pytest.approx({0: 3.0, 1: 1.0, 2: 2.0}) and reason.startswith("lowest weighted score")
    assert p.choose(loads, [0, 1, 2], {}, np.random.default_rng(0)).choice == 1


def test_decide_times_each_stage_and_asks_predictions_only_when_needed():
    loads = [InstanceLoad(i, True, i) for i in range(3)]
    asked = []

    def predict(cands):
        asked.append(list(cands))
        return {i: LatencyEstimate(0.1, 1.0 + i, 0, 0) for i in cands}

    d = decide(make_dispatch("least_requests"), loads, np.random.default_rng(0), predict)
    assert d.choice == 0 and asked == []
    assert set(d.stage_us) == {"filter", "sample", "predict", "score", "pick"}
    assert d.decide_us >= sum(d.stage_us.values()) * 0.999 and d.to_dict()["stage_us"] == dict(d.stage_us)
    d = decide(make_dispatch("power_of_k", k="all", objective="e2e"), loads, np.random.default_rng(0), predict)
    assert asked == [[0, 1, 2]] and d.choice == 0 and d.predictions[2] == (0.1, 3.0)


def test_a_policys_inputs_are_its_stages_declared_reads_not_its_name():
    inputs = {n: make_dispatch(n).inputs for n in DISPATCH_POLICIES.names()}
    assert inputs == {
        "round_robin": set(), "random": set(), "least_requests": set(), "session_affinity": set(),
        "llumnix": {"status"}, "least_kv": {"status"},
        "cache_aware": {"prefix_hits"},  # its scorer decides by the hits
        # the KV gate (status), the cache pin of a k < all sampler (hits), the look-ahead
        "power_of_k": {"status", "predictions"}}
    assert make_dispatch("power_of_k", k=2).inputs == {"status", "prefix_hits", "predictions"}
    # full fanout, no gate, no load tie-break: predictions alone (the tie-break by load reads status)
    assert make_dispatch("power_of_k", k="all", kv_reserve_frac=0, tie_tolerance_s=0).inputs == {"predictions"}
    assert make_dispatch("power_of_k", k="all", kv_reserve_frac=0, tie_tolerance_s=0.02).inputs == {"status",
                                                                                                   "predictions"}
    # k="auto" (the default) narrows a fleet past 8 instances by load: it reads status
    assert make_dispatch("power_of_k", kv_reserve_frac=0, tie_tolerance_s=0).inputs == {"status", "predictions"}


def test_one_rule_for_prefix_hits():
    from rps_astro_cli.dispatch import prefix_hits_wanted

    for name, without_cache, with_cache in (("cache_aware", True, True), ("power_of_k", False, True),
                                            ("llumnix", False, False), ("round_robin", False, False)):
        pol = make_dispatch(name)
        assert prefix_hits_wanted(pol.inputs, False) is without_cache, name
        assert prefix_hits_wanted(pol.inputs, True) is with_cache, name
    assert prefix_hits_wanted(make_dispatch("power_of_k", k=2).inputs, False)  # the pin decides by hits


# -- registration ---------------------------------------------------------------------------
def test_a_broken_policy_module_fails_loudly_naming_it(tmp_path, monkeypatch):
    (tmp_path / "astro_broken_policy.py").write_text("import not_a_module_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginImportError) as ei:
        import_plugins("dispatch policy", ["astro_broken_policy"])
    assert "dispatch policy module astro_broken_policy failed to import" in str(ei.value)
    assert "not_a_module_anywhere" in str(ei.value)
    sys.modules.pop("astro_broken_policy", None)


def test_unknown_names_list_the_valid_ones():
    with pytest.raises(AstroUserError) as ei:
        make_dispatch("least_kb")
    assert "least_kv" in str(ei.value) and "power_of_k" in str(ei.value)


def test_astro_policies_lists_declared_parameters():
    import json

    from typer.testing import CliRunner

    from rps_astro_cli.cli.main import app

    r = CliRunner().invoke(app, ["policies", "--json"])
    assert r.exit_code == 0, r.output
    rows = {(row["family"], row["name"]): row for row in json.loads(r.output)}
    assert rows[("dispatch", "least_kv")]["params"][0] | {"help": ""} == {
        "name": "tie_blocks", "accepts": "an integer ≥ 0", "default": 0, "help": "", "recipe_key": None}
    keys = [p["recipe_key"] for p in rows[("dispatch", "power_of_k")]["params"]]
    assert keys == ["k", "objective", None, None, None]
    assert ("instance", "rps") in rows and ("instance", "fcfs") in rows


def test_timed_carries_every_field_of_the_decision():
    # `_timed` rebuilds the decision field by field (cheaper than dataclasses.replace): every
    # field but the times must come through; a new field must be added there too
    from dataclasses import fields

    from rps_astro_cli.dispatch.base import _timed
    from rps_astro_cli.types import DispatchDecision

    assert len(fields(DispatchDecision)) == 12, "a DispatchDecision field was added: carry it in dispatch.base._timed"
    dec = DispatchDecision("p", (1, 2), 2, "why", {2: (0.1, 0.2)}, 5.0, {"score": 1.0, "pick": 2.0}, (1,),
                           "slo_ttft_unmeetable", "headroom", 3, {2: (0.05, 0.1)})
    out = _timed(dec, 0.0, 1e-6, 3e-6, 6e-6)
    for f in fields(DispatchDecision):
        if f.name not in ("decide_us", "stage_us"):
            assert getattr(out, f.name) == getattr(dec, f.name), f.name
    assert list(out.stage_us) == ["filter", "sample", "predict", "score", "pick"]
    assert out.stage_us["sample"] == pytest.approx(2.0) and out.stage_us["predict"] == pytest.approx(3.0)
    assert out.decide_us >= 6.0
