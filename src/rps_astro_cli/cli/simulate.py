"""`astro simulate`: run a length trace through the virtual-time cluster simulation
(library: `rps_astro_cli.cluster.simulate_cluster`) and write one JSON record per
request. `astro bench --virtual` builds richer workloads on the same library."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from rps_astro_cli.cli.common import InstanceParamOpt, ParamOpt, ProfileOpt, SeedOpt, console, user_errors

_DATASETS = {
    "astrolabe-sharegpt": "traces/astrolabe_sharegpt_val_10k_llama2.csv",
    "azure-conv": "traces/AzureLLMInferenceTrace_conv_2023.csv",
}


def register(app: typer.Typer) -> None:
    """Add the `simulate` command to the root app."""

    @app.command("simulate")
    @user_errors
    def simulate(
        trace: Annotated[Path | None, typer.Option("--trace", help="CSV length trace (prompt/output token columns).")] = None,
        dataset: Annotated[str | None, typer.Option("--dataset", help=f"Named trace from the sample-data folder (not shipped with the package: set ASTRO_DATA_DIR, default ../shared/data) instead of --trace: {', '.join(_DATASETS)}.")] = None,
        instances: Annotated[int, typer.Option("--instances", help="Number of simulated instances (≥ 1).")] = 12,
        rate: Annotated[float, typer.Option("--rate", help="Poisson arrival rate (requests/s, > 0).")] = 30.0,
        num_requests: Annotated[int, typer.Option("--num-requests", "-n", help="Requests to simulate (trace rows cycle).")] = 1000,
        policy: Annotated[str, typer.Option("--policy", help="Dispatch policy (round_robin, power_of_k, least_kv, ...; see `astro policies`).")] = "round_robin",
        k: Annotated[str | None, typer.Option("--k", help="power_of_k: sample size (int or 'all').")] = None,
        param: ParamOpt = None,
        instance_policy: Annotated[str, typer.Option("--instance-policy", help="In-instance policy (fcfs, ...).")] = "fcfs",
        instance_param: InstanceParamOpt = None,
        profile: ProfileOpt = "llama-2-7b-a30",
        seed: SeedOpt = 0,
        out: Annotated[Path, typer.Option("--out", help="Records file (JSON lines, one per request).")] = Path("records.jsonl"),
    ) -> None:
        """Simulate a cluster in virtual time: trace lengths, Poisson arrivals, a dispatch
        policy; writes per-request records (arrival, dispatch, first token, finish,
        tokens, instance, preemptions) and prints a summary."""
        import json

        import numpy as np

        from rps_astro_cli.cluster import poisson_workload, read_length_trace, simulate_cluster
        from rps_astro_cli.data_paths import data_dir
        from rps_astro_cli.dispatch import make_dispatch
        from rps_astro_cli.errors import AstroUserError
        from rps_astro_cli.params import parse_assignments
        from rps_astro_cli.policies import build_instance_policy
        from rps_astro_cli.sim.instance import InstanceConfig
        from rps_astro_cli.sim.profile import load_profile

        if (trace is None) == (dataset is None):
            raise AstroUserError("give exactly one of --trace FILE or --dataset NAME", field="--trace")
        if dataset is not None:
            if dataset not in _DATASETS:
                raise AstroUserError(f"unknown dataset {dataset!r}", field="--dataset",
                                     fix=f"choose one of: {', '.join(_DATASETS)}")
            root = data_dir()
            if root is None:
                raise AstroUserError(f"--dataset {dataset} needs the sample-data folder and none was found",
                                     fix=f"set ASTRO_DATA_DIR to the folder holding {_DATASETS[dataset]}, "
                                         "or pass --trace FILE")
            trace = root / _DATASETS[dataset]
            if not trace.is_file():
                raise AstroUserError(f"--dataset {dataset}: {trace} is missing from the sample-data folder {root}",
                                     fix="point ASTRO_DATA_DIR at a folder holding it, or pass --trace FILE")
        if instances < 1:
            raise AstroUserError(f"must be ≥ 1, got {instances}", field="--instances")
        prof = load_profile(profile)
        cfg = InstanceConfig.from_profile(prof)
        iparams = parse_assignments(instance_param, "--instance-param")
        ifields = {n: f"--instance-param {n}" for n in iparams}
        build_instance_policy(instance_policy, iparams, prof, fields=ifields)  # bad name/parameter -> one line naming it
        params = parse_assignments(param)
        fields = {n: f"--param {n}" for n in params}
        if k is not None:
            params["k"], fields["k"] = k, "--k"
        dispatch = make_dispatch(policy, fields=fields, **params)
        rng = np.random.default_rng(seed)
        reqs = poisson_workload(read_length_trace(trace), num_requests, rate, cfg.max_model_len, rng)
        res = simulate_cluster(reqs, instances, dispatch, prof, cfg, lambda: build_instance_policy(instance_policy, iparams, prof), rng)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w") as f:
            for r in res.records:
                f.write(json.dumps(r.to_dict()) + "\n")
        ttft = np.array([r.ttft_s for r in res.records])
        e2e = np.array([r.e2e_s for r in res.records])
        console.print(
            f"{len(res.records)} requests on {instances} × {prof.profile_id}, {policy} at {rate:g} req/s: "
            f"TTFT mean {ttft.mean():.3f} s / P99 {np.percentile(ttft, 99):.3f} s, "
            f"E2E mean {e2e.mean():.3f} s / P99 {np.percentile(e2e, 99):.3f} s, "
            f"preemptions {res.num_preemptions}; simulated in {res.wall_s:.2f} s -> {out}",
            highlight=False,
        )
