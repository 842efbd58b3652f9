"""`astro profiles`: list, show, re-fit and scale the execution-time profiles
(`artifacts/profiles/*.json`, fitted by `rps_astro_cli.profiling.fit_profiles`; scaled
copies by `rps_astro_cli.sim.profile.scaled_profile`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from rps_astro_cli.cli.common import JsonOpt, SeedOpt, console, user_errors


def _summary(p) -> dict:  # p: ExecutionProfile
    """Headline numbers of a profile: ids, limits and three step latencies (ms)."""
    from rps_astro_cli.profiling.fit_profiles import sanity_report

    s = sanity_report(p)
    lin = p.fit.get("linear_layers") or {}
    return {
        "profile_id": p.profile_id, "model": p.model, "gpu": p.gpu, "tp": p.tp,
        "num_gpu_blocks": p.num_gpu_blocks, "max_num_seqs": p.max_num_seqs,
        "max_num_batched_tokens": p.max_num_batched_tokens,
        "decode_b1_ctx500_ms": round(s["decode_b1_ctx500_ms"], 2),
        "decode_b48_ctx500_ms": round(s["decode_b48_ctx500_ms"], 2),
        "prefill_512_ms": round(s["prefill_512_ms"], 2),
        "linear_holdout_mape_pct": lin.get("mape_pct"),
        "vision": p.vision is not None,
    }


def _definitions(pairs: list[tuple[str, str]], width: int, indent: str = "  ", col_max: int = 30) -> list[str]:
    """`term  value` lines, values wrapped at words under their column (a term wider than
    `col_max` gets its value on the next line): fits `width` and never splits a word."""
    from rps_astro_cli.cli.common import wrap_help

    col = min(max((len(k) for k, _ in pairs), default=0), col_max) + 2
    pad = indent + " " * col
    lines: list[str] = []
    for k, v in pairs:
        body = wrap_help(v, max(width - len(pad), 20)).splitlines() or [""]
        if len(k) <= col - 2:
            lines.append(f"{indent}{k:<{col}}{body[0]}".rstrip())
        else:
            lines += [f"{indent}{k}", pad + body[0]]
        lines += [pad + b for b in body[1:]]
    return lines


def _tree(obj: dict, width: int, indent: str) -> list[str]:
    """A nested dict as indented `key: value` lines, wrapped at words to `width`."""
    from rps_astro_cli.cli.common import wrap_help

    lines: list[str] = []
    for k, v in obj.items():
        if isinstance(v, dict):
            lines.append(f"{indent}{k}:")
            lines += _tree(v, width, indent + "  ")
        else:
            lines += wrap_help(f"{k}: {v}", width, indent, indent + "    ").splitlines()
    return lines


def register(app: typer.Typer) -> None:
    """Add the `profiles` group to the root app."""
    grp = typer.Typer(help="Execution-time profiles (step-latency coefficients per model × GPU × TP).",
                      no_args_is_help=True)
    app.add_typer(grp, name="profiles")

    @grp.command("list")
    @user_errors
    def list_cmd(as_json: JsonOpt = False) -> None:
        """Table of the shipped profiles with their headline step latencies."""
        from rich import box
        from rich.table import Table

        from rps_astro_cli.sim.profile import list_profiles, load_profile

        rows = [_summary(load_profile(pid)) for pid in list_profiles()]
        if as_json:
            typer.echo(json.dumps(rows, indent=2))
            return
        t = Table(title="shipped execution profiles (artifacts/profiles/)", box=box.SIMPLE_HEAD, show_edge=False,
                  padding=(0, 1), pad_edge=False, collapse_padding=True)
        t.add_column("id", no_wrap=True)
        t.add_column("GPU×TP", no_wrap=True)
        for col in ("blocks", "dec1", "dec48", "pf512", "MAPE%"):
            t.add_column(col, justify="right", no_wrap=True)
        for r in rows:
            t.add_row(r["profile_id"], f"{r['gpu']}×{r['tp']}", str(r["num_gpu_blocks"]),
                      f"{r['decode_b1_ctx500_ms']:.1f}", f"{r['decode_b48_ctx500_ms']:.1f}",
                      f"{r['prefill_512_ms']:.1f}", str(r["linear_holdout_mape_pct"]))
        console.print(t)
        for line in ("", "dec1, dec48: decode step (ms) at batch 1 / 48, 500 context tokens each",
                     "pf512: one 512-token prefill chunk (ms)",
                     "MAPE%: held-out error of the linear-layer fit (astro profiles show ID)"):
            typer.echo(line)

    @grp.command("show")
    @user_errors
    def show_cmd(
        profile_id: Annotated[str, typer.Argument(help="Profile id (artifacts/profiles/<id>.json) or a JSON path.")],
        as_json: JsonOpt = False,
    ) -> None:
        """Coefficients, limits, fit errors and sources of one profile."""
        from rps_astro_cli.sim.profile import load_profile

        p = load_profile(profile_id)
        if as_json:
            typer.echo(json.dumps(p.to_dict(), indent=2))
            return
        s = _summary(p)
        width = console.width
        out = [f"{p.profile_id}: {p.model} on {p.gpu}, TP{p.tp}", "", "step model (seconds unless named)"]
        terms = [(k, f"{v:.4g}") for k, v in (("base_s", p.base_s), ("per_seq_s", p.per_seq_s),
                                              ("decode_attn_s_per_ctx_token", p.decode_attn_s_per_ctx_token),
                                              ("prefill_attn_s_per_token_pair", p.prefill_attn_s_per_token_pair))]
        terms.append(("linear_s(tokens) ms", ", ".join(f"{k}:{v * 1e3:.1f}" for k, v in zip(p.token_knots, p.token_s))))
        terms.append(("limits", f"blocks {p.num_gpu_blocks} × {p.block_size} tokens, max_num_seqs {p.max_num_seqs}, "
                      f"max_num_batched_tokens {p.max_num_batched_tokens}, max_model_len {p.max_model_len}"))
        terms.append(("output_len", f"lognormal mu {p.output_len.mu}, sigma {p.output_len.sigma}, "
                      f"max {p.output_len.max_tokens}"))
        if p.vision:
            terms.append(("vision", json.dumps(p.vision.__dict__)))
        terms.append(("decode b1 / b48 (ctx 500) ms", f"{s['decode_b1_ctx500_ms']} / {s['decode_b48_ctx500_ms']}"))
        terms.append(("prefill 512 ms", str(s["prefill_512_ms"])))
        out += _definitions(terms, width)
        out += ["", "fit (held-out error)"] + _tree(p.fit, width, "  ")
        out += ["", f"sources: astro profiles show {p.profile_id} --json (field 'sources')"]
        for line in out:
            typer.echo(line)

    @grp.command("fit")
    @user_errors
    def fit_cmd(
        out: Annotated[Path, typer.Option("--out", help="Folder to write <profile_id>.json files into "
                                          "(artifacts/profiles replaces the shipped ones).")],
        data_dir: Annotated[Path | None, typer.Option("--data-dir", help="Folder with profiles/*.csv and traces/ "
                                                       "(default: $ASTRO_DATA_DIR or ../shared/data).")] = None,
        seed: SeedOpt = 0,
    ) -> None:
        """Fit every shipped profile from Vidur-schema GPU profiling CSVs and write them."""
        from rps_astro_cli.data_paths import data_dir as default_data_dir
        from rps_astro_cli.errors import AstroUserError
        from rps_astro_cli.profiling.fit_profiles import build_profiles, sanity_report, write_profiles

        d = data_dir or default_data_dir()
        if d is None:
            raise AstroUserError("no sample-data folder: pass --data-dir or set ASTRO_DATA_DIR "
                                 "(the folder holding profiles/*.csv and traces/)", field="--data-dir")
        if not Path(d).is_dir():
            raise AstroUserError(f"--data-dir {d} is not a folder",
                                 fix="pass the folder holding profiles/*.csv and traces/, or set ASTRO_DATA_DIR")
        profiles = build_profiles(Path(d), seed)
        for path, p in zip(write_profiles(profiles, out), profiles):
            s = sanity_report(p)
            typer.echo(f"wrote {path}: decode b1 {s['decode_b1_ctx500_ms']:.1f} ms, "
                       f"prefill 512 {s['prefill_512_ms']:.1f} ms")

    @grp.command("scale")
    @user_errors
    def scale_cmd(
        base: Annotated[str, typer.Argument(help="Profile to copy: id (artifacts/profiles/<id>.json) or a JSON path.")],
        out: Annotated[Path, typer.Option("--out", help="Where to write the copy (a .json path; `--profile PATH` "
                                          "then loads it).")],
        prefill: Annotated[float, typer.Option("--prefill", help="Factor on prefill attention (s per token pair).")] = 1.0,
        decode: Annotated[float, typer.Option("--decode", help="Factor on decode attention (s per context token).")] = 1.0,
        per_seq: Annotated[float, typer.Option("--per-seq", help="Factor on the per-sequence term (s per request "
                                               "in the batch).")] = 1.0,
        shape: Annotated[float, typer.Option("--shape", help="Factor on base_s and the linear-layer curve.")] = 1.0,
        bend: Annotated[float, typer.Option("--bend", help="Bend of the linear-layer curve: each knot's time × (1 + "
                                            "BEND·log2(tokens)/log2(last knot)); > 0: big steps slower than small "
                                            "ones (> -1).")] = 0.0,
        profile_id: Annotated[str | None, typer.Option("--id", help="The copy's profile_id (default: "
                                                       "BASE-scaled-<factors>).")] = None,
    ) -> None:
        """Write a scaled copy of a profile: hardware astro never profiled, for
        model-mismatch experiments (each step-model term scaled on its own, the linear curve
        bent; `sim.profile.scaled_profile`)."""
        from rps_astro_cli.errors import AstroUserError
        from rps_astro_cli.profiling.fit_profiles import sanity_report
        from rps_astro_cli.sim.profile import load_profile, scaled_profile

        if out.suffix != ".json":
            raise AstroUserError(f"{out} does not end in .json", field="--out",
                                 fix="name the file PATH.json (a profile path is told from an id by its suffix)")
        src = load_profile(base)
        try:
            p = scaled_profile(src, prefill=prefill, decode=decode, per_seq=per_seq, shape=shape, bend=bend,
                               profile_id=profile_id)
        except AstroUserError as exc:  # name the flag, not the keyword
            flag = f"--{(exc.field or '').replace('_', '-')}"
            raise AstroUserError(str(exc).removeprefix(f"{exc.field}: "), field=flag) from None
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(p.to_dict(), indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
        a, b = sanity_report(src), sanity_report(p)
        typer.echo(f"wrote {out} ({p.profile_id}): decode b1 {b['decode_b1_ctx500_ms']:.1f} ms (base "
                   f"{a['decode_b1_ctx500_ms']:.1f}), decode b48 {b['decode_b48_ctx500_ms']:.1f} ms (base "
                   f"{a['decode_b48_ctx500_ms']:.1f}), prefill 512 {b['prefill_512_ms']:.1f} ms (base "
                   f"{a['prefill_512_ms']:.1f}); use it with --profile {out}")
