"""`astro simulate`: run a length trace (or a Mooncake block-hash trace, with its
prompts' shared blocks: `_mooncake_requests`) through the virtual-time cluster simulation
(library: `rps_astro_cli.cluster.simulate_cluster`) and write one JSON record per
request. `astro bench --virtual` builds richer workloads on the same library.

The fleet: `--recipe` (an `astro serve` recipe: instances or instance groups, each
group's profile and limits, the instance and dispatch policies as defaults) or
`--instances` × `--profile`; `--profile P1,P2,…` gives one profile per instance and
`--predictor-profile P[,…]` what the Predictors are told (`services.config.with_fleet`,
the rules `astro serve` and `astro bench --virtual` apply)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from rps_astro_cli.cli.common import (
    InstanceParamOpt,
    ParamOpt,
    SeedOpt,
    console,
    deprecated_alias,
    pick_alias,
    user_errors,
)

if TYPE_CHECKING:
    import numpy as np

    from rps_astro_cli.cluster import TimedRequest

DEFAULT_POLICY = "power_of_k"
"""Dispatch policy without --policy or a recipe: the one `astro bench --virtual` and
`astro serve` use."""

_DATASETS = {
    "astrolabe-sharegpt": "traces/astrolabe_sharegpt_val_10k_llama2.csv",
    "azure-conv": "traces/AzureLLMInferenceTrace_conv_2023.csv",
    "mooncake-conv": "traces/mooncake/conversation_trace.jsonl",
}


def _mooncake_requests(path: Path, num_requests: int, rate: float, max_model_len: int,
                       rng: np.random.Generator) -> list[TimedRequest]:
    """A Mooncake block-hash trace as simulate's requests: `-w mooncake`'s loader (its first
    `num_requests` rows, not cycled: a repeat would be a false cache hit) fitted to
    `max_model_len` by its rule (prompts cut at a 512-token block to ≤ max_model_len − 512,
    replies to what is left), each with its prompt's token ids so the prefix caches see the
    trace's sharing; Poisson arrivals at `rate` as for a CSV trace, oracle lengths.

    Raises:
        AstroUserError: rate ≤ 0, num_requests < 1, or a file the loader refuses.
    """
    import numpy as np

    from rps_astro_cli.bench.workload_base import WorkloadOptions
    from rps_astro_cli.bench.workloads import load_workload
    from rps_astro_cli.cluster import TimedRequest
    from rps_astro_cli.errors import AstroUserError
    from rps_astro_cli.tokens import token_ids_fallback

    if not rate > 0:
        raise AstroUserError(f"must be > 0, got {rate}", field="--request-rate")
    opts = WorkloadOptions(path=path, num_requests=num_requests, max_prompt_tokens=max(1, max_model_len - 512),
                           max_total_tokens=max_model_len)
    wl = load_workload("mooncake", opts, rng)
    t = np.cumsum(rng.exponential(1.0 / rate, size=len(wl.requests)))
    return [TimedRequest(f"req-{i}", float(t[i]), r.prompt_tokens, r.output_tokens,
                         token_ids=tuple(token_ids_fallback(r.prompt))) for i, r in enumerate(wl.requests)]


def register(app: typer.Typer) -> None:
    """Add the `simulate` command to the root app."""

    @app.command("simulate")
    @user_errors
    def simulate(
        ctx: typer.Context,
        path: Annotated[Path | None, typer.Option("--path", help="CSV length trace (prompt/output token columns), or a Mooncake block-hash trace (*.jsonl: prompts share blocks as its hash_ids do; docs/workloads-mooncake.md).")] = None,
        dataset: Annotated[str | None, typer.Option("--dataset", help=f"Named trace from the sample-data folder (not shipped with the package: set ASTRO_DATA_DIR, default ../shared/data) instead of --path: {', '.join(_DATASETS)}.")] = None,
        recipe: Annotated[str | None, typer.Option("--recipe", help="An astro serve recipe (name under recipes/ or YAML path): its instances (or instance groups, each with its profile and limits), instance policy and dispatch policy; flags given win.")] = None,
        instances: Annotated[int | None, typer.Option("--instances", help="Number of simulated instances (≥ 1; default: the recipe's, else one per --profile listed, else 12).")] = None,
        request_rate: Annotated[float, typer.Option("--request-rate", help="Poisson arrival rate (requests/s, > 0).")] = 30.0,
        num_requests: Annotated[int, typer.Option("--num-requests", "-n", help="Requests to simulate (trace rows cycle).")] = 1000,
        policy: Annotated[str | None, typer.Option("--policy", help="Dispatch policy (round_robin, power_of_k, least_kv, ...; see `astro policies`).  [default: power_of_k, or the recipe's with its parameters]")] = None,
        k: Annotated[str | None, typer.Option("--k", help="power_of_k: sample size (int or 'all').")] = None,
        param: ParamOpt = None,
        instance_policy: Annotated[str | None, typer.Option("--instance-policy", help="In-instance policy (fcfs, ...; default: the recipe's, else fcfs).")] = None,
        instance_param: InstanceParamOpt = None,
        profile: Annotated[str | None, typer.Option("--profile", help="Execution profile id or JSON path of every instance, or P1,P2,... one per instance (default: the recipe's, else llama-2-7b-a30).")] = None,
        predictor_profile: Annotated[str | None, typer.Option("--predictor-profile", help="The profile the Predictors' look-ahead is told: one for all, or P1,P2,... one per instance (default: each its instance's own).")] = None,
        seed: SeedOpt = 0,
        out: Annotated[Path, typer.Option("--out", help="Records file (JSON lines, one per request).")] = Path("records.jsonl"),
        old_trace: Annotated[Path | None, typer.Option("--trace", hidden=True, callback=deprecated_alias("--trace", "--path"))] = None,
        old_rate: Annotated[float | None, typer.Option("--rate", hidden=True, callback=deprecated_alias("--rate", "--request-rate"))] = None,
    ) -> None:
        """Simulate a cluster in virtual time: trace lengths, Poisson arrivals, a dispatch
        policy; writes per-request records (arrival, dispatch, first token, finish,
        tokens, instance, preemptions) and prints a summary."""
        import json
        from collections import Counter

        import numpy as np

        from rps_astro_cli.bench.virtual import load_bench_recipe, load_fleet
        from rps_astro_cli.cluster import poisson_workload, read_length_trace, simulate_cluster
        from rps_astro_cli.data_paths import data_dir
        from rps_astro_cli.dispatch import make_dispatch
        from rps_astro_cli.errors import AstroUserError
        from rps_astro_cli.params import parse_assignments
        from rps_astro_cli.policies import build_instance_policy
        from rps_astro_cli.services.config import parse_config, split_profiles, with_fleet
        from rps_astro_cli.types import InstanceConfig

        trace = pick_alias(ctx, "--path", path, "--trace", old_trace)
        rate = pick_alias(ctx, "--request-rate", request_rate, "--rate", old_rate)
        if (trace is None) == (dataset is None):
            raise AstroUserError("give exactly one of --path FILE or --dataset NAME", field="--path")
        if dataset is not None:
            if dataset not in _DATASETS:
                raise AstroUserError(f"unknown dataset {dataset!r}", field="--dataset",
                                     fix=f"choose one of: {', '.join(_DATASETS)}")
            root = data_dir()
            if root is None:
                raise AstroUserError(f"--dataset {dataset} needs the sample-data folder and none was found",
                                     fix=f"set ASTRO_DATA_DIR to the folder holding {_DATASETS[dataset]}, "
                                         "or pass --path FILE")
            trace = root / _DATASETS[dataset]
            if not trace.is_file():
                raise AstroUserError(f"--dataset {dataset}: {trace} is missing from the sample-data folder {root}",
                                     fix="point ASTRO_DATA_DIR at a folder holding it, or pass --path FILE")
        if instances is not None and instances < 1:
            raise AstroUserError(f"must be ≥ 1, got {instances}", field="--instances")
        rc = load_bench_recipe(recipe) if recipe else None
        listed = split_profiles(profile) or []
        if instances is None and rc is None and len(listed) < 2:
            instances = 12
        fleet_cfg = with_fleet(rc or parse_config({"engine": {"profile": "llama-2-7b-a30"}}, "defaults"),
                               instances=instances, profile=profile, predictor_profile=predictor_profile,
                               source=f"recipe {recipe}" if recipe else "defaults")
        fleet = load_fleet(fleet_cfg)
        prof = fleet.profiles[0]  # instance-policy defaults (edf, rps): the first instance's profile
        eng = fleet_cfg.engine
        configs = [InstanceConfig.from_profile(p, chunked_prefill=eng.chunked_prefill) for p in fleet.profiles]
        ipol = instance_policy or (rc.engine.instance_policy if rc else "fcfs")
        iparams = dict(rc.engine.instance_policy_params) if rc and instance_policy is None else {}
        iparams.update(parse_assignments(instance_param, "--instance-param"))
        ifields = {n: f"--instance-param {n}" for n in iparams}
        build_instance_policy(ipol, iparams, prof, fields=ifields)  # bad name/parameter -> one line naming it
        params: dict = dict(rc.scheduler.policy_params()) if rc and policy is None else {}
        fields = {n: f"recipe scheduler.{n}" for n in params}
        given = parse_assignments(param)
        params.update(given)
        fields.update({n: f"--param {n}" for n in given})
        if k is not None:
            params["k"], fields["k"] = k, "--k"
        policy = policy or (rc.scheduler.policy if rc else DEFAULT_POLICY)
        dispatch = make_dispatch(policy, fields=fields, **params)
        rng = np.random.default_rng(seed)
        max_len = min(c.max_model_len for c in configs)
        assert trace is not None  # --path, or --dataset's file (checked above)
        try:
            if trace.suffix == ".jsonl":
                reqs = _mooncake_requests(trace, num_requests, rate, max_len, rng)
            else:
                reqs = poisson_workload(read_length_trace(trace), num_requests, rate, max_len, rng)
        except AstroUserError as exc:  # the library names the old flags: name the ones given
            renames = {old: new for old, new, given in (("--trace", "--path", old_trace is None),
                                                         ("--rate", "--request-rate", old_rate is None)) if given}
            if exc.field not in renames:
                raise
            raise AstroUserError(str(exc).replace(exc.field, renames[exc.field]),
                                 field=renames[exc.field]) from None
        hetero = fleet.heterogeneous
        extra = {} if fleet.assumed is None else {"predictor_latency": list(fleet.assumed)}
        res = simulate_cluster(reqs, len(configs), dispatch, list(fleet.profiles) if hetero else prof,
                               configs if hetero else configs[0], lambda: build_instance_policy(ipol, iparams, prof),
                               rng, preprocess_slots=eng.preprocess_slots, **extra)
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("w") as f:
            for r in res.records:
                f.write(json.dumps(r.to_dict()) + "\n")
        ttft = np.array([r.ttft_s for r in res.records])
        e2e = np.array([r.e2e_s for r in res.records])
        runs = Counter(p.profile_id for p in fleet.profiles)
        told = "" if fleet.assumed is None else \
            f" (Predictors told {' + '.join(f'{n} × {p}' for p, n in Counter(a.profile_id for a in fleet.assumed).items())})"
        console.print(
            f"{len(res.records)} requests on {' + '.join(f'{n} × {p}' for p, n in runs.items())}{told}, "
            f"{policy} at {rate:g} req/s: "
            f"TTFT mean {ttft.mean():.3f} s / P99 {np.percentile(ttft, 99):.3f} s, "
            f"E2E mean {e2e.mean():.3f} s / P99 {np.percentile(e2e, 99):.3f} s, "
            f"preemptions {res.num_preemptions}"
            + (f", prefix-cache hits {res.prefix_cache_hits_tokens / res.prefix_cache_queries_tokens:.1%} of prompt "
               "tokens" if res.prefix_cache_queries_tokens else "")
            + f"; simulated in {res.wall_s:.2f} s -> {out}",
            highlight=False,
        )
