"""The one place a user-caused error becomes a message, a hint and an exit code.

Every command is wrapped in `handle_errors`: a VBatchError prints `error: ...` and `hint: ...`
on stderr and exits with the class's `exit_code`; Ctrl-C exits 130. Tracebacks only with
`vbatch --debug` (or VBATCH_DEBUG=1). Anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import functools
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

import typer

from ..engine.errors import VBatchError

F = TypeVar("F", bound=Callable[..., Any])

EXIT_OK = 0
EXIT_RECORDS_FAILED = 1
EXIT_USAGE = 2
EXIT_BAD_INPUT = 3
EXIT_MODEL_LOAD = 4
EXIT_OUTPUT_STATE = 5      # the output belongs to another run, or merge found missing/incomplete parts
EXIT_LOCKED = 6            # another run is writing the same output (batch/output_lock.py)
EXIT_WRITE_FAILED = 7      # the file system refused the output: disk full, quota, read-only (resumable)
EXIT_INTERRUPTED = 130     # SIGINT (128 + 2)
EXIT_TERMINATED = 143      # SIGTERM (128 + 15)

EXIT_CODES_HELP = (
    "Exit codes: 0 every record done (or already complete); 1 some records failed (see their error field); "
    "2 bad usage or option; 3 bad input file; 4 model could not be loaded; 5 output belongs to another run "
    "or parts missing; 6 another run is writing the same output; 7 the output could not be written (disk full, quota, read-only); 130 interrupted (Ctrl-C); 143 terminated (SIGTERM). 130/143 keep the output resumable."
)


# NOTE: one process-wide flag set by the root callback on every invocation. Reading it from the
# click context would tie us to click internals (Typer >= 0.2x vendors its own click).
_debug = False


def set_debug(value: bool) -> None:
    global _debug
    _debug = bool(value)


def is_debug() -> bool:
    return _debug or os.environ.get("VBATCH_DEBUG", "") not in ("", "0")


def report(error: VBatchError) -> int:
    """Print one error line and its hint on stderr; return the exit code."""
    if is_debug():
        traceback.print_exception(type(error), error, error.__traceback__, file=sys.stderr)
    typer.echo(f"error: {error}", err=True)
    if error.hint:
        typer.echo(f"hint: {error.hint}", err=True)
    elif not is_debug():
        typer.echo("hint: run with `vbatch --debug ...` for the traceback", err=True)
    return int(getattr(error, "exit_code", 1))


def handle_errors(command: F) -> F:
    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except VBatchError as e:
            raise typer.Exit(report(e)) from None
        except KeyboardInterrupt:
            typer.echo("error: interrupted", err=True)
            typer.echo("hint: the finished records are in the .partial file next to the output; "
                       "rerun the same command to resume", err=True)
            raise typer.Exit(EXIT_INTERRUPTED) from None

    return wrapper  # type: ignore[return-value]
