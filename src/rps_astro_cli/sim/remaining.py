"""Remaining output length of queued and running requests, for the look-ahead (issue 13
§2): the expectation (or a quantile) of the output length L under its conditional
distribution given "already longer than g tokens", instead of the tagger's point
estimate + a fixed auto-extension.

The distribution of one request's L is a table of equal-probability atoms:

- `kind = "ratio"`: L = p · r_j, p the tagger's predicted length and r_j the atoms of
  the tagger's out-of-sample ratio true / predicted (so the table conditions on the
  tagger's prediction and on its error spread);
- `kind = "empirical"`: L = a_j, the atoms of the training replies' lengths (tagger-blind).

Given g generated tokens of a request that has not finished, L > g. With the atoms
sorted, x_1 ≤ … ≤ x_m (x_j = p·r_j or a_j), each clipped at `cap` (the instance's
max_model_len − prompt: no request outgrows it), the atoms above g are x_{j0+1..m} and

    E[L | L > g] = (Σ_{j > j0} min(x_j, cap)) / (m − j0)       (prefix sums, O(log m))

and the q-quantile is the atom at rank j0 + ceil(q·(m − j0)) (1-based). Past the last
atom (g ≥ x_m) the table knows nothing: g + `extension_tokens` (Astrolabe's
auto-extension). The result is always ≥ g + 1 and ≥ 1.

A table is numbers only (JSON in `artifacts/dispatch/`): no prompt text.
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rps_astro_cli.errors import AstroUserError

REMAINING_DIR = Path(__file__).resolve().parents[3] / "artifacts" / "dispatch"
DEFAULT_TABLE = "remaining_classic.json"
KINDS = ("ratio", "empirical")


@dataclass(frozen=True)
class RemainingLength:
    """A conditional-length rule (module docstring).

    kind: "ratio" (atoms are true / predicted ratios, scaled by the prediction) or
        "empirical" (atoms are output lengths in tokens).
    atoms: the distribution's equal-probability atoms, ascending (ratio, or tokens).
    statistic: "mean" (the conditional expectation) or "q<percent>" (a conditional
        quantile, e.g. "q90").
    extension_tokens: past the last atom, the request is assumed to end within this many
        more tokens (tokens).
    default_output_tokens: the prediction used when a request has none (tokens).
    """

    kind: str
    atoms: tuple[float, ...]
    statistic: str = "mean"
    extension_tokens: int = 10
    default_output_tokens: int = 256
    _prefix: tuple[float, ...] = field(default=(), repr=False, compare=False)
    _q: float = field(default=-1.0, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise AstroUserError(f"unknown kind {self.kind!r}", field="remaining.kind", fix=f"use one of {KINDS}")
        if not self.atoms or any(not (a > 0 and math.isfinite(a)) for a in self.atoms):
            raise AstroUserError("atoms must be a non-empty list of positive numbers", field="remaining.atoms")
        atoms = tuple(sorted(float(a) for a in self.atoms))
        object.__setattr__(self, "atoms", atoms)
        pre = [0.0]
        for a in atoms:
            pre.append(pre[-1] + a)
        object.__setattr__(self, "_prefix", tuple(pre))
        object.__setattr__(self, "_q", _parse_statistic(self.statistic))

    def expected_total(self, predicted: int | None, generated: int, cap: int | None = None) -> int:
        """Output length (tokens, total, not remaining) the look-ahead assumes for a
        request predicted at `predicted` tokens that has generated `generated` and not
        finished: the table's `statistic` of L given L > generated, clipped at `cap`."""
        g = max(0, int(generated))
        p = float(predicted) if predicted else float(self.default_output_tokens)
        scale = p if self.kind == "ratio" else 1.0
        atoms = self.atoms
        m = len(atoms)
        j0 = bisect.bisect_right(atoms, g / scale)  # atoms ≤ g are ruled out (L > g)
        while j0 < m and atoms[j0] * scale <= g:  # float guard at the boundary
            j0 += 1
        if j0 >= m:
            out = g + self.extension_tokens
            return out if cap is None else max(g + 1, min(out, cap))
        c = math.inf if cap is None else float(cap)
        if self._q < 0:  # mean of min(x_j, cap) over j > j0
            j1 = bisect.bisect_right(atoms, c / scale) if cap is not None else m
            j1 = max(j1, j0)
            s = (self._prefix[j1] - self._prefix[j0]) * scale + (m - j1) * (c if cap is not None else 0.0)
            val = s / (m - j0)
        else:
            rank = j0 + max(1, math.ceil(self._q * (m - j0)))  # 1-based rank among all atoms
            val = min(atoms[min(rank, m) - 1] * scale, c)
        out = int(math.ceil(val))  # ≥ the smallest remaining atom > g, so > g
        if out <= g:
            out = g + 1
        if cap is not None:
            out = max(g + 1, min(out, cap)) if cap > g else g + 1
        return max(1, out)

    def with_statistic(self, statistic: str) -> RemainingLength:
        return RemainingLength(self.kind, self.atoms, statistic, self.extension_tokens, self.default_output_tokens)

    def describe(self) -> dict[str, Any]:
        return {"kind": self.kind, "atoms": len(self.atoms), "statistic": self.statistic}


def _parse_statistic(s: str) -> float:
    """-1 for "mean", else the quantile level in (0, 1] of "q<percent>"."""
    if s == "mean":
        return -1.0
    if s.startswith("q"):
        try:
            q = float(s[1:]) / 100.0
        except ValueError:
            q = -1.0
        if 0.0 < q <= 1.0:
            return q
    raise AstroUserError(f"unknown statistic {s!r}", field="remaining.statistic",
                         fix="use 'mean' or 'q<percent>' with percent in (0, 100], e.g. q90")


def equal_probability_atoms(values: Any, m: int) -> tuple[float, ...]:
    """`m` atoms of the empirical distribution of `values`: its quantiles at the
    mid-points (j − 0.5) / m, j = 1..m (linear interpolation)."""
    import numpy as np

    v = np.asarray(values, dtype=np.float64)
    if v.size == 0 or m < 1:
        raise AstroUserError("need at least one value and one atom", field="values")
    return tuple(float(x) for x in np.quantile(v, (np.arange(m) + 0.5) / m))


def load_remaining(spec: str | Path) -> RemainingLength:
    """A table from a JSON file (`{"kind", "atoms", ...}`); `spec` is a path, or
    "<file-in-artifacts/dispatch>[:<kind>][@<statistic>]" — e.g. "default", 
    "default:empirical@q90" — where "default" is `DEFAULT_TABLE`. A file may hold one
    table or several under "tables": {kind: {...}}.

    Raises:
        AstroUserError: missing file, bad JSON or a bad table (names the field).
    """
    text = str(spec)
    statistic = None
    if "@" in text:
        text, statistic = text.rsplit("@", 1)
    kind = None
    if ":" in text and not Path(text).is_file():
        text, kind = text.rsplit(":", 1)
    path = Path(text)
    if text in ("", "default"):
        path = REMAINING_DIR / DEFAULT_TABLE
    elif not path.is_file() and (REMAINING_DIR / text).is_file():
        path = REMAINING_DIR / text
    if not path.is_file():
        raise AstroUserError(f"no such remaining-length table: {path}", field="remaining",
                             fix=f"pass a JSON table or a name in {REMAINING_DIR}")
    try:
        d = json.loads(path.read_text())
    except ValueError as exc:
        raise AstroUserError(f"{path}: not JSON ({exc})", field="remaining") from None
    tables = d.get("tables") if isinstance(d, dict) else None
    if isinstance(tables, dict):
        kind = kind or d.get("default_kind") or next(iter(tables))
        if kind not in tables:
            raise AstroUserError(f"{path}: no table {kind!r}", field="remaining", fix=f"use one of {sorted(tables)}")
        d = tables[kind]
    if not isinstance(d, dict) or "atoms" not in d:
        raise AstroUserError(f"{path}: a table needs 'kind' and 'atoms'", field="remaining")
    return RemainingLength(str(d.get("kind", kind or "ratio")), tuple(d["atoms"]),
                           statistic or str(d.get("statistic", "mean")),
                           int(d.get("extension_tokens", 10)), int(d.get("default_output_tokens", 256)))


class OnlineRemaining:
    """A `RemainingLength` that keeps learning from the fleet's finished requests (issue
    13 §2, "learning online"): each finish adds one observation — the ratio true /
    predicted for a "ratio" table, the true length for an "empirical" one — to a ring
    buffer of the last `window` observations; every `refit_every` observations the atoms
    are re-fitted (`equal_probability_atoms`, as many as the prior has) to the prior's
    atoms together with the buffer. Memory is bounded by `window` numbers; no prompt
    text is kept.

    prior: the table to start from (also its kind, statistic and extension rule).
    window: observations kept (the oldest is dropped first). refit_every: observations
    between refits.
    """

    def __init__(self, prior: RemainingLength, window: int = 2000, refit_every: int = 100) -> None:
        if window < 1 or refit_every < 1:
            raise AstroUserError("window and refit_every must be ≥ 1", field="remaining.online")
        self.prior = prior
        self.current = prior
        self.window = window
        self.refit_every = refit_every
        self._buf: list[float] = []
        self._next = 0  # ring position once the buffer is full
        self._since_refit = 0
        self.observed = 0

    def expected_total(self, predicted: int | None, generated: int, cap: int | None = None) -> int:
        return self.current.expected_total(predicted, generated, cap)

    def observe(self, predicted: int | None, true_tokens: int) -> None:
        """Record a finished request: its prediction (tokens; None/0 → the table's
        default) and its true output length (tokens, ≥ 1)."""
        if true_tokens < 1:
            return
        p = float(predicted) if predicted else float(self.prior.default_output_tokens)
        x = true_tokens / p if self.prior.kind == "ratio" else float(true_tokens)
        if len(self._buf) < self.window:
            self._buf.append(x)
        else:
            self._buf[self._next] = x
            self._next = (self._next + 1) % self.window
        self.observed += 1
        self._since_refit += 1
        if self._since_refit >= self.refit_every:
            self._since_refit = 0
            atoms = equal_probability_atoms(list(self.prior.atoms) + self._buf, len(self.prior.atoms))
            self.current = RemainingLength(self.prior.kind, atoms, self.prior.statistic,
                                           self.prior.extension_tokens, self.prior.default_output_tokens)

    def describe(self) -> dict[str, Any]:
        return {**self.prior.describe(), "online": True, "window": self.window, "observed": self.observed}
