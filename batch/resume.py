"""Resume: decide what to do with an existing output, trim a killed run's partial, skip what is done.

`plan_output` looks at `OUT`, `OUT.partial` and `OUT.manifest.json` and answers
- "fresh": nothing there: start from the first record;
- "replace": `--overwrite`: start from the first record; the caller removes the old files
  (`remove_output`) only once the input has passed validation, so a refused run loses nothing;
- "resume": a partial of this very run (same input, options, format, shard): its torn last line
  (the process was killed mid-write) is cut away and its whole lines are kept;
- "complete": `OUT` exists and belongs to this run: nothing to do.
Anything else (an output of another input or other options, a file with no manifest) is an
OutputStateError, unless `--overwrite`.

NOTE: outputs are written in input order, so the lines of a partial are exactly the first K
records of the (shard's) input. Resuming skips K records; `skip_done` checks, as it skips, that
each line's id is the id of the record in that place, so a partial can never be glued to the
wrong input. Ids are compared in the stream (no set of ids is kept). Called by `vbatch run`.
"""
from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Literal, TypeVar

from .atomic_file import partial_path
from .manifest import Manifest, OutputStateError, manifest_path, read_manifest

T = TypeVar("T")


@dataclass(frozen=True)
class OutputPlan:
    action: Literal["fresh", "replace", "resume", "complete", "finish"]   # finish: only the manifest is missing
    num_done: int = 0            # whole records already in the partial (resume) or the final file (complete)
    num_trimmed_bytes: int = 0   # torn tail cut from the partial
    num_done_errors: int = 0     # of the records done, how many are error records


def remove_output(output: str) -> None:
    """`--overwrite`: forget every file of a previous run at this path."""
    for path in (output, partial_path(output), manifest_path(output), output + ".converting"):
        if os.path.exists(path):
            os.remove(path)


def plan_output(output: str, expected: Manifest, *, resume: bool = True, overwrite: bool = False) -> OutputPlan:
    if overwrite:
        return OutputPlan("replace")
    partial = partial_path(output)
    has_final, has_partial = os.path.exists(output), os.path.exists(partial)
    if not has_final and not has_partial:
        return OutputPlan("fresh")
    existing = output if has_final else partial
    on_disk = read_manifest(output)
    if on_disk is None:
        raise OutputStateError(f"{existing} exists but has no manifest ({manifest_path(output)}), so it was not "
                               "written by `vbatch run` and cannot be resumed",
                               hint="pass --overwrite to replace it, or choose another -o")
    found = expected.differences(on_disk)
    if found:
        raise OutputStateError(f"{existing} belongs to another run: " + "; ".join(found),
                               hint="rerun with the same input and options to resume, pass --overwrite to "
                                    "start over, or choose another -o")
    if has_final:
        if on_disk.state != "complete":
            # Killed between the final rename and the completed manifest: the output is whole (it was
            # renamed atomically); only its manifest is left to write.
            num, errors = count_final_records(output)
            return OutputPlan("finish", num_done=num, num_done_errors=errors)
        return OutputPlan("complete", num_done=on_disk.num_records or 0)
    if not resume:
        raise OutputStateError(f"{partial} holds an unfinished run and --no-resume was given",
                               hint="drop --no-resume to continue it, or pass --overwrite to start over")
    num_done, trimmed, num_errors = trim_partial(partial)
    return OutputPlan("resume", num_done=num_done, num_trimmed_bytes=trimmed, num_done_errors=num_errors)


def count_final_records(path: str) -> tuple[int, int]:
    """(records, error records) of a finished output: JSON lines, or a Parquet file's rows."""
    if path.lower().endswith((".parquet", ".pq")):
        import pyarrow.parquet as pq
        table = pq.read_table(path, columns=["error"])
        return table.num_rows, table.num_rows - table.column("error").null_count
    num = errors = 0
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                num += 1
                errors += json.loads(raw).get("error") is not None
    return num, errors


def trim_partial(path: str) -> tuple[int, int, int]:
    """Keep the leading whole JSON lines of a partial; cut the rest. Returns (lines kept, bytes cut,
    error records among the lines kept).

    Only the last line can be torn by a kill; anything unreadable after a good prefix is cut too
    (those records are simply run again).
    """
    num_lines = good_bytes = num_errors = 0
    with open(path, "rb") as f:
        for raw in f:
            if not raw.endswith(b"\n"):
                break
            try:
                line = json.loads(raw)
            except ValueError:
                break
            if not isinstance(line, dict):
                break
            num_errors += line.get("error") is not None
            num_lines += 1
            good_bytes += len(raw)
    size = os.path.getsize(path)
    if size > good_bytes:
        with open(path, "r+b") as f:
            f.truncate(good_bytes)
            f.flush()
            os.fsync(f.fileno())
    return num_lines, size - good_bytes, num_errors


def skip_done(records: Iterable[T], partial: str, num_done: int, *, id_key: str = "id") -> Iterator[T]:
    """The records after the first `num_done`, checking those against the partial's lines as they pass."""
    source = iter(records)
    if num_done:
        with open(partial, "rb") as f:
            for i in range(num_done):
                rec = next(source, None)
                if rec is None:
                    raise OutputStateError(f"{partial} holds {num_done} records but the input has only {i}",
                                           hint="the partial was written from another input; pass --overwrite")
                done_id = json.loads(f.readline()).get(id_key)
                rec_id = getattr(rec, "id", None)
                if done_id != rec_id:
                    raise OutputStateError(
                        f"{partial}:{i + 1}: holds {id_key} {done_id!r} where the input's record "
                        f"{i + 1} (line {getattr(rec, 'line', '?')}) has {rec_id!r}",
                        hint="the partial was written from another input; pass --overwrite to start over")
    yield from source
