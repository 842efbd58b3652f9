"""`astro train-length` and `astro eval-length`: response-length models for the tagger."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any

import typer

from rps_astro_cli.cli.common import JsonOpt, SeedOpt, console, err_console, user_errors
from rps_astro_cli.errors import AstroUserError

DataOpt = Annotated[
    Path | None,
    typer.Option("--data", help="ShareGPT .json/.jsonl, (prompt,response_tokens) .jsonl/.csv, or hf:NAME[:SPLIT]. "
                 "Default: the ShareGPT sample in $ASTRO_DATA_DIR (../shared/data)."),
]
TokenizerOpt = Annotated[
    str | None,
    typer.Option("--tokenizer", help="Local tokenizer folder of the target model for counting reply tokens "
                 "(default: the shared fallback counter)."),
]
TestSplitOpt = Annotated[float | None, typer.Option("--test-split", help="Fraction of conversations held out for test.")]
ValSplitOpt = Annotated[float | None, typer.Option("--val-split", help="Fraction of conversations for validation.")]
ContextOpt = Annotated[int | None, typer.Option("--context-turns", help="Earlier turns prepended to each prompt.")]


def _default_data(data: Path | None) -> str:
    if data is not None:
        return str(data)
    from rps_astro_cli.data_paths import data_dir

    d = data_dir()
    cand = d / "sharegpt" / "sharegpt_v3_sample500.json" if d else None
    if cand is None or not cand.is_file():
        raise AstroUserError("no --data given and no sample data found", field="--data",
                             fix="pass --data FILE or set ASTRO_DATA_DIR")
    return str(cand)


def _json_safe(obj: Any) -> Any:
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return obj


def _table(results: dict[str, dict[str, Any]], title: str) -> None:
    """Metrics per model; never truncates a number (split into parts on narrow consoles)."""
    from rps_astro_cli.cli.tables import print_table
    from rps_astro_cli.length.evaluate import BATCH_SIZE

    cols = [("mae", "MAE tok", 1), ("mape", "MAPE %", 1), ("median_ae", "median AE", 1),
            ("kendall_tau", "Kendall τ", 3), ("bucket_accuracy", "bucket acc", 3),
            ("p50_ms_batch1", "p50 ms b=1", 3), ("p99_ms_batch1", "p99 ms b=1", 3),
            ("p50_ms_batched", f"p50 ms/req b={BATCH_SIZE}", 3)]
    rows = []
    for name, r in results.items():
        cells = []
        for key, _, nd in cols:
            v = r.get(key)
            cells.append("–" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.{nd}f}")
        rows.append([name, str(r.get("context_turns", 0)), str(r.get("n", "")), *cells])
    print_table(console, title, ["model", "ctx", "n", *(head for _, head, _ in cols)], rows)


@user_errors
def train_length(
    data: DataOpt = None,
    model: Annotated[str, typer.Option("--model", help="chat-gbm | classic | roberta | minilm | median | linear-prompt")] = "classic",
    out: Annotated[Path | None, typer.Option("--out", help="Artifact folder (default artifacts/length/<model>).")] = None,
    tokenizer: TokenizerOpt = None,
    target_model: Annotated[str, typer.Option("--target-model", help="Model whose reply lengths are learned (recorded).")] = "unspecified",
    responder: Annotated[str, typer.Option("--responder", help="Who wrote the training replies (recorded).")] = "unspecified",
    test_split: TestSplitOpt = 0.2,
    val_split: ValSplitOpt = 0.1,
    seed: SeedOpt = 0,
    context_turns: ContextOpt = 0,
    backbone: Annotated[str | None, typer.Option("--backbone", help="roberta/minilm: local checkpoint folder.")] = None,
    epochs: Annotated[int | None, typer.Option("--epochs", min=1, help="roberta/minilm: max epochs.")] = None,
    batch_size: Annotated[int | None, typer.Option("--batch-size", min=1, help="roberta/minilm: batch size.")] = None,
    lr: Annotated[float | None, typer.Option("--lr", help="roberta/minilm: peak learning rate.")] = None,
    max_length: Annotated[int | None, typer.Option("--max-length", min=8, help="roberta/minilm: max prompt tokens.")] = None,
    patience: Annotated[int | None, typer.Option("--patience", min=0, help="roberta/minilm: stop after this many epochs without a better validation MAE (0 = never; default 2).")] = None,
    max_train_min: Annotated[float | None, typer.Option("--max-train-min", help="roberta/minilm: wall-clock budget (minutes).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="roberta/minilm: continue from OUT/checkpoint/state.pt.")] = False,
    device: Annotated[str | None, typer.Option("--device", help="roberta/minilm: torch device (default cuda if present, else cpu).")] = None,
    latency: Annotated[bool, typer.Option("--latency/--no-latency", help="Time per-request prediction on the test prompts (recorded in meta.json).")] = True,
    as_json: JsonOpt = False,
) -> None:
    """Train a response-length model on (prompt, reply) pairs, report its test metrics and
    save it as an artifact folder (meta.json + weights)."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from rps_astro_cli.length.pipeline import train_length_model

    hp = {"backbone": backbone, "epochs": epochs, "batch_size": batch_size, "lr": lr, "max_length": max_length,
          "patience": patience, "max_train_s": max_train_min * 60 if max_train_min else None,
          "resume": resume, "device": device}
    with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                  console=err_console, disable=as_json, transient=True) as bar:
        task = bar.add_task(f"training {model}", total=1.0)

        def progress(msg: str, frac: float) -> None:
            bar.update(task, completed=frac, description=f"{model}: {msg}")

        res = train_length_model(
            _default_data(data), model_name=model, out_dir=out, tokenizer=tokenizer, target_model=target_model,
            responder=responder, test_frac=test_split if test_split is not None else 0.2,
            val_frac=val_split if val_split is not None else 0.1, seed=seed, context_turns=context_turns or 0,
            hparams=hp, latency=latency, progress=progress,
        )
    if as_json:
        typer.echo(json.dumps(_json_safe({"model": model, "artifact": str(res.directory), "n_train": res.n_train,
                                          "n_val": res.n_val, "n_test": res.n_test, "train_s": res.train_s,
                                          "metrics": res.metrics, "notes": res.notes})))
        return
    for note in res.notes:
        err_console.print(f"note: {note}", highlight=False)
    console.print(f"trained {model} on {res.n_train} pairs (val {res.n_val}) in {res.train_s:.1f} s → {res.directory}")
    if res.metrics:
        _table({model: res.metrics}, f"test split: {res.n_test} pairs")


@user_errors
def eval_length(
    data: DataOpt = None,
    model: Annotated[list[str] | None, typer.Option("--model", help="Artifact name or folder; repeatable (default: every artifact in artifacts/length/).")] = None,
    baselines: Annotated[bool, typer.Option("--baselines/--no-baselines", help="Also report the median and linear-in-prompt-length baselines.")] = True,
    tokenizer: TokenizerOpt = None,
    test_split: TestSplitOpt = None,
    val_split: ValSplitOpt = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Split seed (default: the first model's recorded one).")] = None,
    context_turns: ContextOpt = None,
    out: Annotated[Path | None, typer.Option("--out", help="Write metrics.json, metrics.md, scatter.png, error_cdf.png here.")] = None,
    latency: Annotated[bool, typer.Option("--latency/--no-latency", help="Measure per-request prediction latency.")] = True,
    cv: Annotated[int | None, typer.Option("--cv", min=2, help="Cross-validate instead: retrain each --model "
                  "(artifact recipe, registry name, or NAME@CONTEXT_TURNS) on K folds by conversation.")] = None,
    cv_seeds: Annotated[str, typer.Option("--cv-seeds", help="--cv: comma-separated fold seeds.")] = "0,1,2",
    as_json: JsonOpt = False,
) -> None:
    """Compare length models and baselines on one conversation-level test split: MAE, MAPE,
    median AE, Kendall τ, bucket accuracy and per-request latency. With --cv K: retrain
    every model on K folds × each seed and report mean [min–max] over the folds."""
    if cv is not None:
        from rps_astro_cli.length.base import DEFAULT_MODEL

        _eval_cv(_default_data(data), model or [DEFAULT_MODEL], cv, cv_seeds, tokenizer, context_turns, baselines, out,
                 as_json)
        return
    from rps_astro_cli.length.pipeline import evaluate_length_models

    res = evaluate_length_models(
        _default_data(data), models=model or None, baselines=baselines, tokenizer=tokenizer, test_frac=test_split,
        val_frac=val_split, seed=seed, context_turns=context_turns, out_dir=out, latency=latency,
    )
    if as_json:
        typer.echo(json.dumps(_json_safe(res.results), sort_keys=True))
        for note in res.notes:
            err_console.print(f"note: {note}", highlight=False)
        return
    for note in res.notes:
        err_console.print(f"note: {note}", highlight=False)
    s = res.split
    _table(res.results, f"test split {s['test_frac']} by conversation, seed {s['seed']}: {res.n_test} pairs")
    for p in res.report_paths:
        console.print(f"wrote {p}")


def _parse_seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise AstroUserError(f"{text!r} is not a comma-separated list of integers", field="--cv-seeds",
                             fix="e.g. --cv-seeds 0,1,2") from None
    if not seeds:
        raise AstroUserError("no seeds given", field="--cv-seeds", fix="e.g. --cv-seeds 0,1,2")
    return seeds


def _eval_cv(data: str, specs: list[str], folds: int, seeds_text: str, tokenizer: str | None,
             context_turns: int | None, baselines: bool, out: Path | None, as_json: bool) -> None:
    from rich.progress import Progress, TextColumn, TimeElapsedColumn

    from rps_astro_cli.length.crossval import cross_validate, markdown_cv_table, recipe_for

    seeds = _parse_seeds(seeds_text)
    recipes = [recipe_for(s, context_turns) for s in specs]
    with Progress(TextColumn("{task.description}"), TimeElapsedColumn(), console=err_console,
                  disable=as_json, transient=True) as bar:
        task = bar.add_task("cross-validating", total=None)
        res = cross_validate(data, recipes, folds=folds, seeds=seeds, tokenizer=tokenizer, baselines=baselines,
                             progress=lambda msg: bar.update(task, description=msg))
    payload = {"data": Path(data).name, "n_pairs": res.n_pairs, "n_conversations": res.n_conversations,
               "folds": res.folds, "seeds": list(res.seeds), "summary": res.summary, "rows": res.rows}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "cv.json").write_text(json.dumps(_json_safe(payload), indent=2, sort_keys=True) + "\n", encoding="utf-8")
        (out / "cv.md").write_text(f"{Path(data).name}: {res.n_pairs} pairs, {res.n_conversations} conversations; "
                                   f"{res.folds} folds by conversation × seeds {list(res.seeds)}; "
                                   "mean [min–max] over folds\n\n" + markdown_cv_table(res), encoding="utf-8")
    if as_json:
        typer.echo(json.dumps(_json_safe(payload), sort_keys=True))
        return
    from rps_astro_cli.cli.tables import print_table

    cols = [("mae", "MAE tok", 1), ("mae_ratio", "MAE/median", 3), ("kendall_tau", "τ", 3),
            ("mae_ratio_first", "1st: MAE/median", 3), ("kendall_tau_first", "1st: τ", 3),
            ("coverage_p10_p90", "in p10–p90", 3)]
    rows = []
    for label, summ in res.summary.items():
        cells = []
        for key, _, nd in cols:
            v = summ.get(key)
            cells.append("–" if v is None or not math.isfinite(v["mean"]) else
                         f"{v['mean']:.{nd}f} [{v['min']:.{nd}f}–{v['max']:.{nd}f}]")
        rows.append([label, *cells])
    print_table(console, f"{res.folds}-fold CV by conversation × seeds {','.join(map(str, res.seeds))}: "
                f"{res.n_pairs} pairs, mean [min–max] over folds", ["model", *(h for _, h, _ in cols)], rows)
    if out is not None:
        console.print(f"wrote {out / 'cv.json'} and {out / 'cv.md'}")


def register(app: typer.Typer) -> None:
    """Add `train-length` and `eval-length` to the root app."""
    app.command("train-length")(train_length)
    app.command("eval-length")(eval_length)
