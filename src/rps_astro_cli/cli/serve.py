"""`astro serve` group: the roles (engine, predictor, tagger, scheduler) and, with no
role, the whole cluster on one machine."""

from __future__ import annotations

import typer

serve_app = typer.Typer(help="Run astro services (engine, predictor, tagger, scheduler, or a whole cluster).",
                        no_args_is_help=True)


def register(app: typer.Typer) -> None:
    """Add `astro serve ...` to the root app."""
    from rps_astro_cli.cli import serve_engine

    serve_engine.register(serve_app)
    app.add_typer(serve_app, name="serve")
