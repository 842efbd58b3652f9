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


def register(app: typer.Typer) -> None:
    """Add the `policies` command to the root app."""

    @app.command("policies")
    @user_errors
    def policies(
        family: Annotated[str | None, typer.Option("--family", help="dispatch | instance (default both).")] = None,
        as_json: JsonOpt = False,
    ) -> None:
        """List dispatch and instance policies with their declared parameters."""
        import json

        from rps_astro_cli.errors import AstroUserError

        if family not in (None, "dispatch", "instance"):
            raise AstroUserError(f"unknown family {family!r}", field="--family", fix="use dispatch or instance")
        rows = [r for r in policy_rows() if family in (None, r["family"])]
        if as_json:
            typer.echo(json.dumps(rows, default=str))
            return
        from rich.table import Table

        t = Table(title="astro policies (set parameters with --param / --instance-param NAME=VALUE)")
        for c in ("family", "name", "parameters", "summary"):
            t.add_column(c, overflow="fold")
        for r in rows:
            ps = "\n".join(f"{p['name']}: {p['accepts']} (default {p['default']!r}) — {p['help']}"
                           for p in r["params"]) or "—"
            t.add_row(r["family"], r["name"], ps, r["summary"])
        console.print(t)
