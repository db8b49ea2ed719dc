"""Batch output writers: JSONL or Parquet RequestOutput records, or OpenAI Batch JSONL lines.

`open_writer` picks the writer from the `-o` extension (OpenAI Batch input always gets OpenAI
Batch output). Every writer takes BatchResults in input order (the runner's reorder window
guarantees it), writes to `OUT.partial` with an fsync every `sync_every` records, and renames
onto `OUT` in `close()`; `abort()` (or leaving a `with` block by an exception) keeps only the
partial file. `-` writes JSONL to stdout without the partial file.
"""
from __future__ import annotations

import json
import sys
from typing import Any, BinaryIO, Protocol

from vbatch.engine.errors import ConfigError

from .atomic_file import AtomicFile
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

    def __init__(self, path: str, *, append: bool = False, sync_every: int = 64) -> None:
        self.path = path
        self.sync_every = sync_every
        self._pending = 0
        self._file = None if path == "-" else AtomicFile(path, append=append)
        self._stdout: BinaryIO | None = sys.stdout.buffer if path == "-" else None
        self.num_written = 0

    def to_line(self, result: BatchResult) -> dict[str, Any]:
        return output_record(result)

    def write(self, result: BatchResult) -> None:
        data = (json.dumps(self.to_line(result), ensure_ascii=False) + "\n").encode("utf-8")
        self.num_written += 1
        if self._file is None:
            assert self._stdout is not None
            self._stdout.write(data)
            self._stdout.flush()
            return
        self._file.write(data)
        self._pending += 1
        if self._pending >= self.sync_every:
            self._file.sync()
            self._pending = 0

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

    def __init__(self, path: str, *, model: str, append: bool = False, sync_every: int = 64) -> None:
        super().__init__(path, append=append, sync_every=sync_every)
        self.model = model

    def to_line(self, result: BatchResult) -> dict[str, Any]:
        return batch_output_line(result, self.model)


class ParquetWriter:
    """RequestOutput records as Parquet row groups of `row_group_size` (schema: `parquet_schema()`).

    NOTE: a Parquet file is only readable once its footer is written. `abort()` writes it, so the
    partial file of an interrupted run reads as the records done so far; a killed process leaves
    an unreadable one. Resumable runs should write JSONL.
    """

    def __init__(self, path: str, *, row_group_size: int = 1024) -> None:
        import pyarrow.parquet as pq

        from .parquet_schema import parquet_schema
        if path == "-":
            raise ConfigError("--output", "Parquet cannot be written to stdout; give a .parquet path")
        self.path = path
        self.row_group_size = row_group_size
        self._schema = parquet_schema()
        self._file = AtomicFile(path)
        self._writer = pq.ParquetWriter(self._file.file, self._schema)
        self._rows: list[dict[str, Any]] = []
        self.num_written = 0

    def write(self, result: BatchResult) -> None:
        from .parquet_schema import to_parquet_row
        self._rows.append(to_parquet_row(output_record(result)))
        self.num_written += 1
        if len(self._rows) >= self.row_group_size:
            self._flush()

    def _flush(self) -> None:
        import pyarrow as pa
        if self._rows:
            self._writer.write_table(pa.Table.from_pylist(self._rows, schema=self._schema))
            self._rows = []
            self._file.sync()

    def close(self) -> None:
        if self._file.closed:
            return
        self._flush()
        self._writer.close()
        self._file.commit()

    def abort(self) -> None:
        if self._file.closed:
            return
        try:
            # Footer the partial file: after Ctrl-C or an error it reads as the records done so far.
            self._flush()
            self._writer.close()
        except Exception:  # noqa: BLE001  aborting must not hide the error that caused it
            pass
        self._file.abandon()

    def __enter__(self) -> "ParquetWriter":
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        self.abort() if exc_type is not None else self.close()


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
        if path == "-" or append:
            raise ConfigError("--output", "a Parquet output cannot go to stdout or be appended to",
                              hint="use .jsonl for stdout and resumable runs")
        return "parquet"
    return "jsonl"


def open_writer(path: str, *, input_format: str, model: str, append: bool = False) -> Writer:
    kind = check_output(path, input_format=input_format, append=append)
    if kind == "openai":
        return OpenAIBatchWriter(path, model=model, append=append)
    if kind == "parquet":
        return ParquetWriter(path)
    return JsonlWriter(path, append=append)
