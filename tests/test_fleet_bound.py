"""`benchmarks/fleet_bound.py`: a fleet's most sustainable arrival rate, Σ count × each
instance kind's saturated service rate."""

from __future__ import annotations

import json

import pytest

from conftest import load_script
from rps_astro_cli.services.config import parse_config

fb = load_script("benchmarks/fleet_bound.py", "fleet_bound")


def test_window_rate_counts_the_middle_of_the_makespan():
    # last finish 10 s: the window is [2, 8) s, which holds 2, 3, 4, 5, 6, 7 → 6 in 6 s
    assert fb.window_rate([float(t) for t in range(1, 11)]) == pytest.approx(1.0)
    # 30 finishes at 4.0–6.9 s (+ one at 10 s): all 30 in [2, 8), 30 / 6 s
    assert fb.window_rate([4.0 + 0.1 * i for i in range(30)] + [10.0]) == pytest.approx(5.0)
    with pytest.raises(ValueError):
        fb.window_rate([])


def test_one_instance_recipe_per_kind_of_instance():
    kinds = fb.single_instance_recipes("hetero-2xa100-2xa30-llama2-7b")
    assert [(c, one["instances"][0]["profile"]) for c, one in kinds] == [(2, "llama-2-7b-a100"),
                                                                         (2, "llama-2-7b-a30")]
    for _, one in kinds:  # each a valid recipe of one instance with the fleet's engine limits
        cfg = parse_config(one)
        assert cfg.num_instances == 1 and cfg.instances[0].max_num_seqs == 48  # type: ignore[index]
    (count, one), = fb.single_instance_recipes("quick-sim")  # 4 of the same kind
    assert count == 4 and parse_config(one).num_instances == 1


def test_the_bound_sums_each_kinds_rate(tmp_path, capsys):
    out = tmp_path / "bound.json"
    assert fb.main(["--recipe", "hetero-2xa100-2xa30-llama2-7b", "-w", "synthetic", "-n", "120",
                    "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    a100, a30 = got["kinds"]
    assert a100["service_rate_rps"] > a30["service_rate_rps"] > 0  # the A100 serves faster
    assert got["fleet_bound_rps"] == pytest.approx(2 * a100["service_rate_rps"] + 2 * a30["service_rate_rps"])
    assert fb.main(["--recipe", "no-such-recipe"]) == 2
    assert "no recipe 'no-such-recipe'" in capsys.readouterr().err
