"""`astro` entry point: one Typer app; each command group lives in its own module."""

from __future__ import annotations

import typer

from rps_astro_cli import __version__

app = typer.Typer(
    name="astro",
    help="astro: serve LLM/MLLM requests across instances (Astrolabe dispatch + RPS-Serve "
    "in-instance scheduling) and benchmark them honestly.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"astro {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """astro command line."""


def _register() -> None:
    # Each module adds its commands/groups to `app`. Imports stay inside modules'
    # command bodies where they are heavy, so `astro --help` stays fast.
    from rps_astro_cli.cli import bench, demo, length, policies, profiles, rps, serve, simulate

    for mod in (serve, bench, simulate, policies, profiles, rps, length, demo):
        mod.register(app)


_register()


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
