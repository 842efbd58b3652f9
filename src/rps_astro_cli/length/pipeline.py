"""Train-and-save and evaluate-and-compare, the library side of `astro train-length` and
`astro eval-length`. Both build the split the same way (`make_split`), so a model's
recorded test metrics and a later evaluation with the same seed/fractions use the same
conversations."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.length.base import (
    LENGTH_ARTIFACTS_DIR,
    LENGTH_MODELS,
    META_FILE,
    LengthModel,
    LengthModelMeta,
    ProgressFn,
)
from rps_astro_cli.length.data import DataSplit, LengthDataset, load_length_data, split_by_conversation
from rps_astro_cli.length.evaluate import evaluate_model, write_report
from rps_astro_cli.length.store import load_length_model, save_length_model
from rps_astro_cli.length.transformer import TransformerLengthModel

DEFAULT_TEST_FRAC = 0.2
DEFAULT_VAL_FRAC = 0.1
BASELINES = ("median", "linear-prompt")


def make_split(data: LengthDataset, *, test_frac: float, val_frac: float, seed: int) -> DataSplit:
    """The seeded conversation-level split used by training and evaluation alike
    (first child of `np.random.default_rng(seed).spawn(2)`)."""
    split_rng = np.random.default_rng(seed).spawn(2)[0]
    return split_by_conversation(data, test_frac=test_frac, val_frac=val_frac, rng=split_rng)


def fit_rng(seed: int) -> np.random.Generator:
    """The Generator a model's `fit` gets (second child of the seed's generator)."""
    return np.random.default_rng(seed).spawn(2)[1]


def build_model(name: str, hparams: dict[str, Any] | None = None) -> LengthModel:
    """A fresh, untrained model from the registry. `hparams` go to transformer models
    (None values are ignored); other models accept none.

    Raises:
        AstroUserError: unknown model name, or hyper-parameters given to a model without any.
    """
    cls = LENGTH_MODELS.get(name)
    hp = {k: v for k, v in (hparams or {}).items() if v is not None and v is not False}
    if issubclass(cls, TransformerLengthModel):
        return cls(**hp)
    if hp:
        raise AstroUserError(f"options {sorted(hp)} apply to roberta/minilm only", field="--model")
    return cls()


@dataclass
class TrainResult:
    """What `train_length_model` did. metrics: test-split metrics (empty if no test rows)."""

    model: LengthModel
    directory: Path
    metrics: dict[str, Any]
    n_train: int
    n_val: int
    n_test: int
    train_s: float
    notes: list[str] = field(default_factory=list)


def train_length_model(
    data: str | Path,
    *,
    model_name: str = "classic",
    out_dir: str | Path | None = None,
    tokenizer: str | None = None,
    target_model: str = "unspecified",
    responder: str = "unspecified",
    test_frac: float = DEFAULT_TEST_FRAC,
    val_frac: float = DEFAULT_VAL_FRAC,
    seed: int = 0,
    context_turns: int = 0,
    hparams: dict[str, Any] | None = None,
    latency: bool = True,
    progress: ProgressFn | None = None,
) -> TrainResult:
    """Load `data`, split it by conversation, fit `model_name` on train (val for selection),
    measure it on test, and save the artifact (default `artifacts/length/<model_name>`).

    Raises:
        AstroUserError: bad data/options (see `load_length_data`, `split_by_conversation`,
            `build_model`), or too little training data.
    """
    ds = load_length_data(data, tokenizer=tokenizer, context_turns=context_turns)
    split = make_split(ds, test_frac=test_frac, val_frac=val_frac, seed=seed)
    if len(split.train) == 0:
        raise AstroUserError("the split left no training rows", field="--test-split")
    hp = dict(hparams or {})
    out = Path(out_dir) if out_dir else LENGTH_ARTIFACTS_DIR / model_name
    if model_name in ("roberta", "minilm"):
        hp.setdefault("checkpoint_dir", str(out / "checkpoint"))
        if context_turns > 0:  # the current message is at the end: cut long prompts from the left
            hp.setdefault("truncation_side", "left")
    model = build_model(model_name, hp)
    t0 = time.perf_counter()
    info = model.fit(split.train, split.val, rng=fit_rng(seed), progress=progress)
    train_s = time.perf_counter() - t0
    metrics: dict[str, Any] = {}
    if len(split.test):
        metrics, _, _ = evaluate_model(model, split.test.prompts, split.test.targets, latency=latency,
                                       samples=split.test.samples)
    model.meta = LengthModelMeta(
        model=model.name,
        data={"source": Path(str(data)).name if not str(data).startswith("hf:") else str(data),
              "sha256": ds.sha256(), "n_pairs": len(ds), "n_train": len(split.train),
              "n_val": len(split.val), "n_test": len(split.test), "context_turns": context_turns,
              "notes": ds.notes},
        split={"seed": seed, "test_frac": test_frac, "val_frac": val_frac, "by": "conversation id"},
        tokenizer=ds.tokenizer, target_model=target_model, responder=responder,
        metrics=metrics, fit=info, train_s=round(train_s, 3),
    )
    directory = save_length_model(model, out)
    return TrainResult(model, directory, metrics, len(split.train), len(split.val), len(split.test),
                       train_s, list(ds.notes))


@dataclass
class EvalResult:
    """Metrics per model name (artifacts first, then baselines), predictions, notes."""

    results: dict[str, dict[str, Any]]
    predictions: dict[str, np.ndarray]
    targets: np.ndarray
    n_test: int
    split: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    report_paths: list[Path] = field(default_factory=list)


def shipped_models() -> list[str]:
    """Names of artifacts under artifacts/length/ (folders with meta.json)."""
    return sorted(d.name for d in LENGTH_ARTIFACTS_DIR.glob("*") if (d / META_FILE).is_file())


def evaluate_length_models(
    data: str | Path,
    *,
    models: list[str] | None = None,
    baselines: bool = True,
    tokenizer: str | None = None,
    test_frac: float | None = None,
    val_frac: float | None = None,
    seed: int | None = None,
    context_turns: int | None = None,
    out_dir: str | Path | None = None,
    latency: bool = True,
    max_latency_calls: int = 200,
) -> EvalResult:
    """Evaluate saved models (names or folders; default every shipped artifact) and the
    baselines on one test split of `data`. Split settings default to the first model's
    recorded ones, else 0.2 / 0.1 / seed 0. Each model reads prompts built with its own
    recorded `context_turns` unless `context_turns` is given; baselines read the bare
    prompt and are fitted on train + val.

    Raises:
        AstroUserError: bad data/options, an artifact that fails to load, an empty test split.
    """
    names = list(models) if models else shipped_models()
    loaded: list[tuple[str, LengthModel]] = []
    for n in names:
        m = load_length_model(n)
        label = Path(str(n)).name if (Path(str(n)).is_dir() or "/" in str(n)) else str(n)
        while label in dict(loaded) or label in BASELINES:
            label += "'"
        loaded.append((label, m))
    rec: dict[str, Any] = loaded[0][1].meta.split if loaded else {}
    test_frac = rec.get("test_frac", DEFAULT_TEST_FRAC) if test_frac is None else test_frac
    val_frac = rec.get("val_frac", DEFAULT_VAL_FRAC) if val_frac is None else val_frac
    seed = rec.get("seed", 0) if seed is None else seed
    split_info = {"seed": seed, "test_frac": test_frac, "val_frac": val_frac}

    # One dataset per context setting: the pairs, their order, targets and split are the
    # same for every setting; only the prompt text differs.
    splits: dict[int, tuple[LengthDataset, DataSplit]] = {}

    def split_for(ct: int) -> DataSplit:
        if ct not in splits:
            ds_ct = load_length_data(data, tokenizer=tokenizer, context_turns=ct)
            splits[ct] = (ds_ct, make_split(ds_ct, test_frac=test_frac, val_frac=val_frac, seed=seed))
        return splits[ct][1]

    base_split = split_for(0 if context_turns is None else context_turns)
    ds = splits[0 if context_turns is None else context_turns][0]
    if len(base_split.test) == 0:
        raise AstroUserError("the split left no test rows", field="--test-split")
    notes = list(ds.notes)
    data_hashes = {ds.sha256()}
    plan: list[tuple[str, LengthModel, DataSplit]] = []
    for label, m in loaded:
        ct = m.context_turns if context_turns is None else context_turns
        sp_m = split_for(ct)
        data_hashes.add(splits[ct][0].sha256())
        if m.meta.tokenizer != ds.tokenizer:
            notes.append(f"{label}: trained on targets counted with {m.meta.tokenizer!r}, "
                         f"evaluated with {ds.tokenizer!r}")
        same_data = m.meta.data.get("sha256") in data_hashes
        same_split = all(m.meta.split.get(k) == v for k, v in split_info.items())
        if same_data and not same_split:
            notes.append(f"{label}: trained on another split of this data; its test rows may include training rows")
        if ct != m.context_turns:
            notes.append(f"{label}: trained with context_turns={m.context_turns}, evaluated with {ct}")
        plan.append((label, m, sp_m))
    if baselines:
        fit_on = LengthDataset(base_split.train.samples + base_split.val.samples)
        if len(fit_on) == 0:
            notes.append("baselines skipped: the split leaves no rows to fit them on")
        else:
            for b in BASELINES:
                bm = LENGTH_MODELS.get(b)()
                bm.fit(fit_on, None, rng=fit_rng(seed))
                plan.append((b, bm, base_split))
    results: dict[str, dict[str, Any]] = {}
    preds: dict[str, np.ndarray] = {}
    for label, m, sp_m in plan:
        assert np.array_equal(sp_m.test.targets, base_split.test.targets), "context changed the pairs"
        results[label], preds[label], model_notes = evaluate_model(
            m, sp_m.test.prompts, sp_m.test.targets, latency=latency, max_latency_calls=max_latency_calls,
            samples=sp_m.test.samples,
        )
        results[label]["context_turns"] = m.context_turns if label not in BASELINES else 0
        for note in model_notes:
            notes.append(f"{label}: {note}")
    split = base_split
    res = EvalResult(results, preds, split.test.targets, len(split.test), split_info, notes)
    if out_dir:
        header = (f"Length models on {Path(str(data)).name}: test split {test_frac} by conversation, "
                  f"seed {seed}, {len(split.test)} pairs; targets counted with {ds.tokenizer}.")
        res.report_paths = write_report(results, preds, split.test.targets, out_dir, header=header)
    return res
