"""`astro` entry point: one Typer app; each command group lives in its own module."""

from __future__ import annotations

import typer

from rps_astro_cli import __version__
from rps_astro_cli.cli.common import HELP_CLASSES

app = typer.Typer(
    name="astro",
    help="astro: serve LLM/MLLM requests across instances (Astrolabe dispatch + RPS-Serve "
    "in-instance scheduling) and benchmark them honestly.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    # click's plain help, not Rich's option panels: at 80 columns the panels cut option
    # names ("--predictor-profi…"), show `<bool>` for flags and squeeze the help text into
    # a narrow column; click's layout wraps text at words and never cuts a name. Every
    # group and command inherits it.
    rich_markup_mode=None,
    cls=HELP_CLASSES[1],
    context_settings={"max_content_width": 100},
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"astro {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, show_default=False,
                                 help="Print `astro <version>` and exit."),
) -> None:
    """astro command line."""


def _register() -> None:
    # Each module adds its commands/groups to `app`. Imports stay inside modules'
    # command bodies where they are heavy, so `astro --help` stays fast.
    from rps_astro_cli.cli import bench, demo, length, policies, profiles, rps, serve, simulate

    for mod in (serve, bench, simulate, policies, profiles, rps, length, demo):
        mod.register(app)
    _use_help_classes(app)


def _use_help_classes(t: typer.Typer) -> None:
    """Give every command and group of `t` (recursively) astro's help classes
    (`common.HELP_CLASSES`: click's plain help, wrapped at words), unless it names its own."""
    from typer.core import TyperCommand

    cmd_cls, grp_cls = HELP_CLASSES
    for info in t.registered_commands:
        if info.cls in (None, TyperCommand):
            info.cls = cmd_cls
    for g in t.registered_groups:
        g.cls = grp_cls
        if g.typer_instance is not None:
            _use_help_classes(g.typer_instance)


_register()


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
