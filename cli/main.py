"""The `vbatch` command: a thin registry of the commands (one module each) and global flags.

Imports nothing heavy: `vbatch --help` must not import torch; commands import the engine
inside their bodies. Entry point: `main()` (pyproject `[project.scripts]`).
"""
from __future__ import annotations

from typing import Annotated, Optional

import typer

from .. import __version__

from . import bench, embed, encode, merge, models, run, validate
from .errors import EXIT_CODES_HELP, set_debug

app = typer.Typer(
    name="vbatch",
    help="Offline batch inference: JSONL / Parquet / OpenAI Batch files in, generations or embeddings out; "
         "GeoTIFF tiles in, flood maps out (vbatch encode --plugin prithvi).",
    epilog=EXIT_CODES_HELP,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"vbatch {__version__}")
        raise typer.Exit()


@app.callback()
def _global(
    version: Annotated[Optional[bool], typer.Option("--version", callback=_print_version, is_eager=True,
                                                    help="Print the version and exit.")] = None,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks for errors.")] = False,
) -> None:
    set_debug(debug)


app.command("run", epilog=EXIT_CODES_HELP)(run.run)
app.command("embed", epilog=EXIT_CODES_HELP)(embed.embed)
app.command("encode", epilog=EXIT_CODES_HELP)(encode.encode)
app.command("validate", epilog=EXIT_CODES_HELP)(validate.validate)
app.command("merge", epilog=EXIT_CODES_HELP)(merge.merge)
app.add_typer(models.app, name="models")
app.add_typer(bench.app, name="bench")


def main() -> None:
    app(prog_name="vbatch")


if __name__ == "__main__":
    main()
