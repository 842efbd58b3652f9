"""The tagger's documented baseline length model: a prompt-length bin → median table.

Until the length-model issue ships trained models (`rps_astro_cli/length/`), the tagger
predicts a request's output length (tokens) as the median reply length of ShareGPT
conversations whose first human turn fell in the same prompt-length bin. Prompt and reply
lengths are counted with the project's shared counter (`tokens.count_tokens_fallback`),
so they are ChatGPT reply lengths in fallback tokens, not Llama-2 tokens: a baseline, not
a trained tagger. On the 500-conversation sample prompt length barely predicts reply
length (log-log correlation ≈ 0), so the table is close to one global median; the
artifact records its held-out MAE/MAPE beside the paper's RoBERTa figures (MAE 78.8
tokens, MAPE 24.4% on Llama-2 replies).

Artifact `artifacts/length/baseline/model.json` (numbers only, no text):
    {"kind": "bin_median", "edges_tokens": [e1, ..., e_{n-1}],   # bin upper edges
     "median_output_tokens": [m0, ..., m_{n-1}], "max_output_tokens": int,
     "data": {...provenance...}, "metrics": {...held-out...}}

Refit: `python -m rps_astro_cli.length.bin_median [SHAREGPT_JSON] [OUT_JSON]`.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rps_astro_cli.data_paths import ARTIFACTS_DIR
from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.tokens import count_tokens_fallback

BASELINE_PATH = ARTIFACTS_DIR / "length" / "baseline" / "model.json"


@dataclass(frozen=True)
class BinMedianLengthModel:
    """Output length (tokens) = median of the prompt-length bin the prompt falls in.

    edges_tokens: ascending upper edges of bins 0..n-2 (a prompt of p tokens falls in
        the first bin whose edge ≥ p; the last bin is open). median_output_tokens: one
        per bin (n values). max_output_tokens: clip of every prediction.
    """

    edges_tokens: tuple[int, ...]
    median_output_tokens: tuple[int, ...]
    max_output_tokens: int = 4096
    name: str = "baseline"

    def __post_init__(self) -> None:
        if len(self.median_output_tokens) != len(self.edges_tokens) + 1:
            raise AstroUserError("needs one more median than edges", field="median_output_tokens")

    def predict_tokens(self, prompt_tokens: int) -> int:
        """Predicted output length (tokens, ≥ 1) for a prompt of `prompt_tokens` tokens."""
        i = bisect.bisect_left(self.edges_tokens, prompt_tokens)
        return max(1, min(self.max_output_tokens, self.median_output_tokens[i]))

    @classmethod
    def load(cls, path: str | Path = BASELINE_PATH) -> BinMedianLengthModel:
        """Load from the artifact JSON.

        Raises:
            AstroUserError: missing file, not JSON, or a missing/mismatched field.
        """
        p = Path(path)
        if not p.is_file():
            raise AstroUserError(f"no length model at {p}", field="length_model")
        try:
            d = json.loads(p.read_text())
            if d.get("kind") != "bin_median":
                raise AstroUserError(f"{p}: kind {d.get('kind')!r} is not 'bin_median'", field="length_model")
            return cls(tuple(int(x) for x in d["edges_tokens"]),
                       tuple(int(x) for x in d["median_output_tokens"]),
                       int(d.get("max_output_tokens", 4096)))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, AstroUserError):
                raise
            raise AstroUserError(f"{p} is not a valid baseline length model: {exc!r}", field="length_model") from None


def sharegpt_pairs(path: str | Path) -> list[tuple[int, int]]:
    """(prompt tokens, reply tokens) of each conversation's first (human, gpt) turn pair,
    as vLLM's benchmark takes them; entries with < 2 turns or empty values are skipped."""
    data = json.loads(Path(path).read_text())
    out = []
    for entry in data:
        conv = entry.get("conversations") or []
        if len(conv) < 2 or conv[0].get("from") != "human" or conv[1].get("from") != "gpt":
            continue
        p, r = conv[0].get("value", ""), conv[1].get("value", "")
        if p.strip() and r.strip():
            out.append((count_tokens_fallback(p), count_tokens_fallback(r)))
    return out


def fit(pairs: list[tuple[int, int]], n_bins: int = 4, max_output_tokens: int = 4096) -> BinMedianLengthModel:
    """Fit bin edges at prompt-length quantiles and the median reply per bin."""
    arr = np.asarray(pairs, dtype=np.int64)
    qs = np.quantile(arr[:, 0], np.linspace(0, 1, n_bins + 1)[1:-1])
    edges = sorted({int(q) for q in qs})
    idx = np.searchsorted(np.asarray(edges), arr[:, 0], side="left")
    meds = [int(np.median(arr[idx == b, 1])) if np.any(idx == b) else int(np.median(arr[:, 1]))
            for b in range(len(edges) + 1)]
    return BinMedianLengthModel(tuple(edges), tuple(meds), max_output_tokens)


def evaluate(model: BinMedianLengthModel, pairs: list[tuple[int, int]]) -> dict[str, float]:
    """MAE (tokens) and MAPE (%) of `model` on `pairs`."""
    err = np.array([abs(model.predict_tokens(p) - r) for p, r in pairs], dtype=float)
    true = np.array([r for _, r in pairs], dtype=float)
    return {"mae_tokens": float(err.mean()),
            "mape_pct": float(100 * np.mean(err / np.maximum(true, 1))), "n": len(pairs)}


def fit_artifact(data_path: str | Path, out_path: str | Path, seed: int = 0) -> dict[str, Any]:
    """Fit on a seeded 80% split, report held-out metrics, write the artifact JSON."""
    pairs = sharegpt_pairs(data_path)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(pairs))
    cut = int(0.8 * len(pairs))
    train = [pairs[i] for i in order[:cut]]
    test = [pairs[i] for i in order[cut:]]
    model = fit(train)
    d = {
        "kind": "bin_median",
        "edges_tokens": list(model.edges_tokens),
        "median_output_tokens": list(model.median_output_tokens),
        "max_output_tokens": model.max_output_tokens,
        "tokenizer": "rps_astro_cli.tokens.count_tokens_fallback",
        "data": {"file": "sharegpt/sharegpt_v3_sample500.json (see ../shared/data/PROVENANCE.md)",
                 "sha256": hashlib.sha256(Path(data_path).read_bytes()).hexdigest(),
                 "pairs": len(pairs), "split": f"seeded permutation (seed {seed}): 80% fit / 20% held out",
                 "responder": "ChatGPT replies (ShareGPT), not Llama-2-7B"},
        "metrics": {"held_out": evaluate(model, test), "train": evaluate(model, train),
                    "paper_roberta": {"mae_tokens": 78.8, "mape_pct": 24.4,
                                      "note": "Astrolabe paper, Llama-2 replies, 10k split"}},
    }
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    Path(out_path).write_text(json.dumps(d, indent=1) + "\n")
    return d


if __name__ == "__main__":  # pragma: no cover - artifact regeneration
    from rps_astro_cli.data_paths import data_dir

    src = sys.argv[1] if len(sys.argv) > 1 else str(Path(data_dir()) / "sharegpt" / "sharegpt_v3_sample500.json")
    dst = sys.argv[2] if len(sys.argv) > 2 else str(BASELINE_PATH)
    print(json.dumps(fit_artifact(src, dst)["metrics"], indent=1))
