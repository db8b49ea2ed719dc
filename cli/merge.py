"""`vbatch merge OUT` (or `vbatch merge OUT.part-*`): join the parts of a sharded run into OUT.

Only wiring: the checks and the streaming round-robin merge are `vbatch.batch.merge.merge_parts`.
Exit 0 when OUT is written (or was already merged); 5 naming every missing or incomplete part,
a shard-count mismatch, a duplicate or missing id; 3 for an unreadable `--input`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from .errors import handle_errors


@handle_errors
def merge(
    outputs: Annotated[list[str], typer.Argument(help="OUT (its parts OUT.part-I-of-N are found) or the part "
                                                 "files themselves.", show_default=False)],
    input_file: Annotated[Optional[Path], typer.Option("--input", help="The input file: also check that every "
                                                       "input id is there once, in order.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUT if it exists.")] = False,
) -> None:
    """Merge the parts of a `vbatch run --shard I/N` array into OUT, in input order, atomically."""
    from ..batch.merge import merge_parts
    from ..engine.errors import InputError

    # A shell glob OUT.part-* also lists the parts' .partial, .manifest.json and .lock files: not parts.
    names = [p for p in outputs if not p.endswith((".partial", ".manifest.json", ".converting", ".tmp", ".lock"))]
    if input_file is not None and not input_file.is_file():
        raise InputError(f"{input_file}: no such file", hint="--input takes the batch file the parts were run on")
    result = merge_parts(names or outputs, input_path=None if input_file is None else str(input_file),
                         overwrite=overwrite)
    if result.already_complete:
        typer.echo(f"{result.path}: already complete ({result.num_records} records); nothing to do", err=True)
        return
    typer.echo(f"{result.path}: {result.num_records} records merged from {result.num_parts} parts", err=True)
