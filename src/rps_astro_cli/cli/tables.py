"""Rich tables that never cut a number: at 80 columns (pipes, default terminals) Rich
shrinks wide tables by truncating cells to "19…". `print_table` sizes every column to its
widest cell (headers may wrap at spaces), and when the whole table is wider than the
console it prints it in several narrower parts, each repeating the key columns (e.g. the
model name), so every value is shown in full at any width."""

from __future__ import annotations

from collections.abc import Sequence

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table


def _col_width(header: str, cells: Sequence[str]) -> int:
    """Columns a column needs: its widest cell, or its header's longest word (headers wrap)."""
    words = [cell_len(w) for w in header.split()] or [1]
    return max([max(words)] + [cell_len(c) for c in cells])


def table_width(widths: Sequence[int]) -> int:
    """Width of a Rich table with the default box and padding: each column adds 1 space
    each side plus one rule, and the table one more rule."""
    return sum(widths) + 3 * len(widths) + 1


def split_columns(widths: Sequence[int], max_width: int, keys: int = 1) -> list[list[int]]:
    """Column indices per printed part: the first `keys` columns in every part, the others
    packed greedily left to right so each part fits `max_width` (a column too wide on its
    own still gets a part of its own).

    Example: widths (10, 8, 8, 8), max_width 40, keys 1 → [[0, 1, 2], [0, 3]]
    (10+8+8 + 3·3+1 = 36 ≤ 40; adding the third 8 would need 47)."""
    key_idx = list(range(min(keys, len(widths))))
    parts: list[list[int]] = []
    cur: list[int] = []
    for i in range(len(key_idx), len(widths)):
        trial = key_idx + cur + [i]
        if cur and table_width([widths[j] for j in trial]) > max_width:
            parts.append(key_idx + cur)
            cur = []
        cur.append(i)
    if cur or not parts:
        parts.append(key_idx + cur)
    return parts


def print_table(console: Console, title: str, headers: Sequence[str], rows: Sequence[Sequence[str]],
                right: Sequence[bool] | None = None, keys: int = 1) -> None:
    """Print `rows` (already formatted strings) under `headers` without truncating any cell.

    Args:
        right: per column, right-justify (numbers); default: every column but the keys.
        keys: leading columns repeated in every part when the table is split to fit.
    """
    n = len(headers)
    right = list(right) if right is not None else [i >= keys for i in range(n)]
    widths = [_col_width(h, [r[i] for r in rows]) for i, h in enumerate(headers)]
    full = [max(w, cell_len(h)) for w, h in zip(widths, headers)]  # header on one line
    parts = split_columns(widths, console.width, keys)
    for p, idx in enumerate(parts):
        part = {i: widths[i] for i in idx}
        for i in idx:  # widen headers back to one line while the part still fits
            if table_width([*part.values()]) + full[i] - part[i] <= console.width:
                part[i] = full[i]
        t = Table(title=title if p == 0 else f"{title} (continued)")
        for i in idx:
            t.add_column(headers[i], justify="right" if right[i] else "left", width=part[i], overflow="fold")
        for r in rows:
            t.add_row(*(r[i] for i in idx))
        console.print(t)
