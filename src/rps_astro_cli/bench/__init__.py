"""The benchmark behind `astro bench`: workloads (`workloads`), arrival processes
(`arrivals`), the streaming client (`client`), metrics defined once as formulas
(`metrics`, docs/metrics.md), SLOs (`slo`), the validated config (`config`), SLO-capacity search (`capacity`), live and
virtual targets (`live`, `virtual`) and the report folder (`report`).

Library entry point (used by `astro bench` and `astro demo`):

    from rps_astro_cli.bench import BenchConfig, run_bench
    result = run_bench(BenchConfig.flat(cluster="cluster.json", workload="sharegpt",
                                        num_requests=200, request_rate=4.0, out_dir="bench-out"))
    result.runs[0].metrics["overall"].ttft_s.p99, result.exit_code, result.out_dir
"""

from rps_astro_cli.bench.config import BenchConfig
from rps_astro_cli.bench.runner import BenchResult, RunResult, run_bench

__all__ = ["BenchConfig", "BenchResult", "RunResult", "run_bench"]
