"""Declared plug-in parameters: each dispatch and instance policy lists its parameters
once (name, type, bounds, default, one-line help) and every way of setting them —
recipes, `astro serve` flags, `astro bench --virtual`, `astro simulate`, the vLLM
plug-in's environment — converts and checks values through that declaration.

    K = Param("k", int, 2, "instances sampled per request, or 'all'", ge=1, keywords=("all",))
    K.convert("3")        # → 3 (flags give strings; YAML gives typed values)
    K.convert("x")        # ParamError: must be an integer ≥ 1 or 'all', got 'x'
    check_params(SPECS, {"k": "4"}, owner="dispatch policy power_of_k")  # → {"k": 4}

Errors are `AstroUserError`s naming the field (the recipe path or flag the value came
from, when the caller says) and the fix (the declared bounds, or the valid names).
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from rps_astro_cli.errors import AstroUserError

_TYPE_WORD = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


class ParamError(ValueError):
    """A value a `Param` rejects; the message has no field name (callers add it)."""


@dataclass(frozen=True)
class Param:
    """One declared parameter of a plug-in.

    name: the keyword the plug-in's constructor takes (and `--param NAME=VALUE` sets).
    type: int | float | str | bool | object; values are converted to it (strings from
        flags are parsed; an int is accepted for a float). `object` = left to `parse`.
    default: the value when none is given (documentation and `--help`; the constructor's
        own default is the one used, and a test checks they agree).
    help: one line: what it does, with its unit.
    ge / gt / le / lt: bounds on numbers (inclusive / exclusive).
    choices: the allowed values (for strings).
    keywords: literal strings accepted besides values of `type` (power_of_k's k: "all").
    parse: conversion for structured values (a per-class triple, a mapping); raises
        ValueError/AstroUserError with the reason. A string from a flag is JSON-decoded
        first when it looks like JSON.
    alias: a flat recipe key kept for this parameter (`scheduler.k` for power_of_k's k);
        None = only `params.<name>`.
    """

    name: str
    type: type
    default: Any
    help: str
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[Any, ...] = ()
    keywords: tuple[str, ...] = ()
    parse: Callable[[Any], Any] | None = None
    alias: str | None = None

    # -- conversion ----------------------------------------------------------------------
    def convert(self, value: Any) -> Any:
        """`value` converted and checked.

        Raises:
            ParamError: wrong type, out of bounds, not one of `choices` (bare message).
        """
        if isinstance(value, str) and value.strip().lower() in self.keywords:
            return value.strip().lower()
        if self.parse is not None:
            if isinstance(value, str) and value.strip()[:1] in ("[", "{", '"'):
                try:
                    value = json.loads(value)
                except json.JSONDecodeError as exc:
                    raise ParamError(f"not valid JSON ({exc.msg}), got {value!r}") from None
            try:
                return self.parse(value)
            except AstroUserError as exc:
                raise ParamError(str(exc).removeprefix(f"{exc.field}: ") if exc.field else str(exc)) from None
            except (TypeError, ValueError) as exc:
                raise ParamError(f"{exc}, got {value!r}") from None
        v = self._typed(value)
        if self.choices and v not in self.choices:
            raise ParamError(f"unknown {self.name} {value!r}")
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out_of_bounds = ((self.ge is not None and not v >= self.ge) or (self.gt is not None and not v > self.gt)
                             or (self.le is not None and not v <= self.le) or (self.lt is not None and not v < self.lt))
            if out_of_bounds or (isinstance(v, float) and math.isnan(v)):
                raise ParamError(f"must be {self.expected()}, got {value!r}")
        return v

    def _typed(self, value: Any) -> Any:
        t = self.type
        bad = ParamError(f"must be {self.expected()}, got {value!r}")
        if t is object:
            return value
        if t is bool:
            if isinstance(value, bool):
                return value
            if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0", "yes", "no"):
                return value.strip().lower() in ("true", "1", "yes")
            raise bad
        if isinstance(value, bool):
            raise bad
        if t is int:
            if isinstance(value, int):
                return value
            if isinstance(value, str):
                try:
                    return int(value.strip())
                except ValueError:
                    raise bad from None
            raise bad
        if t is float:
            if isinstance(value, (int, float)):
                return float(value)
            if isinstance(value, str):
                try:
                    return float(value.strip())
                except ValueError:
                    raise bad from None
            raise bad
        if t is str:
            if isinstance(value, str):
                return value
            raise bad
        raise TypeError(f"Param {self.name}: unsupported type {t!r}")

    # -- text ----------------------------------------------------------------------------
    def expected(self) -> str:
        """What the parameter accepts, e.g. "an integer ≥ 1 or 'all'"."""
        if self.choices:
            text = "one of: " + ", ".join(map(str, self.choices))
        else:
            text = _TYPE_WORD.get(self.type, "a value")
            bounds = [f"{op} {b:g}" for b, op in ((self.ge, "≥"), (self.gt, ">"), (self.le, "≤"), (self.lt, "<"))
                      if b is not None]
            if bounds:
                text += " " + " and ".join(bounds)
        if self.keywords:
            text += " or " + " or ".join(repr(k) for k in self.keywords)
        return text

    def describe(self) -> str:
        """One line for `--help`, errors and docs: `k: an integer ≥ 1 or 'all' (default 2) — ...`."""
        return f"{self.name}: {self.expected()} (default {self.default!r}) — {self.help}"

    def check(self, value: Any, field: str | None = None, owner: str | None = None) -> Any:
        """`convert`, with a user error naming `field` (default: the parameter's name).

        Raises:
            AstroUserError: the value is rejected; the fix says what it accepts.
        """
        try:
            return self.convert(value)
        except ParamError as exc:
            where = f"{owner} parameter {self.name}: " if owner else ""
            fix = (f"use one of: {', '.join(map(str, self.choices))}" if self.choices
                   else f"{self.name}: {self.help}" if self.type is object else f"give {self.expected()}")
            raise AstroUserError(f"{where}{exc}", field=field or self.name, fix=fix) from None


def check_params(specs: Sequence[Param], given: Mapping[str, Any], *, owner: str,
                 fields: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The given parameters, converted and checked against `specs` (only those given:
    the rest keep the constructor's defaults).

    Args:
        specs: the plug-in's declared parameters.
        given: name → value (strings from flags, typed values from YAML or code).
        owner: names the plug-in in errors, e.g. "dispatch policy power_of_k".
        fields: parameter name → the field/flag the value came from, for errors
            (default: the parameter name).

    Raises:
        AstroUserError: an unknown parameter (lists the declared ones) or a bad value.
    """
    by_name = {p.name: p for p in specs}
    fields = fields or {}
    out: dict[str, Any] = {}
    for name, value in given.items():
        p = by_name.get(name)
        field = fields.get(name, name)
        if p is None:
            fix = (f"its parameters are: {', '.join(by_name)}" if by_name else "it takes no parameters")
            raise AstroUserError(f"{owner} takes no parameter {name!r}", field=field, fix=fix)
        out[name] = p.check(value, field, owner)
    return out


def parse_assignments(items: Sequence[str] | None, flag: str = "--param") -> dict[str, str]:
    """`["k=4", "objective=ttft"]` (repeated `--param NAME=VALUE` flags) → a dict of
    strings; the policy's declaration converts them.

    Raises:
        AstroUserError: an item without `=` or with an empty name.
    """
    out: dict[str, str] = {}
    for item in items or ():
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise AstroUserError(f"{item!r} is not NAME=VALUE", field=flag, fix=f"write e.g. {flag} k=4")
        out[name.strip()] = value.strip()
    return out
