"""Fit the look-ahead's conditional remaining-length tables (`sim/remaining.py`) for a
length model, from its own TRAINING data only (never its test split):

    nice -n 10 .venv/bin/python scripts/fit_remaining_table.py            # shipped model

- "ratio": out-of-fold ratios true / predicted over train + val (5 folds by conversation
  id, each fold predicted by a model of the same kind fitted on the other four without a
  validation split), as `--atoms` equal-probability atoms;
- "empirical": the train + val reply lengths (tokens) as `--atoms` atoms.

Writes `artifacts/dispatch/remaining_<model>.json`: numbers only (atoms, counts, the
SHA-256 of the model files and of the data it was fitted on), no prompt text.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from rps_astro_cli.length import default_length_model, load_length_model
from rps_astro_cli.length.data import LengthDataset, load_length_data
from rps_astro_cli.length.pipeline import build_model, fit_rng, make_split
from rps_astro_cli.sim.remaining import REMAINING_DIR, equal_probability_atoms


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=Path("/work/shared/data/sharegpt/sharegpt_v3_sample500.json"))
    ap.add_argument("--length-model", default=None)
    ap.add_argument("--atoms", type=int, default=100)
    ap.add_argument("--folds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)

    model = load_length_model(args.length_model) if args.length_model else default_length_model()
    meta = model.meta
    split_cfg = meta.split or {"seed": 0, "test_frac": 0.2, "val_frac": 0.1}
    ds = load_length_data(args.data, context_turns=model.context_turns)
    if meta.data.get("sha256") and ds.sha256() != meta.data["sha256"]:
        raise SystemExit(f"{args.data}: not the model's training data (sha256 differs)")
    split = make_split(ds, test_frac=float(split_cfg["test_frac"]), val_frac=float(split_cfg["val_frac"]),
                       seed=int(split_cfg["seed"]))
    trainval = LengthDataset(split.train.samples + split.val.samples, source=ds.source, tokenizer=ds.tokenizer)
    y = trainval.targets.astype(np.float64)
    ids = sorted(set(trainval.conversation_ids))
    rng = np.random.default_rng([int(split_cfg["seed"]), 29])
    fold_of = {c: int(k) % args.folds for c, k in zip(ids, rng.permutation(len(ids)))}
    folds = np.array([fold_of[c] for c in trainval.conversation_ids])
    oof = np.empty(len(y))
    t0 = time.time()
    for k in range(args.folds):
        tr = [i for i in range(len(y)) if folds[i] != k]
        te = [i for i in range(len(y)) if folds[i] == k]
        m = build_model(meta.model)
        m.fit(trainval.subset(tr), None, rng=fit_rng(int(split_cfg["seed"])))
        oof[te] = m.predict([trainval.samples[i].prompt for i in te])
        print(f"fold {k}: {len(tr)} train / {len(te)} predicted ({time.time() - t0:.0f} s)", file=sys.stderr)
    ratios = y / np.maximum(oof, 1.0)
    out = {
        "what": "conditional remaining-length tables for the look-ahead (rps_astro_cli.sim.remaining)",
        "command": "scripts/fit_remaining_table.py" + (f" --length-model {args.length_model}" if args.length_model else ""),
        "length_model": meta.model, "length_model_files": meta.files,
        "data": {"source": ds.source, "sha256": ds.sha256(), "split": split_cfg, "fitted_on": "train+val",
                 "n_pairs": len(y), "folds": args.folds},
        "oof_mae_tokens": float(np.abs(oof - y).mean()),
        "default_kind": "ratio",
        "tables": {
            "ratio": {"kind": "ratio", "atoms": [round(a, 5) for a in equal_probability_atoms(ratios, args.atoms)],
                      "statistic": "mean", "extension_tokens": 10},
            "empirical": {"kind": "empirical", "atoms": [round(a, 2) for a in equal_probability_atoms(y, args.atoms)],
                          "statistic": "mean", "extension_tokens": 10},
        },
    }
    path = args.out or REMAINING_DIR / f"remaining_{meta.model}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}: oof MAE {out['oof_mae_tokens']:.1f} tokens, ratio median "
          f"{float(np.median(ratios)):.3f}, mean {float(np.mean(ratios)):.3f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
