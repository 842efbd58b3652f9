"""Shared CLI plumbing: one-line user errors, the Rich console, shared option aliases."""

from __future__ import annotations

import functools
import sys
import textwrap
from collections.abc import Callable, Sequence
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


# -- help at any width: words stay whole ---------------------------------------------------

def _wrapper(width: int, initial_indent: str, subsequent_indent: str) -> textwrap.TextWrapper:
    """A `textwrap.TextWrapper` that never splits a word: not at a hyphen ("model-" /
    "mismatch") and not when the word is longer than the line (a long path or URL
    overflows whole); only a comma list longer than the line ("16,32,…,8192") may break,
    after a comma."""
    import re

    class _Wrapper(textwrap.TextWrapper):
        def _split(self, text: str) -> list[str]:
            room = self.width - len(self.subsequent_indent)
            out: list[str] = []
            for chunk in re.split(r"(\s+)", text):
                if len(chunk) > room and "," in chunk.strip(","):
                    out.extend(c for c in re.split(r"(?<=,)", chunk) if c)
                elif chunk:
                    out.append(chunk)
            return out

    return _Wrapper(width, initial_indent=initial_indent, subsequent_indent=subsequent_indent,
                    replace_whitespace=False, break_on_hyphens=False, break_long_words=False)


def wrap_help(text: str, width: int, initial_indent: str = "", subsequent_indent: str = "",
              preserve_paragraphs: bool = False) -> str:
    """click's `wrap_text`, but words stay whole (`_wrapper`). Paragraphs (a blank line
    between) are re-wrapped; one that starts with a line holding only `\\b` is kept as
    written."""
    text = text.expandtabs()
    if not preserve_paragraphs:
        return str(_wrapper(width, initial_indent, subsequent_indent).fill(text))
    paragraphs: list[tuple[int, bool, str]] = []
    buf: list[str] = []
    indent = 0
    for line in [*text.splitlines(), ""]:
        if line:
            if not buf:
                indent = len(line) - len(line.lstrip())
            buf.append(line.strip() if not buf or buf[0].strip() != "\b" else line)
        elif buf:
            raw = buf[0].strip() == "\b"
            paragraphs.append((indent, raw, "\n".join(buf[1:]) if raw else " ".join(buf)))
            buf = []
    out = []
    for indent, raw, par in paragraphs:
        pad = " " * indent
        if raw:
            out.append("\n".join(initial_indent + pad + ln for ln in par.splitlines()))
        else:
            out.append(str(_wrapper(width, initial_indent + pad, subsequent_indent + pad).fill(par)))
    return "\n\n".join(out)


def _help_classes() -> tuple[type, type]:
    """(command class, group class) of every astro command: Typer's, with a help formatter
    that wraps at words only (`wrap_help`). Built lazily so the module imports no more
    than it did."""
    from typer.core import TyperCommand, TyperGroup

    base_ctx = TyperCommand.context_class
    base_fmt = base_ctx.formatter_class

    class AstroHelpFormatter(base_fmt):  # type: ignore[valid-type,misc]
        """click's HelpFormatter; its text and definition lists wrap with `wrap_help`."""

        def write_text(self, text: str) -> None:
            indent = " " * self.current_indent
            self.write(wrap_help(text, self.width, indent, indent, preserve_paragraphs=True) + "\n")

        def write_usage(self, prog: str, args: str = "", prefix: str | None = None) -> None:
            prefix = "Usage: " if prefix is None else prefix
            head = f"{prefix:>{self.current_indent}}{prog} "
            self.write(wrap_help(args, self.width - self.current_indent, head, " " * min(len(head), 12)) + "\n")

        def write_dl(self, rows: Sequence[tuple[str, str]], col_max: int = 30, col_spacing: int = 2) -> None:
            rows = list(rows)
            first_w = min(max((len(r[0]) for r in rows), default=0), col_max) + col_spacing
            text_w = max(self.width - first_w - 2, 10)
            pad = " " * (first_w + self.current_indent)
            for first, *rest in rows:
                second = rest[0] if rest else ""
                self.write(f"{'':>{self.current_indent}}{first}")
                if not second:
                    self.write("\n")
                    continue
                if len(first) <= first_w - col_spacing:
                    self.write(" " * (first_w - len(first)))
                else:
                    self.write("\n" + pad)
                lines = wrap_help(second, text_w, preserve_paragraphs=True).splitlines() or [""]
                self.write(lines[0] + "\n")
                for ln in lines[1:]:
                    self.write((pad + ln if ln else "") + "\n")

    class AstroContext(base_ctx):  # type: ignore[valid-type,misc]
        formatter_class = AstroHelpFormatter

    class AstroCommand(TyperCommand):
        context_class = AstroContext

    class AstroGroup(TyperGroup):
        context_class = AstroContext

    return AstroCommand, AstroGroup


HELP_CLASSES = _help_classes()
"""(command class, group class) that `cli.main` gives every astro command and group."""


def deprecated_alias(old: str, new: str) -> Callable[[typer.Context, typer.CallbackParam, Any], Any]:
    """Option callback of a hidden old flag name kept for scripts (`--rate` for
    `--request-rate`): when given on the command line it prints one line on stderr,
    "warning: OLD is deprecated; use NEW". Returns the value unchanged."""

    def callback(ctx: typer.Context, param: typer.CallbackParam, value: Any) -> Any:
        source = ctx.get_parameter_source(param.name) if param.name else None
        if value is not None and source is not None and source.name == "COMMANDLINE":
            print(f"warning: {old} is deprecated; use {new}", file=sys.stderr, flush=True)
        return value

    return callback


def pick_alias(ctx: typer.Context, new: str, new_value: Any, old: str, old_value: Any) -> Any:
    """The value of a flag that has a deprecated alias: the old name's when only it was
    given, else the new one's (its default included). Both on the command line is a user
    error naming them."""
    from rps_astro_cli.errors import AstroUserError

    if old_value is None:
        return new_value
    source = ctx.get_parameter_source(new.lstrip("-").replace("-", "_"))
    if source is not None and source.name == "COMMANDLINE":
        raise AstroUserError(f"give {new} only ({old} is its deprecated name)", field=old)
    return old_value


def table_fits(out: Console, table: Any) -> bool:
    """Whether a Rich `table` prints on `out` at its natural width: no cell wrapped or cut."""
    from rich.measure import Measurement

    return Measurement.get(out, out.options.update_width(10_000), table).maximum <= out.width
