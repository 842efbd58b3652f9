"""`astro profile` and `astro fit`: RPS-Serve's workload profiler and its impact
estimator + request classifier (library code in `rps_astro_cli.rps`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from rps_astro_cli.cli.common import JsonOpt, SeedOpt, console, user_errors, warn_key_on_command_line


def _ints(text: str, flag: str) -> list[int]:
    from rps_astro_cli.errors import AstroUserError

    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise AstroUserError(f"expected a comma list of integers, got {text!r}", field=flag) from None
    if not vals:
        raise AstroUserError("is empty", field=flag)
    return vals


def register(app: typer.Typer) -> None:
    """Add `profile` and `fit` to the root app."""

    @app.command("profile")
    @user_errors
    def profile(
        engine_url: Annotated[str | None, typer.Option("--engine-url", help="Base URL of a running engine (e.g. http://127.0.0.1:8000).")] = None,
        sim_profile: Annotated[str | None, typer.Option("--sim-profile", help="Instead of an engine: price the plan on this execution profile (exact for the sim engine, no HTTP).")] = None,
        name: Annotated[str | None, typer.Option("--name", help="Output name: artifacts/profiles/<name>.workload.csv (default: the sim profile id, else 'engine').")] = None,
        out: Annotated[Path | None, typer.Option("--out", help="CSV path (overrides --name); summary .md and plot .png go beside it.")] = None,
        modalities: Annotated[str, typer.Option("--modalities", help="Comma list of text,image,video.")] = "text,image,video",
        max_requests: Annotated[int | None, typer.Option("--max-requests", help="Send at most this many new requests in this run.")] = None,
        text_tokens: Annotated[str, typer.Option("--text-tokens", help="Text prompt lengths (tokens), comma list.")] = "16,32,64,128,256,512,1024,1536,2048,3072,4096,6144,8192",
        image_counts: Annotated[str, typer.Option("--image-counts", help="Images per request, comma list.")] = "1,2,3,4,6,8",
        frame_counts: Annotated[str, typer.Option("--frame-counts", help="Video frames per request, comma list.")] = "4,8,16,24,32,48,64",
        repeats: Annotated[int, typer.Option("--repeats", help="Requests per size (different texts).")] = 3,
        output_tokens: Annotated[int, typer.Option("--output-tokens", help="max_tokens of each profiling request (ignore_eos).")] = 8,
        model: Annotated[str | None, typer.Option("--model", help="Model name to send (default: the engine's).")] = None,
        api_key: Annotated[str | None, typer.Option("--api-key", envvar="ASTRO_API_KEY", callback=warn_key_on_command_line, help="Bearer key of the engine.")] = None,
        seed: SeedOpt = 0,
        as_json: JsonOpt = False,
        backend: Annotated[str, typer.Option("--backend", help="workload: the per-request workload CSV (default); vllm: fit an execution profile (step latency model) from a running astro vLLM engine's step log, written as JSON to --out.")] = "workload",
        step_log: Annotated[Path | None, typer.Option("--step-log", help="--backend vllm: the engine's $ASTRO_VLLM_STEP_LOG file.")] = None,
        workload: Annotated[str | None, typer.Option("--workload", "-w", help="Instead of the growing-size plan: profile the requests of this `astro bench` workload as they are (e.g. mix-mh: each image's size by the profile's rule, frames by duration, the real reply lengths; KV = prompt + reply). Priced on --sim-profile / --recipe.")] = None,
        num_requests: Annotated[int, typer.Option("--num-requests", "-n", help="--workload: requests to draw (seeded by --seed).")] = 1000,
        recipe: Annotated[str | None, typer.Option("--recipe", help="Price on this recipe's engine (name under recipes/ or YAML path): its profile (unless --sim-profile) and its engine limits (KV blocks, step budget, max_model_len, chunked prefill).")] = None,
    ) -> None:
        """Profile a model one request at a time over growing text, image and video sizes
        (resumable: points already in the CSV are skipped); with --backend vllm, calibrate
        an execution profile against a real vLLM engine instead."""
        import numpy as np
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from rps_astro_cli.data_paths import ARTIFACTS_DIR
        from rps_astro_cli.errors import AstroUserError
        from rps_astro_cli.profiling import profiler as pf

        if backend == "vllm":  # hook into profiling.vllm_calibrate (the vLLM backend's calibration)
            from rps_astro_cli.profiling.vllm_calibrate import calibrate_engine

            if engine_url is None or step_log is None or out is None:
                raise AstroUserError("--backend vllm needs --engine-url, --step-log and --out", field="--backend")
            res = calibrate_engine(engine_url, step_log, out, name or "vllm-calibrated",
                                   max_requests if max_requests is not None else 48, seed)
            typer.echo(json.dumps(res) if as_json else f"wrote {res['out']}: {res}")
            return
        if backend != "workload":
            raise AstroUserError(f"unknown backend {backend!r} (workload or vllm)", field="--backend")
        if engine_url is not None and (sim_profile is not None or recipe is not None):
            raise AstroUserError("give --engine-url or --sim-profile / --recipe, not both", field="--engine-url")
        if engine_url is None and sim_profile is None and recipe is None:
            raise AstroUserError("give one of --engine-url, --sim-profile and --recipe", field="--engine-url")
        if workload is not None and engine_url is not None:
            raise AstroUserError("--workload is priced on a profile, not sent to an engine", field="--workload",
                                 fix="use --sim-profile or --recipe with it")
        if output_tokens < 1:
            raise AstroUserError(f"must be ≥ 1, got {output_tokens}", field="--output-tokens")
        virt_profile, chunked = None, True
        if engine_url is None:
            virt_profile, chunked = _virtual_profile(sim_profile, recipe)
        csv_default = ARTIFACTS_DIR / "profiles" / f"{name or (virt_profile.profile_id if virt_profile else 'engine')}"
        if workload is not None:
            fpts, warns = _workload_points(workload, num_requests, seed)
            csv_path = out or Path(f"{csv_default}.{workload}.workload.csv")
            with Progress(TextColumn("profiling"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                          console=console, disable=as_json or not console.is_terminal) as prog:
                task = prog.add_task("profile", total=None)
                run = pf.profile_footprints(virt_profile, fpts, csv_path, chunked_prefill=chunked,
                                            max_requests=max_requests,
                                            on_progress=lambda d, t: prog.update(task, completed=d, total=t))
            run.inputs["workload"] = f"{workload}, {num_requests} requests, seed {seed}"
            if warns:
                run.inputs["workload_warnings"] = " | ".join(warns)
            _report_profile(run, csv_path, as_json)
            return
        points = pf.plan_points(
            list(pf.iter_modalities(modalities)), _ints(text_tokens, "--text-tokens"),
            _ints(image_counts, "--image-counts"), _ints(frame_counts, "--frame-counts"), repeats,
        )
        csv_path = out or Path(f"{csv_default}.workload.csv")
        rng = np.random.default_rng(seed)
        with Progress(TextColumn("profiling"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=console, disable=as_json or not console.is_terminal) as prog:
            task = prog.add_task("profile", total=None)

            def tick(done: int, total: int) -> None:
                prog.update(task, completed=done, total=total)

            if virt_profile is not None:
                run = pf.profile_virtual(virt_profile, points, csv_path, rng,
                                         output_tokens=output_tokens, max_requests=max_requests, on_progress=tick)
            else:
                assert engine_url is not None
                run = pf.profile_engine(engine_url, points, csv_path, rng, model=model, output_tokens=output_tokens,
                                        max_requests=max_requests, api_key=api_key, on_progress=tick)
        _report_profile(run, csv_path, as_json)

    def _report_profile(run, csv_path: Path, as_json: bool) -> None:
        """Summary .md and plot .png beside the CSV; the table (or --json); exit 1 when
        nothing was profiled and something failed."""
        from rps_astro_cli.cli.tables import print_table
        from rps_astro_cli.profiling import profiler as pf
        from rps_astro_cli.rps.records import read_profile_csv

        records = read_profile_csv(csv_path) if csv_path.exists() else []
        summary = pf.summarize(records)
        png = pf.write_plots(records, csv_path.with_suffix(".png")) if records else None
        md = csv_path.with_suffix(".summary.md")
        cols = list(summary[0]) if summary else []
        lines = [f"# Workload profile `{csv_path.name}`", "", f"Inputs: {json.dumps(run.inputs)}", "",
                 "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in s.values()) + " |" for s in summary]
        md.write_text("\n".join(lines) + "\n")
        result = {"csv": str(csv_path), "summary_md": str(md), "plot_png": str(png) if png else None,
                  "new_rows": run.done, "skipped_existing": run.skipped_existing,
                  "rejected": run.rejected, "failed": run.failed, "inputs": run.inputs, "summary": summary}
        if as_json:
            typer.echo(json.dumps(result))
        else:
            print_table(console, f"workload profile: {csv_path}",
                        ["modality", "rows", "prompt tokens min/med/max", "prefill ms med", "prefill ms p90",
                         "encoder ms med", "preprocess ms med"],
                        [[s["modality"], str(s["rows"]),
                          f"{s['prompt_tokens_min']}/{s['prompt_tokens_median']:.0f}/{s['prompt_tokens_max']}",
                          f"{s['prefill_ms_median']:.1f}", f"{s['prefill_ms_p90']:.1f}",
                          f"{s['encoder_ms_median']:.1f}", f"{s['preprocess_ms_median']:.1f}"] for s in summary])
            console.print(f"new rows {run.done}, already there {run.skipped_existing}, "
                          f"rejected {len(run.rejected)}, failed {len(run.failed)}; inputs: {run.inputs}")
            for key, why in (run.rejected + run.failed)[:5]:
                console.print(f"  {key}: {why}", highlight=False)
            console.print(f"wrote {csv_path}, {md}" + (f", {png}" if png else ""))
        if run.done == 0 and (run.failed or run.rejected):
            raise typer.Exit(1)

    def _virtual_profile(sim_profile: str | None, recipe: str | None):
        """(profile, chunked prefill): --sim-profile, else the recipe's profile; the
        recipe's engine limits override the profile's, as `astro serve` runs them."""
        from dataclasses import replace

        from rps_astro_cli.errors import AstroUserError
        from rps_astro_cli.sim.profile import load_profile

        if recipe is None:
            return load_profile(sim_profile or ""), True
        from rps_astro_cli.bench.virtual import load_bench_recipe

        eng = load_bench_recipe(recipe).engine
        pid = sim_profile or eng.profile
        if not pid:
            raise AstroUserError(f"recipe {recipe} names no engine.profile", field="--recipe",
                                 fix="add --sim-profile")
        prof = load_profile(pid)
        lim = {k: getattr(eng, k) for k in ("num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens",
                                            "max_model_len") if getattr(eng, k) is not None}
        return replace(prof, **lim), bool(eng.chunked_prefill)

    def _workload_points(workload: str, num_requests: int, seed: int) -> tuple[list, list[str]]:
        """(points, the loader's warnings): the workload's requests (`astro bench`'s
        loader, seeded by `seed`) as footprint points — text tokens, each image's size,
        frames, the reply's length."""
        import numpy as np

        from rps_astro_cli.bench.workload_base import WorkloadOptions
        from rps_astro_cli.bench.workloads import load_workload
        from rps_astro_cli.profiling.profiler import FootprintPoint

        wl = load_workload(workload, WorkloadOptions(num_requests=num_requests, seed=seed),
                           np.random.default_rng(seed))
        return [FootprintPoint(f"wl-{r.request_id}", r.modality, r.prompt_tokens, max(1, r.output_tokens),
                               tuple((m.width_px, m.height_px) for m in r.media if m.kind == "image"),
                               r.num_frames)
                for r in wl.requests], list(wl.warnings)

    @app.command("fit")
    @user_errors
    def fit(
        profile_csv: Annotated[Path, typer.Argument(help="Workload profile CSV written by `astro profile`.")],
        name: Annotated[str, typer.Option("--name", help="Artifact name: the classifier goes to <out-dir>/<name>/.")],
        out_dir: Annotated[Path | None, typer.Option("--out-dir", help="Artifact root (default artifacts/rps).")] = None,
        test_fraction: Annotated[float, typer.Option("--test-fraction", help="Share of rows per modality held out for MAE.")] = 0.2,
        seed: SeedOpt = 0,
        as_json: JsonOpt = False,
        select: Annotated[str, typer.Option("--select", help="kmeans: the k-means classifier (the paper's clustering); ttft: choose among k-means and class boundaries on the combined score by the change of mean TTFT (rps vs fcfs) on a replay of the profile's rows through one instance of --recipe's engine at --request-rate (needs a workload profile: astro profile --workload).")] = "kmeans",
        recipe: Annotated[str | None, typer.Option("--recipe", help="--select ttft: the engine to replay on (name under recipes/ or YAML path): profile, limits, rps parameters.")] = None,
        request_rate: Annotated[float | None, typer.Option("--request-rate", help="--select ttft: Poisson rate of the replay (req/s).")] = None,
        select_seeds: Annotated[str, typer.Option("--select-seeds", help="--select ttft: replay seeds (comma list; the fit's own, not a benchmark's).")] = "101,102,103",
        select_requests: Annotated[int, typer.Option("--select-requests", help="--select ttft: profile rows per replay.")] = 200,
    ) -> None:
        """Fit the impact estimator (linear / 0.9-quantile regression) and the
        sand/pebbles/rocks classifier (k-means, or chosen by TTFT with --select ttft) from a
        workload profile; print held-out MAE and the classes (k-means centroids, or the chosen
        boundaries) beside the naive (by-modality) baseline."""
        from rps_astro_cli.cli.tables import print_table
        from rps_astro_cli.errors import AstroUserError
        from rps_astro_cli.profiling.rps_fit import fit_profile
        from rps_astro_cli.rps.classes import CLASSES
        from rps_astro_cli.rps.classifier import RPS_ARTIFACTS_DIR

        score, objective = None, ""
        if select not in ("kmeans", "ttft"):
            raise AstroUserError(f"unknown selection {select!r}", field="--select", fix="use kmeans or ttft")
        if select == "ttft":
            if recipe is None or request_rate is None:
                raise AstroUserError("--select ttft needs --recipe and --request-rate", field="--select",
                                     fix="e.g. --recipe rps-serve-testbed --request-rate 2")
            from rps_astro_cli.bench.rps_select import replay_scorer
            from rps_astro_cli.bench.virtual import load_bench_recipe
            from rps_astro_cli.rps.records import read_profile_csv

            prof, chunked = _virtual_profile(None, recipe)
            eng = load_bench_recipe(recipe).engine
            score, objective = replay_scorer(
                read_profile_csv(profile_csv), prof, rate_rps=request_rate, chunked_prefill=chunked,
                preprocess_slots=eng.preprocess_slots, policy_params=dict(eng.instance_policy_params or {}),
                seeds=_ints(select_seeds, "--select-seeds"), num_requests=select_requests)
        elif recipe is not None or request_rate is not None:
            raise AstroUserError("--recipe and --request-rate apply to --select ttft only", field="--select",
                                 fix="add --select ttft")
        rep = fit_profile(profile_csv, name, out_dir or RPS_ARTIFACTS_DIR, seed=seed, test_fraction=test_fraction,
                          score=score, objective=objective)
        if as_json:
            typer.echo(json.dumps({"out_dir": str(rep.out_dir), **rep.metadata}))
            return
        print_table(console, "impact estimator: held-out error per modality",
                    ["modality", "model", "train", "test", "MAE ms", "under-est.", "KV MAE tokens"],
                    [[m.modality, m.kind, str(m.n_train), str(m.n_test) + (" (in-sample)" if m.in_sample else ""),
                      f"{m.mae_ms:.2f}", f"{m.under_rate:.0%}", f"{m.kv_mae_tokens:.1f}"]
                     for m in rep.estimator_metrics],
                    right=[False, False, True, True, True, True, True])
        ct = rep.classifier.crosstab
        sel = rep.selection
        by_modality = [[str(ct.get(m, {}).get(k, 0)) for m in ("text", "image", "video")] for k in CLASSES]
        if sel is not None and sel.chosen.t_sand is not None:  # boundaries chosen: its centroids mean nothing
            print_table(console, f"classes (boundaries {sel.chosen.t_sand:.3f} / {sel.chosen.t_rocks:.3f})",
                        ["class", "rows", "text", "image", "video"],
                        [[k, str(rep.classifier.counts[k]), *mods] for k, mods in zip(CLASSES, by_modality)])
        else:
            cens = {cen["class"]: cen for cen in rep.classifier.classifier.centroids_original()}
            print_table(console, "classifier centroids (k-means, k=3)",
                        ["class", "prefill ms", "KV tokens", "rows", "text", "image", "video"],
                        [[k, f"{cens[k]['prefill_s'] * 1000:.1f}", f"{cens[k]['kv_tokens']:.0f}",
                          str(rep.classifier.counts[k]), *mods] for k, mods in zip(CLASSES, by_modality)])
        if sel is not None:
            console.print(f"objective: {sel.objective}", highlight=False)
            km, ch = sel.kmeans, sel.chosen
            console.print(f"k-means {km.score:+.1f} %; naive classes {sel.naive_score:+.1f} % (reference); "
                          f"chosen: {ch.kind}"
                          + (f" (boundaries {ch.t_sand:.3f} / {ch.t_rocks:.3f})" if ch.t_sand is not None else "")
                          + f" {ch.score:+.1f} % of {len(sel.candidates)} candidates", highlight=False)
        console.print(f"naive classifier (text→sand, image→pebbles, video→rocks) agrees on "
                      f"{rep.classifier.naive_agreement:.0%} of the profile rows")
        console.print(f"wrote {rep.out_dir}/classifier.joblib and metadata.json")
