"""`astro policies`: the registered dispatch and instance policies, each with its pipeline
summary (first docstring line) and its declared parameters (name, accepted values,
default, help) — what `--param` / `--instance-param` and recipes accept."""

from __future__ import annotations

from typing import Annotated

import typer

from rps_astro_cli.cli.common import JsonOpt, console, user_errors


def policy_rows() -> list[dict]:
    """One row per registered policy: family, name, summary, parameters."""
    from rps_astro_cli.dispatch import DISPATCH_POLICIES
    from rps_astro_cli.policies import INSTANCE_POLICIES

    rows = []
    for family, reg, flag in (("dispatch", DISPATCH_POLICIES, "--param"),
                              ("instance", INSTANCE_POLICIES, "--instance-param")):
        for name in reg.names():
            cls = reg.get(name)
            doc = (cls.__doc__ or "").strip().split("\n\n")[0]
            rows.append({"family": family, "name": name, "flag": flag, "summary": " ".join(doc.split()),
                         "params": [{"name": p.name, "accepts": p.expected(), "default": p.default, "help": p.help,
                                     "recipe_key": p.alias} for p in cls.params]})
    return rows


def short_description(summary: str, room: int) -> str:
    """The summary's first sentence, cut at a word to `room` characters ("…" marks a cut)."""
    import re

    first = re.split(r"(?<=[.!?])\s+(?=[A-Z`])", summary, maxsplit=1)[0]
    if len(first) <= room:
        return first
    cut = first[: max(room - 1, 1)]
    if " " in cut:
        cut = cut[: cut.rindex(" ")]
    return cut.rstrip(" ,;:—-") + "…"


def _print_compact(rows: list[dict], width: int) -> None:
    """One line per policy (name, parameter count, first sentence of its summary), grouped
    by family; every line fits `width`."""
    nw = max([len("name")] + [len(r["name"]) for r in rows])
    head = {"dispatch": "dispatch policies: --policy NAME, --param NAME=VALUE",
            "instance": "instance policies: --instance-policy NAME, --instance-param NAME=VALUE"}
    lines: list[str] = []
    for fam in ("dispatch", "instance"):
        group = [r for r in rows if r["family"] == fam]
        if not group:
            continue
        if lines:
            lines.append("")
        lines += [head[fam], f"  {'name':<{nw}}  params  description"]
        room = max(width - nw - 12, 10)
        lines += [f"  {r['name']:<{nw}}  {len(r['params']):>6}  {short_description(r['summary'], room)}"
                  for r in group]
    lines += ["", "parameters, defaults and full descriptions: astro policies --verbose"]
    for line in lines:
        typer.echo(line)


def _print_verbose(rows: list[dict], width: int) -> None:
    """Each policy: its summary, then each parameter (accepted values, default, recipe key,
    help), wrapped at words to `width`."""
    from rps_astro_cli.cli.common import wrap_help

    out: list[str] = []
    for r in rows:
        if out:
            out.append("")
        out.append(wrap_help(f"{r['name']} ({r['family']} policy; {r['flag']} NAME=VALUE)", width, "", "    "))
        out.append(wrap_help(r["summary"], width, "  ", "  "))
        for p in r["params"]:
            key = f"; recipe key {p['recipe_key']}" if p.get("recipe_key") else ""
            out.append(wrap_help(f"{p['name']}: {p['accepts']}; default {p['default']!r}{key}", width,
                                 "  - ", "      "))
            if p["help"]:
                out.append(wrap_help(p["help"], width, "      ", "      "))
        if not r["params"]:
            out.append("  (no parameters)")
    for line in "\n".join(out).splitlines():
        typer.echo(line)


def register(app: typer.Typer) -> None:
    """Add the `policies` command to the root app."""

    @app.command("policies")
    @user_errors
    def policies(
        family: Annotated[str | None, typer.Option("--family", help="dispatch | instance (default both).")] = None,
        verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Each policy's full description and its "
                                              "parameters (accepted values, default, help).")] = False,
        as_json: JsonOpt = False,
    ) -> None:
        """List dispatch and instance policies: one line each (name, parameter count, short
        description); --verbose adds their parameters."""
        import json

        from rps_astro_cli.errors import AstroUserError

        if family not in (None, "dispatch", "instance"):
            raise AstroUserError(f"unknown family {family!r}", field="--family", fix="use dispatch or instance")
        rows = [r for r in policy_rows() if family in (None, r["family"])]
        if as_json:
            typer.echo(json.dumps(rows, default=str))
            return
        if verbose:
            _print_verbose(rows, console.width)
        else:
            _print_compact(rows, console.width)
