"""The manifest beside an output: which input and which options produced it, and whether it is done.

`OUT.manifest.json` is written (atomically) when a run starts and again, with `state: complete`
and the record count, once `OUT` is in place. A rerun compares it with what the new command
would write: the same input (size + SHA-256 of the first MiB; the path is kept for messages
only, so a moved file still matches), the options that change outputs (model, dtype,
max_model_len, seed, generation_config, chat template, sampling defaults), the output format
and the shard. Scheduling knobs (max_num_seqs, KV cache size, prefix caching, device,
num_scheduler_steps) are left out: they change speed, not what a record means. Used by `vbatch.batch.resume` and `vbatch.batch.merge`.
"""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, replace
from typing import Any

from ..engine.errors import VBatchError

from .atomic_file import fsync_dir
from .crash_points import crash_point

MANIFEST_SUFFIX = ".manifest.json"
HEAD_BYTES = 1 << 20
VERSION = 1


class OutputStateError(VBatchError):
    """An output that cannot be written or merged as asked: it belongs to another run, or parts are missing."""

    exit_code = 5


def manifest_path(output: str) -> str:
    return output + MANIFEST_SUFFIX


def input_identity(path: str) -> dict[str, Any]:
    if path == "-":
        return {"path": "-", "size": None, "head_sha256": None}
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(HEAD_BYTES))
    return {"path": os.path.abspath(path), "size": os.path.getsize(path), "head_sha256": digest.hexdigest()}


@dataclass(frozen=True)
class Manifest:
    input: dict[str, Any]
    options: dict[str, Any]        # the output-changing options, JSON-normalised
    format: str                    # "jsonl" | "parquet" | "openai"
    shard: str = "0/1"
    state: str = "running"         # "running" | "complete"
    num_records: int | None = None  # set when complete
    version: int = VERSION

    @staticmethod
    def build(input_path: str, options: dict[str, Any], fmt: str, shard: str = "0/1") -> "Manifest":
        # JSON round trip: tuples become lists, so a manifest read back compares equal.
        return Manifest(input=input_identity(input_path), options=json.loads(json.dumps(options, sort_keys=True)),
                        format=fmt, shard=shard)

    def completed(self, num_records: int) -> "Manifest":
        return replace(self, state="complete", num_records=num_records)

    def differences(self, other: "Manifest") -> list[str]:
        """Why `other` (what is on disk) is not this run's output; empty when it is."""
        found = []
        if self.input.get("path") == "-" or other.input.get("path") == "-":
            found.append("input: stdin cannot be identified, so its output cannot be resumed")
        elif (self.input.get("size"), self.input.get("head_sha256")) != (other.input.get("size"),
                                                                        other.input.get("head_sha256")):
            found.append(f"input: written for {other.input.get('path')} ({other.input.get('size')} bytes), "
                         f"now {self.input.get('path')} ({self.input.get('size')} bytes) with other content")
        for key in sorted(set(self.options) | set(other.options)):
            if self.options.get(key) != other.options.get(key):
                found.append(f"option {key}: {other.options.get(key)!r} then, {self.options.get(key)!r} now")
        if self.format != other.format:
            found.append(f"format: {other.format} then, {self.format} now")
        if self.shard != other.shard:
            found.append(f"shard: {other.shard} then, {self.shard} now")
        return found


def read_manifest(output: str) -> Manifest | None:
    path = manifest_path(output)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        return Manifest(**{k: data[k] for k in ("input", "options", "format", "shard", "state", "num_records",
                                                   "version") if k in data})
    except (ValueError, TypeError, KeyError) as e:
        raise OutputStateError(f"{path}: unreadable manifest ({e})",
                               hint="delete it, or pass --overwrite to start the output over") from None


def write_manifest(output: str, manifest: Manifest) -> None:
    """Atomic: a reader sees the old manifest or the new one, never half of one."""
    path = manifest_path(output)
    tmp = path + ".tmp"
    data = asdict(manifest)
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    crash_point("manifest.before_rename")
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(path)))
