"""Batch output writers: JSONL or Parquet output records, or OpenAI Batch JSONL lines.

`records` says what an output record holds: "generate" (`vbatch run`: RequestOutput records,
OpenAI completion bodies) or "embed" (`vbatch embed`: batch/embed_output.py).

`open_writer` picks the writer from the `-o` extension (OpenAI Batch input always gets OpenAI
Batch output). Every writer takes BatchResults in input order (the runner's reorder window
guarantees it) and appends one JSON line per result to `OUT.partial`, flushed to the OS after
every line and fsynced every `sync_every` lines or `sync_seconds`; `close()` renames it onto
`OUT`; `abort()` (or leaving a `with` block by an exception) keeps only the partial file.
`-` writes JSONL to stdout without the partial file.

NOTE: Parquet resumes through a JSONL partial: its partial file holds the plain records as JSON
lines (resumable exactly like a JSONL output) and `close()` converts them, row group by row
group, into `OUT` (via `OUT.converting` and an atomic rename). A Parquet file is only readable
once its footer is written, so writing Parquet directly could never survive `kill -9`.
"""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, BinaryIO, Protocol

from ..engine.errors import ConfigError

from .atomic_file import AtomicFile, fsync_dir
from .crash_points import crash_point
from .embed_output import (embed_record, embedding_width, embeddings_body, encode_record, parquet_embed_schema,
                           parquet_encode_schema, to_embed_row, to_encode_row)
from .openai_output import batch_output_line
from .result import BatchResult

PARQUET_SUFFIXES = (".parquet", ".pq")
# The plain record's keys, in order (RequestOutput.to_dict() plus the input's id first).
OUTPUT_FIELDS = ("id", "request_id", "prompt", "prompt_token_ids", "prompt_logprobs", "outputs", "finished",
                 "metrics", "num_cached_tokens", "error")


def output_record(result: BatchResult) -> dict[str, Any]:
    """The plain output record of one result: RequestOutput.to_dict() with `id`, or an error record."""
    if result.output is not None:
        d = result.output.to_dict()
    else:
        d = {"request_id": None, "prompt": None, "prompt_token_ids": None, "prompt_logprobs": None,
             "outputs": [], "finished": False, "metrics": None, "num_cached_tokens": 0, "extra": {}}
    d["error"] = result.error_message
    record = {"id": result.id, **{k: d.get(k) for k in OUTPUT_FIELDS if k != "id"}}
    if d.get("extra"):
        record["extra"] = d["extra"]
    return record


class Writer(Protocol):
    path: str

    def write(self, result: BatchResult) -> None: ...
    def close(self) -> None: ...
    def abort(self) -> None: ...


class _LineWriter:
    """JSON lines to an AtomicFile (or stdout); `to_line` says what one result becomes."""

    def __init__(self, path: str, *, append: bool = False, sync_every: int = 64,
                 sync_seconds: float = 5.0, records: str = "generate") -> None:
        assert records in ("generate", "embed", "encode"), records
        self.path = path
        self.records = records
        self.sync_every, self.sync_seconds = sync_every, sync_seconds
        self._pending = 0
        self._last_sync = time.monotonic()
        self._file = None if path == "-" else AtomicFile(path, append=append)
        self._stdout: BinaryIO | None = sys.stdout.buffer if path == "-" else None
        self.num_written = 0

    def to_line(self, result: BatchResult) -> dict[str, Any]:
        if self.records == "encode":
            return encode_record(result)
        return embed_record(result) if self.records == "embed" else output_record(result)

    def write(self, result: BatchResult) -> None:
        data = (json.dumps(self.to_line(result), ensure_ascii=False) + "\n").encode("utf-8")
        self.num_written += 1
        if self._file is None:
            assert self._stdout is not None
            self._stdout.write(data)
            self._stdout.flush()
            return
        self._file.write(data)
        self._file.flush()  # whole lines reach the OS at once: a killed run loses at most the torn one
        crash_point("record.written")
        self._pending += 1
        now = time.monotonic()
        if self._pending >= self.sync_every or now - self._last_sync >= self.sync_seconds:
            self._file.sync()
            self._pending, self._last_sync = 0, now

    def close(self) -> None:
        if self._file is not None:
            self._file.commit()

    def abort(self) -> None:
        if self._file is not None:
            self._file.abandon()

    def __enter__(self) -> "_LineWriter":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.abort() if exc_type is not None else self.close()


class JsonlWriter(_LineWriter):
    """One RequestOutput record a line."""


class OpenAIBatchWriter(_LineWriter):
    """One OpenAI Batch output line a line; `model` names the model when a body did not."""

    def __init__(self, path: str, *, model: str, append: bool = False, sync_every: int = 64,
                 sync_seconds: float = 5.0, records: str = "generate") -> None:
        super().__init__(path, append=append, sync_every=sync_every, sync_seconds=sync_seconds, records=records)
        self.model = model

    def to_line(self, result: BatchResult) -> dict[str, Any]:
        body = embeddings_body if self.records == "embed" else None
        return batch_output_line(result, self.model, body=body)


class ParquetWriter(_LineWriter):
    """Plain records as JSON lines in `OUT.partial`, converted to Parquet by `close()` (see NOTE above).

    Schema: `parquet_schema()`; one row group per `row_group_size` records.
    """

    def __init__(self, path: str, *, append: bool = False, row_group_size: int = 1024, sync_every: int = 64,
                 sync_seconds: float = 5.0, records: str = "generate") -> None:
        if path == "-":
            raise ConfigError("--output", "Parquet cannot be written to stdout; give a .parquet path")
        super().__init__(path, append=append, sync_every=sync_every, sync_seconds=sync_seconds, records=records)
        self.row_group_size = row_group_size

    def close(self) -> None:
        assert self._file is not None
        if self._file.closed:
            return
        self._file.abandon()  # fsynced and closed; the partial stays until the Parquet file is in place
        jsonl_to_parquet(self._file.partial, self.path, row_group_size=self.row_group_size, records=self.records)
        os.remove(self._file.partial)
        fsync_dir(os.path.dirname(os.path.abspath(self.path)))


def jsonl_to_parquet(source: str, path: str, *, row_group_size: int = 1024, records: str = "generate") -> int:
    """Convert plain JSON-line records to a Parquet file at `path`, atomically; returns the rows.

    Streams: at most one row group of records is in memory (embed records: one more pass first,
    for the embedding width of the fixed-size list column).
    """
    import pyarrow as pa
    import pyarrow.parquet as pq

    from .parquet_schema import parquet_schema, to_parquet_row

    if records == "embed":
        schema, to_parquet_row = parquet_embed_schema(embedding_width(source)), to_embed_row
    elif records == "encode":
        schema, to_parquet_row = parquet_encode_schema(), to_encode_row
    else:
        schema = parquet_schema()
    tmp = path + ".converting"
    num_rows = 0
    with open(tmp, "wb") as sink:
        writer = pq.ParquetWriter(sink, schema)
        rows: list[dict[str, Any]] = []
        with open(source, "rb") as f:
            for raw in f:
                rows.append(to_parquet_row(json.loads(raw)))
                if len(rows) >= row_group_size:
                    writer.write_table(pa.Table.from_pylist(rows, schema=schema))
                    num_rows, rows = num_rows + len(rows), []
        if rows or num_rows == 0:
            writer.write_table(pa.Table.from_pylist(rows, schema=schema))
            num_rows += len(rows)
        writer.close()
        sink.flush()
        os.fsync(sink.fileno())
    crash_point("parquet.before_rename")
    os.replace(tmp, path)
    return num_rows


def output_format(path: str) -> str:
    """The format a path's extension asks for, before the input is known ("parquet" | "jsonl")."""
    return "parquet" if path.lower().endswith(PARQUET_SUFFIXES) else "jsonl"


def check_output(path: str, *, input_format: str, append: bool = False) -> str:
    """The output format for this path and input ("jsonl" | "parquet" | "openai"); ConfigError if impossible.

    Cheap and side-effect free, so `vbatch run` can refuse a bad `-o` before loading the model.
    """
    is_parquet = path.lower().endswith(PARQUET_SUFFIXES)
    if input_format == "openai":
        if is_parquet:
            raise ConfigError("--output", "OpenAI Batch input writes OpenAI Batch JSONL, not Parquet",
                              hint="use an output path ending in .jsonl")
        return "openai"
    if is_parquet:
        if path == "-":
            raise ConfigError("--output", "Parquet cannot be written to stdout; give a .parquet path")
        return "parquet"
    return "jsonl"


def open_writer(path: str, *, input_format: str, model: str, append: bool = False,
                kind: str | None = None, records: str = "generate") -> Writer:
    """`kind` overrides the extension (a shard's `OUT.part-I-of-N` keeps OUT's format); `records`:
    generation or embedding output records."""
    kind = kind or check_output(path, input_format=input_format, append=append)
    if kind == "openai":
        return OpenAIBatchWriter(path, model=model, append=append, records=records)
    if kind == "parquet":
        return ParquetWriter(path, append=append, records=records)
    return JsonlWriter(path, append=append, records=records)
