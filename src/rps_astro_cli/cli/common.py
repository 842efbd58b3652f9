"""Shared CLI plumbing: one-line user errors, the Rich console, shared option aliases."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from rps_astro_cli.errors import AstroUserError

console = Console(stderr=False)
err_console = Console(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])


def user_errors(fn: F) -> F:
    """Decorator for command functions: an `AstroUserError` (or a missing file) becomes a
    one-line `error: ...` on stderr and exit code 2 — never a traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except AstroUserError as exc:
            # soft_wrap: the error stays one line however long; escape: "[...]" in a message is text
            err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False, markup=True, soft_wrap=True)
            raise typer.Exit(2) from None
        except FileNotFoundError as exc:
            err_console.print(f"[bold red]error:[/] file not found: {escape(str(exc.filename))}", highlight=False,
                              soft_wrap=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            err_console.print("interrupted")
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


def fail(message: str, code: int = 1) -> None:
    """Print a one-line error and exit with `code`."""
    err_console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


SeedOpt = Annotated[int, typer.Option("--seed", help="Seed of the run's numpy Generator.")]
ProfileOpt = Annotated[
    str,
    typer.Option("--profile", help="Execution profile id (artifacts/profiles/<id>.json) or a JSON path."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as one JSON object on stdout.")]
ParamOpt = Annotated[
    list[str] | None,
    typer.Option("--param", help="Dispatch-policy parameter NAME=VALUE (repeat); each policy declares its own: "
                 "see `astro policies`."),
]
InstanceParamOpt = Annotated[
    list[str] | None,
    typer.Option("--instance-param", help="Instance-policy parameter NAME=VALUE (repeat); see `astro policies`."),
]


def warn_key_on_command_line(ctx: typer.Context, param: typer.CallbackParam, value: str | None) -> str | None:
    """Option callback of every `--api-key`: a key given on the command line (not through
    $ASTRO_API_KEY) is readable by every local user in `ps` and /proc, so say so on stderr,
    in one line. Returns the value unchanged."""
    source = ctx.get_parameter_source(param.name) if param.name else None
    if value and source is not None and source.name == "COMMANDLINE":
        print("warning: --api-key on the command line is visible to other local users (ps, /proc); "
              "set ASTRO_API_KEY in the environment instead", file=sys.stderr, flush=True)
    return value
