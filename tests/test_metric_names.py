"""One prefix convention for metric names: astro's own families are `astro:<name>`,
vLLM's (the sim engine's) `vllm:<name>` — checked on what the exporters register and on
every metric constructor in the source (so a new `astro_…` family fails here)."""

from __future__ import annotations

import ast
from pathlib import Path

from rps_astro_cli.services.scheduler.metrics import SchedulerMetrics

SRC = Path(__file__).resolve().parents[1] / "src" / "rps_astro_cli"
STANDARD = {"process_cpu_seconds", "process_max_fds", "process_open_fds", "process_resident_memory_bytes",
            "process_start_time_seconds", "process_virtual_memory_bytes"}
CONSTRUCTORS = {"Counter", "Gauge", "Histogram", "Summary", "CounterMetricFamily", "GaugeMetricFamily",
                "HistogramMetricFamily", "SummaryMetricFamily"}


def test_scheduler_families_are_astro_colon():
    # process_* / python_*: prometheus_client's standard process collectors, named by convention
    names = {m.name for m in SchedulerMetrics().registry.collect()} - STANDARD
    assert "astro:prediction_abs_error_seconds" in names and "astro:dispatch_fallbacks" in names
    assert all(n.startswith("astro:") for n in names), sorted(names)


def test_sim_engine_families_are_vllm_or_astro_colon():
    from rps_astro_cli.engine.sim_engine import SimEngine
    from rps_astro_cli.engine.sim_server import create_app
    from test_sim_engine_server import make_profile

    app = create_app(SimEngine(make_profile(), time_scale=0.05, instance_id="e1"))
    names = {m.name for m in app.state.registry.collect()}
    assert "astro:engine_lag_seconds_max" in names and "vllm:time_to_first_token_seconds" in names
    assert all(n.startswith(("vllm:", "astro:")) for n in names), sorted(names)


def test_every_metric_constructor_in_the_source_uses_a_colon_prefix():
    bad = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call) or not node.args:
                continue
            fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            arg = node.args[0]
            if fn in CONSTRUCTORS and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                if not arg.value.startswith(("astro:", "vllm:")):
                    bad.append(f"{path.relative_to(SRC)}:{node.lineno} {arg.value}")
    assert not bad, bad
