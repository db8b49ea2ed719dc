"""Batch input readers: a lazy stream of BatchRecord | RecordError from JSONL, Parquet or OpenAI Batch.

`open_reader(path)` picks the format from the extension and the content (Parquet magic bytes;
a first JSON line with `custom_id` means OpenAI Batch); `-` reads stdin (JSONL or OpenAI).
`kind` picks the record parsers: "generate" (`vbatch run`: plain_record.py, openai_input.py) or
"embed" (`vbatch embed`: embed_record.py).
Iteration never loads the whole file: JSONL goes line by line, Parquet batch by batch. A bad
record becomes a RecordError and reading goes on. Duplicate ids are caught here, so every
consumer (validate, run) sees the same errors. Called by `vbatch validate` and `vbatch run`.
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from typing import IO, Any, Literal

from ..engine.errors import InputError

from .embed_record import parse_embed_openai, parse_embed_plain, parse_encode_plain
from .openai_input import is_openai_line, parse_openai
from .plain_record import parse_plain
from .record import BatchRecord, RecordError

InputFormat = Literal["jsonl", "parquet", "openai"]
ReaderKind = Literal["generate", "embed", "encode"]
PARQUET_SUFFIXES = (".parquet", ".pq")
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
_PARQUET_MAGIC = b"PAR1"
_PARQUET_BATCH_ROWS = 1024


class RecordReader:
    """One input file. `format` is known on construction; iterate once (stdin) or many times (files)."""

    def __init__(self, path: str, *, sampling_defaults: dict[str, Any] | None = None,
                 stdin: IO[bytes] | None = None, kind: ReaderKind = "generate") -> None:
        assert kind in ("generate", "embed", "encode"), kind
        self.path = path
        self.kind = kind
        self.name = "<stdin>" if path == "-" else path
        self.sampling_defaults = dict(sampling_defaults or {})
        self._stdin = stdin
        self._peeked: list[bytes] = []
        self._stream: Iterator[bytes] | None = None
        self.format: InputFormat = self._detect()

    # ---------------------------------------------------------------- detection
    def _detect(self) -> InputFormat:
        if self.path != "-":
            if not os.path.exists(self.path):
                raise InputError(f"{self.path}: no such file", hint="check the path (use - to read stdin)")
            if os.path.isdir(self.path):
                raise InputError(f"{self.path}: is a folder, not a batch file")
            with open(self.path, "rb") as f:
                magic = f.read(4)
            # The name decides where it says: a .jsonl whose first line starts "PAR1" is a JSONL line
            # (a bad one, reported as that record's error); only a name that says neither is sniffed.
            lower = self.path.lower().removesuffix(".gz").removesuffix(".zst").removesuffix(".zstd")
            if lower.endswith(PARQUET_SUFFIXES) or (magic == _PARQUET_MAGIC and not lower.endswith(JSON_SUFFIXES)):
                return "parquet"
        for raw in self._raw_lines(peek=True):
            if raw.strip():
                try:
                    first = json.loads(raw)
                except (ValueError, RecursionError):
                    return "jsonl"  # the broken line is reported when it is read
                return "openai" if is_openai_line(first) else "jsonl"
        return "jsonl"

    def _raw_lines(self, *, peek: bool = False) -> Iterator[bytes]:
        """The input's lines as bytes: decompressed (.gz, .zst), a UTF-8 BOM dropped; CRLF endings,
        blank lines and a last line without a newline are the JSON parser's business (all fine)."""
        if self.path == "-":
            if self._stream is None:  # one iterator, so the peek and the read continue each other
                self._stream = iter(self._stdin if self._stdin is not None else sys.stdin.buffer)
            stream = self._stream
            if peek:
                for raw in _without_bom(stream):
                    self._peeked.append(raw)
                    if raw.strip():
                        return
                return
            yield from self._peeked
            self._peeked = []
            yield from stream
            return
        line = 0
        with open_input_bytes(self.path) as f:
            try:
                for line, raw in enumerate(_without_bom(f), start=1):
                    yield raw
            except (EOFError, OSError) as e:        # gzip / zstd: a truncated or damaged stream
                raise InputError(f"{self.path}: cannot decompress after line {line}: {e}",
                                 hint="the compressed file is truncated or damaged") from None
            except Exception as e:                  # zstandard.ZstdError
                if type(e).__name__ != "ZstdError":
                    raise
                raise InputError(f"{self.path}: cannot decompress after line {line}: {e}",
                                 hint="the compressed file is truncated or damaged") from None

    # ---------------------------------------------------------------- iteration
    def __iter__(self) -> Iterator[BatchRecord | RecordError]:
        first_line: dict[str, int] = {}
        rows = self._parquet_records() if self.format == "parquet" else self._jsonl_records()
        for rec in rows:
            if isinstance(rec, BatchRecord):
                seen = first_line.get(rec.id)
                if seen is not None:
                    what = "custom_id" if rec.openai else "id"
                    yield RecordError(id=rec.id, line=rec.line, field=what, file=self.name,
                                      message=f"duplicate {what} {rec.id!r} (first on line {seen})",
                                      custom_id=rec.openai.custom_id if rec.openai else None)
                    continue
                first_line[rec.id] = rec.line
            yield rec

    def _jsonl_records(self) -> Iterator[BatchRecord | RecordError]:
        for line, raw in enumerate(self._raw_lines(), start=1):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError as e:
                yield RecordError(id=None, line=line, field="json", file=self.name,
                                  message=f"not valid UTF-8 ({e.reason} at byte {e.start})")
                continue
            except RecursionError:
                yield RecordError(id=None, line=line, field="json", file=self.name,
                                  message="invalid JSON: nested too deeply for a batch record")
                continue
            except ValueError as e:
                msg = getattr(e, "msg", str(e))
                col = getattr(e, "colno", None)
                yield RecordError(id=None, line=line, field="json", file=self.name,
                                  message=f"invalid JSON: {msg}" + (f" (column {col})" if col else ""))
                continue
            if self.format == "openai":
                yield self._parse_openai(obj, line)
            else:
                yield self._parse_plain(obj, line, str(line))

    def _parse_plain(self, obj: Any, line: int, default_id: str) -> BatchRecord | RecordError:
        if self.kind == "encode":
            return parse_encode_plain(obj, line, file=self.name, default_id=default_id)
        if self.kind == "embed":
            return parse_embed_plain(obj, line, file=self.name, default_id=default_id)
        return parse_plain(obj, line, file=self.name, default_id=default_id, sampling_defaults=self.sampling_defaults)

    def _parse_openai(self, obj: Any, line: int) -> BatchRecord | RecordError:
        if self.kind == "encode":
            return RecordError(id=None, line=line, field="record", file=self.name,
                               message="vbatch encode reads plain records (OpenAI Batch lines go to vbatch run / embed)")
        if self.kind == "embed":
            return parse_embed_openai(obj, line, file=self.name)
        return parse_openai(obj, line, file=self.name, sampling_defaults=self.sampling_defaults)

    def _parquet_records(self) -> Iterator[BatchRecord | RecordError]:
        import pyarrow.parquet as pq  # lazy: `vbatch --help` stays fast

        try:
            pf = pq.ParquetFile(self.path)
        except Exception as e:  # pyarrow raises several types for a damaged file
            raise InputError(f"{self.name}: cannot read as Parquet ({e})") from None
        row = 0
        for batch in pf.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
            for obj in batch.to_pylist():
                yield self._parse_plain(_clean_parquet_row(obj), row, str(row))
                row += 1

    def count(self) -> int | None:
        """Records (non-blank lines / rows) for progress ETA; None for stdin."""
        if self.path == "-":
            return None
        if self.format == "parquet":
            import pyarrow.parquet as pq
            try:
                return pq.ParquetFile(self.path).metadata.num_rows
            except Exception:
                return None
        with open(self.path, "rb") as f:
            return sum(1 for raw in _without_bom(f) if raw.strip())


def _clean_parquet_row(obj: dict[str, Any]) -> dict[str, Any]:
    """Undo Parquet's column unification: a struct column gives every row every key, null where absent.

    NOTE: so a null sampling field in Parquet means "not set", never an explicit None
    (e.g. max_tokens=None for "no limit" cannot be expressed in a struct column; use JSONL).
    """
    sp = obj.get("sampling_params")
    if isinstance(sp, str):
        try:
            obj["sampling_params"] = json.loads(sp)
        except ValueError:
            pass  # reported as a type error by the parser
    elif isinstance(sp, dict):
        obj["sampling_params"] = {k: v for k, v in sp.items() if v is not None}
    msgs = obj.get("messages")
    if isinstance(msgs, list):
        obj["messages"] = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m
                           for m in msgs]
    return obj


def open_reader(path: str, *, sampling_defaults: dict[str, Any] | None = None,
                stdin: IO[bytes] | None = None, kind: ReaderKind = "generate") -> RecordReader:
    return RecordReader(path, sampling_defaults=sampling_defaults, stdin=stdin, kind=kind)


_BOM = b"\xef\xbb\xbf"
COMPRESSED_SUFFIXES = {".gz": "gzip", ".zst": "zstd", ".zstd": "zstd"}


def _without_bom(lines) -> Iterator[bytes]:
    """The lines, the first one without a UTF-8 byte order mark (files saved by Windows tools)."""
    first = True
    for raw in lines:
        if first:
            first = False
            if raw.startswith(_BOM):
                raw = raw[len(_BOM):]
        yield raw


def open_input_bytes(path: str) -> IO[bytes]:
    """A batch file opened for reading, decompressed on the fly by its suffix (.jsonl.gz, .jsonl.zst)."""
    kind = COMPRESSED_SUFFIXES.get(os.path.splitext(path)[1].lower())
    if kind == "gzip":
        import gzip
        return gzip.open(path, "rb")
    if kind == "zstd":
        import io

        import zstandard
        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb"), closefd=True))
    return open(path, "rb")
