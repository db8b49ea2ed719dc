"""`vbatch validate FILE`: check every record without loading the model.

Prints each problem as `file:line: field: message` on stdout, then a count summary on stderr.
Exit 0 when clean, 3 when any record is bad. The checks are the ones `vbatch run` applies
(same reader, same sampling defaults), so a clean file never fails on input at run time.
"""
from __future__ import annotations

import typer

from . import options as o
from .errors import EXIT_BAD_INPUT, handle_errors


@handle_errors
def validate(
    file: o.InputFile,
    temperature: o.Temperature = None, top_p: o.TopP = None, top_k: o.TopK = None, min_p: o.MinP = None,
    max_tokens: o.MaxTokens = None, stop: o.Stop = None, presence_penalty: o.PresencePenalty = None,
    frequency_penalty: o.FrequencyPenalty = None, repetition_penalty: o.RepetitionPenalty = None,
    logprobs: o.Logprobs = None, n: o.N = None,
) -> None:
    """Check a batch file (JSON, prompt fields, types, sampling ranges, duplicate ids) without the model."""
    from ..batch.readers import open_reader
    from ..batch.validation import validate_reader

    defaults = o.sampling_defaults(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, max_tokens=max_tokens, stop=stop,
        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty, logprobs=logprobs, n=n)
    reader = open_reader(file, sampling_defaults=defaults)
    summary = validate_reader(reader, lambda problem: typer.echo(str(problem)))
    kinds = ", ".join(f"{v} {k}" for k, v in sorted(summary.by_kind.items()))
    typer.echo(f"{summary.file}: {summary.num_records} records ({summary.format}): {summary.num_ok} ok"
               + (f" [{kinds}]" if kinds else "") + f", {summary.num_problems} with problems", err=True)
    if not summary.is_clean:
        raise typer.Exit(EXIT_BAD_INPUT)
