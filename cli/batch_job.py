"""The body every batch command shares (`vbatch run`, `vbatch embed`): checks, resume, the model, the loop.

A command builds a `JobSpec` (what differs: how records are read, what a record becomes, what an
output record holds, which options change outputs) and calls `run_job`. Order of work: input and
output checks, the resume plan (complete / resume / another run's output), the first validation
pass, and only then the model, so a typo or a finished output costs no model load; then the
streaming loop (batch/runner.py), the summary and the exit code.
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import typer

from ..engine.errors import InputError, VBatchError
from .errors import EXIT_BAD_INPUT, EXIT_RECORDS_FAILED

MAX_LISTED_ERRORS = 20  # failed records listed under the summary (all of them are in the output)


@dataclass(frozen=True)
class JobSpec:
    command: str                      # "run" | "embed": recorded in the manifest, so outputs never mix
    file: str
    output: str
    model: str
    engine_kwargs: dict[str, Any]
    output_options: dict[str, Any]    # what changes an output record (the manifest keeps them)
    make_job: Callable[[Any], Any]    # llm -> batch/jobs.BatchJob
    pooling: bool = False             # the job needs a pooling model (embed), else a generation model
    reader_kind: str = "generate"     # batch/readers.py: which record parsers
    record_kind: str = "generate"     # batch/writers.py: which output records
    sampling_defaults: dict[str, Any] = dataclasses.field(default_factory=dict)
    max_in_flight: int = 512
    metrics_json: Path | None = None
    on_error: str = "record"
    shard: str | None = None
    resume: bool = True
    overwrite: bool = False
    wait_lock: bool = False           # queue behind another run on the same output instead of refusing


def first_pass(reader: Any, shard: Any, *, on_error: str) -> int:
    """Validate the shard's records before the model loads (like vLLM): print each problem; return the count.

    `--on-error fail` stops here with exit 3 when any record is bad.
    """
    from ..batch.record import RecordError

    num_records = num_problems = 0
    for rec in shard.select(reader):
        num_records += 1
        if isinstance(rec, RecordError):
            num_problems += 1
            typer.echo(str(rec), err=True)
    if num_problems and on_error == "fail":
        typer.echo(f"{num_problems} bad records; nothing was run (--on-error record runs the rest)", err=True)
        raise typer.Exit(EXIT_BAD_INPUT)
    if num_problems:
        typer.echo(f"{num_problems} bad records: each gets an error record in its place", err=True)
    return num_records


def _check_model_kind(llm: Any, spec: JobSpec) -> None:
    """Refuse a model of the wrong kind at once (not as one error record per input)."""
    from ..engine.errors import UnsupportedTaskError

    if spec.pooling and not llm.is_pooling_model:
        raise UnsupportedTaskError(f"{spec.model} is a generation model; vbatch {spec.command} needs a pooling "
                                   "model", hint="e.g. --model all-minilm-l6-v2 (see `vbatch models list`)")
    if not spec.pooling and llm.is_pooling_model:
        raise UnsupportedTaskError(f"{spec.model} is a pooling model; vbatch {spec.command} generates",
                                   hint="use `vbatch embed` for embeddings, or a generation model")


class OutputWriteError(VBatchError):
    """The file system refused the output (disk full, quota, read-only, I/O error)."""

    exit_code = 7


_WRITE_FAULTS = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is used up",
                 errno.EROFS: "the file system is read-only", errno.EIO: "an I/O error",
                 errno.EACCES: "permission denied"}


@contextlib.contextmanager
def _write_faults(target: str):
    """File system faults while writing `target` become an OutputWriteError (exit 7); the partial output
    stays as it is, so the same command resumes once the fault is gone."""
    try:
        yield
    except OSError as e:
        if e.errno not in _WRITE_FAULTS:
            raise
        raise OutputWriteError(f"{target}: {_WRITE_FAULTS[e.errno]} while writing the output ({e.strerror})",
                               hint="free space / fix the folder, then rerun the same command: it resumes "
                                    "after the records already written") from None


def _input_stamp(path: str) -> tuple[int, int] | None:
    """(size, mtime ns) of the input file (None for stdin or a vanished file): a change means it was rewritten."""
    if path == "-":
        return None
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_size, st.st_mtime_ns


def run_job(spec: JobSpec, load_llm: Callable[[str, dict[str, Any]], Any]) -> None:
    from rich.console import Console

    from ..batch.atomic_file import partial_path
    from ..batch.manifest import Manifest, write_manifest
    from ..batch.output_lock import output_lock
    from ..batch.readers import open_reader
    from ..batch.resume import OutputPlan, plan_output, remove_output, skip_done
    from ..batch.runner import run_batch
    from ..batch.shard import part_path, resolve_shard
    from ..batch.writers import check_output, open_writer
    from ..engine.errors import ConfigError

    from .progress import make_progress
    from .signals import StopSignals

    # 1. everything that can be checked without the model
    if spec.on_error not in ("record", "fail"):
        raise ConfigError("--on-error", f"must be record or fail, got {spec.on_error!r}")
    the_shard = resolve_shard(spec.shard)
    if spec.output == "-" and not the_shard.is_whole:
        raise ConfigError(the_shard.source, "a shard writes OUT.part-I-of-N: give -o OUT",
                          hint="or unset VBATCH_SHARD / run outside the Slurm array")
    reader = open_reader(spec.file, sampling_defaults=spec.sampling_defaults, kind=spec.reader_kind)
    fmt = check_output(spec.output, input_format=reader.format)
    if spec.file == "-" and spec.on_error == "fail":
        raise ConfigError("--on-error", "fail needs a file: stdin cannot be read twice")

    # 2. one writer per output (batch/output_lock.py), then what is already there
    target = part_path(spec.output, the_shard)
    with contextlib.ExitStack() as held:
        if spec.output != "-":
            held.enter_context(output_lock(target, wait=spec.wait_lock))
        # complete, resumable, or another run's (refused before any model load)
        plan, manifest = OutputPlan("fresh"), None
        if spec.output != "-":
            # `run` manifests carry no command key, so outputs written before `embed` existed still resume.
            options = spec.output_options if spec.command == "run" else {"command": spec.command, **spec.output_options}
            manifest = Manifest.build(spec.file, options, fmt, the_shard.spec())
            plan = plan_output(target, manifest, resume=spec.resume, overwrite=spec.overwrite)
            if plan.action == "finish":
                write_manifest(target, manifest.completed(plan.num_done))
                typer.echo(f"{target}: already complete ({plan.num_done} records; the run before was stopped "
                           "just before recording it, now recorded)", err=True)
                return
            if plan.action == "complete":
                typer.echo(f"{target}: already complete ({plan.num_done} records); nothing to do", err=True)
                return
            if plan.action == "resume":
                typer.echo(f"{target}: resuming after {plan.num_done} records already done"
                           + (f" (cut a torn last line of {plan.num_trimmed_bytes} bytes)" if plan.num_trimmed_bytes
                              else ""), err=True)
        if not the_shard.is_whole:
            typer.echo(f"shard {the_shard.spec()} (from {the_shard.source}) -> {target}", err=True)
        seen = _input_stamp(spec.file)
        total = first_pass(reader, the_shard, on_error=spec.on_error) if spec.file != "-" else None
        if plan.action == "replace":
            remove_output(target)     # only now: `--on-error fail` on a bad file keeps the old output
        if total == 0:                # nothing to answer: an empty, complete output, and no model load
            with _write_faults(target):
                if manifest is not None:
                    write_manifest(target, manifest)
                open_writer(target, input_format=reader.format, model=spec.model, kind=fmt,
                            records=spec.record_kind).close()
                if manifest is not None:
                    write_manifest(target, manifest.completed(0))
            typer.echo(f"{spec.file}: 0 records{' in this shard' if not the_shard.is_whole else ''}; "
                       f"wrote an empty {target} without loading the model", err=True)
            return

        # 3. the model, then the streaming loop
        llm = load_llm(spec.model, spec.engine_kwargs)
        _check_model_kind(llm, spec)
        if manifest is not None:
            write_manifest(target, manifest)  # before the partial's first line: a partial never lacks its manifest
        writer = open_writer(target, input_format=reader.format, model=spec.model, append=plan.action == "resume",
                             kind=fmt, records=spec.record_kind)
        records = skip_done(the_shard.select(reader), partial_path(target), plan.num_done,
                            id_key="custom_id" if fmt == "openai" else "id")
        progress = make_progress(None if total is None else total - plan.num_done,
                                 unit="input" if spec.pooling else "generated")
        failures: list[str] = []

        def on_result(result: Any) -> None:
            progress.update(result)
            if not result.ok and len(failures) < MAX_LISTED_ERRORS:
                failures.append(f"id {result.id!r}: {result.error_message}")

        try:
            with StopSignals() as stop, _write_faults(target):
                result = run_batch(records, writer, llm, max_in_flight=spec.max_in_flight, job=spec.make_job(llm),
                                   on_result=on_result, should_stop=stop.is_set, first_seq=plan.num_done)
        except BaseException:
            writer.abort()
            raise
        finally:
            progress.close()
        result = dataclasses.replace(result, num_resumed=plan.num_done, command=spec.command)
        now = _input_stamp(spec.file)
        if now != seen:               # the records read may mix two versions of the file: never complete it
            writer.abort()
            raise InputError(f"{spec.file} changed while this run read it ({seen[0]} bytes then, "
                             f"{now[0] if now else 'no file'} now); the output stays unfinished in "
                             f"{partial_path(target)}",
                             hint="let the file be written completely before vbatch reads it; rerun with the "
                                  "final file (with --overwrite if its content changed)")
        if result.interrupted:
            writer.abort()
        else:
            with _write_faults(target):
                writer.close()
                if manifest is not None:
                    write_manifest(target, manifest.completed(plan.num_done + result.num_requests))

        # 4. the summary
        Console(stderr=True).print(result.rich_table())
        if failures:
            typer.echo(f"errors (first {len(failures)} of {result.num_errors}):", err=True)
            for line in failures:
                typer.echo(f"  {line}", err=True)
        if spec.metrics_json is not None:
            spec.metrics_json.write_text(json.dumps(result.to_dict(), indent=2) + "\n", encoding="utf-8")
        if result.interrupted:
            typer.echo(f"stopped by {stop.name}: {result.num_requests} records written this run; "
                       f"rerun the same command to resume ({partial_path(target)})", err=True)
            raise typer.Exit(stop.exit_code)
        if result.num_errors or plan.num_done_errors:  # the whole output, the resumed part included
            raise typer.Exit(EXIT_RECORDS_FAILED)
