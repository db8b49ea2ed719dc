"""`vbatch merge`: put the parts of a sharded run back together, in input order, atomically.

Part I of N holds the records at input positions I, I+N, I+2N, ... in order, so input order is a
round robin over the parts (no index, no sort: it streams). Before writing anything it checks
that parts 0..N-1 are all there and complete (`OUT.part-I-of-N` in place, its manifest saying
shard I/N) and that their manifests agree (same input, options, format); while writing it checks
that ids are unique and, with `--input FILE`, that the i-th merged record has the i-th input
record's id and that none is missing. The merged file gets a complete manifest of the unsharded
run, so `vbatch run` with the same options on OUT then says "already complete".
Called by `vbatch.cli.merge`.
"""
from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from .atomic_file import AtomicFile, partial_path
from .crash_points import crash_point
from .manifest import Manifest, OutputStateError, input_identity, read_manifest, write_manifest
from .shard import split_part_path

_ROWS_PER_GROUP = 1024


@dataclass(frozen=True)
class MergeResult:
    path: str
    num_parts: int
    num_records: int
    already_complete: bool = False


def find_parts(paths: list[str]) -> tuple[str, int]:
    """(OUT, N) from `OUT` itself or from part names `OUT.part-I-of-N` (as a shell glob lists them)."""
    assert paths
    parsed = [split_part_path(p) for p in paths]
    named = [p for p in parsed if p is not None]
    if not named:
        if len(paths) > 1:
            raise OutputStateError(f"expected one output path or its part files, got {', '.join(paths)}")
        base = paths[0]
        found = [split_part_path(p) for p in glob.glob(glob.escape(base) + ".part-*-of-*")]
        named = [p for p in found if p is not None and p[0] == base]
        if not named:
            raise OutputStateError(f"no parts of {base} found (expected {base}.part-0-of-N, ...)",
                                   hint="run `vbatch run ... --shard I/N -o OUT` for every I first")
    bases = {b for b, _, _ in named}
    counts = {n for _, _, n in named}
    if len(bases) > 1:
        raise OutputStateError(f"parts of different outputs given: {', '.join(sorted(bases))}")
    if len(counts) > 1:
        raise OutputStateError(f"parts of {bases.pop()} from different shard counts: "
                               f"N = {', '.join(str(n) for n in sorted(counts))}",
                               hint="delete the parts of the old split")
    return bases.pop(), counts.pop()


def _check_parts(base: str, count: int) -> list[Manifest]:
    problems, manifests = [], []
    for i in range(count):
        part = f"{base}.part-{i}-of-{count}"
        manifest = read_manifest(part)
        if not os.path.exists(part):
            if os.path.exists(partial_path(part)):
                with open(partial_path(part), "rb") as f:
                    done = sum(1 for raw in f if raw.endswith(b"\n"))
                problems.append(f"part {i} of {count} is incomplete ({partial_path(part)} holds {done} records; "
                                f"rerun shard {i}/{count} to finish it)")
            else:
                problems.append(f"part {i} of {count} is missing (no {part}; run shard {i}/{count})")
        elif manifest is None or manifest.shard != f"{i}/{count}":
            problems.append(f"part {i} of {count} has no manifest for shard {i}/{count} ({part}.manifest.json)")
        else:
            manifests.append(manifest)
    if problems:
        raise OutputStateError(f"cannot merge {base}: " + "; ".join(problems),
                               hint="rerun the failed array tasks with the same command, then merge again")
    first = manifests[0]
    for i, m in enumerate(manifests[1:], start=1):
        found = replace(first, shard=m.shard).differences(replace(m, state=first.state,
                                                                  num_records=first.num_records))
        if found:
            raise OutputStateError(f"cannot merge {base}: part {i} and part 0 come from different runs: "
                                   + "; ".join(found))
    return manifests


def _part_rows(path: str, fmt: str) -> Iterator[tuple[Any, Any]]:
    """(id, payload) per record: raw JSON lines for JSONL/OpenAI parts, row dicts for Parquet parts."""
    key = "custom_id" if fmt == "openai" else "id"
    if fmt == "parquet":
        import pyarrow.parquet as pq
        for batch in pq.ParquetFile(path).iter_batches(batch_size=_ROWS_PER_GROUP):
            for row in batch.to_pylist():
                yield row.get("id"), row
        return
    with open(path, "rb") as f:
        for raw in f:
            yield json.loads(raw).get(key), raw


def merge_parts(paths: list[str], *, input_path: str | None = None, overwrite: bool = False) -> MergeResult:
    import contextlib

    from .output_lock import output_lock

    base, count = find_parts(paths)
    # The parts it reads and the output it writes, each held (a part still being written: exit 6).
    with contextlib.ExitStack() as held:
        held.enter_context(output_lock(base))
        for i in range(count):
            held.enter_context(output_lock(f"{base}.part-{i}-of-{count}", what="part"))
        return _merge_locked(base, count, input_path=input_path, overwrite=overwrite)


def _merge_locked(base: str, count: int, *, input_path: str | None, overwrite: bool) -> MergeResult:
    manifests = _check_parts(base, count)
    first = manifests[0]
    if input_path is not None:
        ident = input_identity(input_path)
        if (ident["size"], ident["head_sha256"]) != (first.input.get("size"), first.input.get("head_sha256")):
            raise OutputStateError(f"cannot merge {base}: the parts were written for {first.input.get('path')}, "
                                   f"not for {input_path} (other size or content)")
    merged = replace(first, shard="0/1", state="running", num_records=None)
    on_disk = read_manifest(base) if os.path.exists(base) else None
    total = sum(m.num_records or 0 for m in manifests)
    if on_disk is not None and not overwrite and not merged.differences(on_disk) and on_disk.state == "complete":
        return MergeResult(base, count, on_disk.num_records or 0, already_complete=True)
    # A merge killed after its rename left OUT with this merge's running manifest: redo it.
    ours_unfinished = on_disk is not None and not merged.differences(on_disk)
    if os.path.exists(base) and not overwrite and not ours_unfinished:
        raise OutputStateError(f"{base} already exists", hint="pass --overwrite to replace it")
    kind = "embed" if first.options.get("command") == "embed" else "generate"
    write_manifest(base, merged)              # state running, before OUT can appear under its name
    _write_merged(base, count, merged.format, input_path, kind)
    write_manifest(base, merged.completed(total))
    return MergeResult(base, count, total)


def _expected_ids(input_path: str | None, kind: str) -> Iterator[tuple[Any, int]] | None:
    if input_path is None:
        return None
    from .readers import open_reader
    return ((rec.id, rec.line) for rec in open_reader(input_path, kind=kind))


def _write_merged(base: str, count: int, fmt: str, input_path: str | None, kind: str = "generate") -> None:
    sources = [_part_rows(f"{base}.part-{i}-of-{count}", fmt) for i in range(count)]
    expected = _expected_ids(input_path, kind)
    seen: set[str] = set()
    out = AtomicFile(base)
    pq_writer, rows, schema = None, [], None
    if fmt == "parquet":
        import pyarrow.parquet as pq

        # the parts' own schema (generation or embedding records; an embedding column's width)
        schema = pq.ParquetFile(f"{base}.part-0-of-{count}").schema_arrow
        pq_writer = pq.ParquetWriter(out.file, schema)
    try:
        position = 0
        while True:
            item = next(sources[position % count], None)
            if item is None:
                break
            rid, payload = item
            if expected is not None:
                want = next(expected, None)
                if want is None:
                    raise OutputStateError(f"cannot merge {base}: the parts hold more records than the input "
                                           f"(record {position + 1} has id {rid!r})")
                if want[0] != rid:
                    raise OutputStateError(f"cannot merge {base}: record {position + 1} has id {rid!r}, "
                                           f"the input's (line {want[1]}) is {want[0]!r}")
            if rid is not None:
                if rid in seen:
                    raise OutputStateError(f"cannot merge {base}: id {rid!r} appears twice")
                seen.add(rid)
            if pq_writer is not None:
                rows.append(payload)
                if len(rows) >= _ROWS_PER_GROUP:
                    _write_rows(pq_writer, rows, schema)
                    rows = []
            else:
                out.write(payload)
            position += 1
        for i, rest in enumerate(sources):
            if next(rest, None) is not None:
                raise OutputStateError(f"cannot merge {base}: part {i} has records past the end of part "
                                       f"{position % count} (the parts are not one split of one input)")
        if expected is not None:
            want = next(expected, None)
            if want is not None:
                raise OutputStateError(f"cannot merge {base}: the parts hold {position} records; the input has "
                                       f"more (first missing: id {want[0]!r}, line {want[1]})")
        if pq_writer is not None:
            if rows or position == 0:
                _write_rows(pq_writer, rows, schema)
            pq_writer.close()
    except BaseException:
        out.abandon()
        os.remove(out.partial)
        raise
    crash_point("merge.before_commit")
    out.commit()


def _write_rows(writer: Any, rows: list[dict[str, Any]], schema: Any) -> None:
    import pyarrow as pa
    writer.write_table(pa.Table.from_pylist(rows, schema=schema))
