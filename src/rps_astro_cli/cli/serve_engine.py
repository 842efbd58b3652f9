"""`astro serve engine` (placeholder until the sim engine lands)."""

import typer


def register(serve_app: typer.Typer) -> None:
    """Add the `engine` command to the serve group."""
