"""The command-line layer (the only package that imports typer/rich)."""
