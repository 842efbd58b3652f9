"""Calibrate an `ExecutionProfile` against a real vLLM engine from its step log.

The plugin (`engine.vllm_plugin`, with `$ASTRO_VLLM_STEP_LOG` set) writes one CSV line per
engine step: batch size B, new tokens T, decode context tokens C, prefill attention pairs
P, and the step's wall time (s). `fit_step_log` fits the sim's step model
(`sim/profile.py`):

    step_s = per_seq_s·B + linear_s(T) + decode_attn_s_per_ctx_token·C
             + prefill_attn_s_per_token_pair·P

with `linear_s` a piecewise-linear table over token knots (hat-function basis; base_s is
folded into the table, i.e. written as 0), all coefficients ≥ 0 and the table
non-decreasing (non-negative least squares on the table's increments,
`scipy.optimize.nnls`), i.e. the conditional mean step time, which is what sums
into a request's E2E. Slow steps on a shared machine are real time the requests waited,
so they are kept by default; `outlier_mads` drops steps whose residual exceeds that many
median absolute residuals (at most 2 refits) when a clean per-step model is wanted
instead. The held-out (every 5th step) MAPE and the dropped count are written to the
profile's `fit` field.

`calibration_load` drives an engine through batch shapes worth fitting: bursts of
concurrent completions (1, 2, 4, ... up to `max_concurrency`, equally many bursts per
level, the remainder at the top level) with prompt lengths spread
over [16, max_prompt_tokens] and outputs over [4, max_output_tokens] tokens (token-id
prompts, `ignore_eos`), drawn from one `numpy.random.Generator`.

Command line (the engine must run with `ASTRO_VLLM_STEP_LOG=LOG`): `astro profile
--backend vllm --engine-url URL --step-log LOG --out PROFILE.json [--name ID]
[--max-requests 48] [--seed 0]`. This module does not import vllm.
"""

from __future__ import annotations

import csv
import json
import math
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rps_astro_cli.errors import AstroUserError
from rps_astro_cli.sim.profile import ExecutionProfile

_KNOTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def read_step_log(path: str | Path) -> np.ndarray:
    """The step log as an (n, 5) float array: B, T, C, P, step_s.

    Raises:
        AstroUserError: file missing, wrong header, or no rows.
    """
    p = Path(path)
    if not p.is_file():
        raise AstroUserError(f"step log {p} not found", field="--step-log",
                             fix="start the engine with ASTRO_VLLM_STEP_LOG set to this path")
    rows = []
    with p.open() as fh:
        rd = csv.reader(fh)
        header = next(rd, None)
        if header != ["batch_size", "num_tokens", "decode_ctx_tokens", "prefill_pairs", "step_s"]:
            raise AstroUserError(f"{p} is not an astro step log (header {header})", field="--step-log")
        for r in rd:
            if len(r) == 5:
                rows.append([float(x) for x in r])
    if not rows:
        raise AstroUserError(f"{p} has no steps", field="--step-log", fix="send requests to the engine first")
    return np.asarray(rows, dtype=float)


def _knots_for(max_tokens: float) -> list[int]:
    ks = [k for k in _KNOTS if k < max_tokens]
    top = int(max(2, math.ceil(max_tokens)))
    if not ks or ks[-1] != top:
        ks.append(top)
    return ks


def _design(x: np.ndarray, knots: Sequence[int]) -> np.ndarray:
    b, t, c, p = x[:, 0], x[:, 1], x[:, 2], x[:, 3]
    kn = np.asarray(knots, dtype=float)
    hat = np.zeros((len(x), len(kn)))
    tt = np.clip(t, kn[0], None)
    idx = np.clip(np.searchsorted(kn, tt, side="left"), 1, len(kn) - 1)
    x0, x1 = kn[idx - 1], kn[idx]
    w = (tt - x0) / (x1 - x0)  # > 1 past the last knot: linear extrapolation, as linear_s does
    rows = np.arange(len(x))
    hat[rows, idx - 1] = 1 - w
    hat[rows, idx] = w
    return np.column_stack([b, hat, c, p])


def fit_step_log(steps: np.ndarray, profile_id: str, model: str, limits: dict[str, Any],
                 gpu: str = "cpu", source: str = "", outlier_mads: float | None = None) -> ExecutionProfile:
    """Fit the step model to `steps` (see module docstring).

    steps: (n, 5) array from `read_step_log` (n ≥ 10). limits: the engine's `/status`
    `limits` (block_size, num_gpu_blocks, max_num_seqs, max_num_batched_tokens,
    max_model_len). outlier_mads: None = keep every step (see module docstring).
    Returns a profile whose `fit` holds n, dropped, held-out MAPE (%), mean step (s) and
    the held-out mean bias (predicted − measured, % of the measured mean).

    Raises:
        AstroUserError: fewer than 10 steps.
    """
    from scipy.optimize import nnls

    if len(steps) < 10:
        raise AstroUserError(f"need ≥ 10 steps to fit, got {len(steps)}", field="--step-log",
                             fix="send more requests to the engine")
    x, y = steps[:, :4], steps[:, 4]
    knots = _knots_for(float(x[:, 1].max()))
    hold = np.arange(len(y)) % 5 == 4
    train = ~hold
    keep = train.copy()
    k = len(knots)
    # the knots' values as non-negative increments (token_s = cumsum(δ), δ ≥ 0): a step does
    # not get faster with more tokens, so linear_s and its extrapolation past the last knot
    # never fall (a free fit on a noisy CPU ended on a lower knot and extrapolated a long
    # prefill to a negative time); one non-negative least-squares solve finds the best such curve
    inc = np.eye(3 + k)
    inc[1:1 + k, 1:1 + k] = np.tril(np.ones((k, k)))

    def solve(rows: np.ndarray) -> np.ndarray:
        delta, _ = nnls(_design(x[rows], knots) @ inc, y[rows])
        return inc @ delta

    coef = None
    for _ in range(3 if outlier_mads else 1):
        coef = solve(keep)
        if not outlier_mads:
            break
        res = np.abs(_design(x, knots) @ coef - y)
        mad = float(np.median(res[keep])) or 1e-12
        new_keep = train & (res <= outlier_mads * mad)
        if (new_keep == keep).all():
            break
        keep = new_keep
    assert coef is not None
    pred = _design(x, knots) @ coef
    h = hold & (y > 0)
    mape = float(np.mean(np.abs(pred[h] - y[h]) / y[h]) * 100) if h.any() else float("nan")
    bias = float((pred[h].sum() - y[h].sum()) / y[h].sum() * 100) if h.any() else float("nan")
    return ExecutionProfile(
        profile_id=profile_id, model=model, gpu=gpu, tp=1, base_s=0.0,
        per_seq_s=float(coef[0]), token_knots=tuple(knots),
        token_s=tuple(float(v) for v in coef[1:1 + k]),
        decode_attn_s_per_ctx_token=float(coef[1 + k]),
        prefill_attn_s_per_token_pair=float(coef[2 + k]),
        block_size=int(limits["block_size"]), num_gpu_blocks=int(limits["num_gpu_blocks"]),
        max_num_seqs=int(limits["max_num_seqs"]),
        max_num_batched_tokens=int(limits["max_num_batched_tokens"]),
        max_model_len=int(limits["max_model_len"]),
        sources={"calibration": "astro vLLM plugin step log (profiling.vllm_calibrate)",
                 "step_log": source},
        fit={"n_steps": int(len(y)), "n_train_kept": int(keep.sum()),
             "dropped_outliers": int(train.sum() - keep.sum()),
             "heldout_mape_pct": round(mape, 2), "heldout_bias_pct": round(bias, 2),
             "mean_step_s": float(y.mean())},
    )


def calibration_load(base_url: str, model: str, rng: np.random.Generator, n_requests: int = 48,
                     max_prompt_tokens: int = 512, max_output_tokens: int = 64,
                     max_concurrency: int = 8, vocab_size: int = 256, timeout_s: float = 300.0,
                     api_key: str | None = None) -> int:
    """Send `n_requests` completions in bursts of growing concurrency (see module
    docstring); returns how many succeeded.

    Raises:
        AstroUserError: bad sizes.
    """
    import httpx

    if n_requests < 1 or max_prompt_tokens < 16 or max_output_tokens < 4 or max_concurrency < 1:
        raise AstroUserError("n_requests ≥ 1, max_prompt_tokens ≥ 16, max_output_tokens ≥ 4 and "
                             "max_concurrency ≥ 1 are needed", field="calibration")
    levels = []
    c = 1
    while c <= max_concurrency:
        levels.append(c)
        c *= 2
    per_level = max(1, n_requests // sum(levels))
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    ok = 0
    lock = threading.Lock()

    def one(prompt_len: int, out_len: int, first_id: int) -> None:
        nonlocal ok
        ids = [(first_id + i) % vocab_size + 3 for i in range(prompt_len)]
        try:
            r = httpx.post(base_url + "/v1/completions", headers=headers, timeout=timeout_s, json={
                "model": model, "prompt": ids, "max_tokens": out_len, "ignore_eos": True,
                "temperature": 0.0})
            if r.status_code == 200:
                with lock:
                    ok += 1
        except httpx.HTTPError:
            pass

    sent = 0
    plan = [lv for lv in levels for _ in range(per_level)]
    while sum(plan) < n_requests:
        plan.append(levels[-1])
    for level in plan:
        if sent >= n_requests:
            break
        burst = []
        for _ in range(min(level, n_requests - sent)):
            pl = int(np.exp(rng.uniform(np.log(16), np.log(max_prompt_tokens))))
            ol = int(rng.integers(4, max_output_tokens + 1))
            burst.append(threading.Thread(target=one, args=(pl, ol, int(rng.integers(0, 1 << 20)))))
            sent += 1
        for t in burst:
            t.start()
            time.sleep(float(rng.uniform(0.0, 0.02)))
        for t in burst:
            t.join(timeout_s)
    return ok


def calibrate_engine(engine_url: str, step_log: str | Path, out: str | Path, profile_id: str = "vllm-calibrated",
                     n_requests: int = 48, seed: int = 0, max_prompt_tokens: int = 512,
                     max_output_tokens: int = 64, max_concurrency: int = 8) -> dict[str, Any]:
    """Drive a running astro vLLM engine (`n_requests` calibration requests; 0 = none),
    fit its step log and write the profile JSON to `out`. Returns {"out", **fit}.

    Raises:
        AstroUserError: the engine does not answer as an astro vLLM engine (no /status),
            or the step log is missing/empty/malformed.
    """
    import httpx

    from rps_astro_cli.protocol.internal_auth import internal_token, token_headers

    base = engine_url.rstrip("/")
    headers = token_headers(internal_token())  # an engine of a keyed cluster ($ASTRO_INTERNAL_TOKEN)
    try:
        st = httpx.get(base + "/status", timeout=5, headers=headers).json()
        model = httpx.get(base + "/v1/models", timeout=5, headers=headers).json()["data"][0]["id"]
        limits = st["limits"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as exc:
        raise AstroUserError(f"{engine_url} did not answer as an astro vLLM engine ({type(exc).__name__})",
                             field="--engine-url",
                             fix="start it with astro serve engine --backend vllm and ASTRO_VLLM_STEP_LOG set",
                             ) from None
    if n_requests:
        n = calibration_load(base, model, np.random.default_rng(seed), n_requests, max_prompt_tokens,
                             max_output_tokens, max_concurrency)
        print(f"calibration load: {n}/{n_requests} requests ok", file=sys.stderr)
        time.sleep(1.0)  # let the engine flush its step log
    prof = fit_step_log(read_step_log(step_log), profile_id, model, limits, source=str(step_log))
    Path(out).write_text(json.dumps(prof.to_dict(), indent=1) + "\n")
    return {"out": str(out), **prof.fit}
