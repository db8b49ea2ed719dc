"""A job whose unit is a file (`vbatch encode --plugin ...`): which inputs, where each output goes, what is done.

    inputs = collect_inputs(["tiles/", "extra/a.tif"], suffixes=(".tif", ".tiff"))   # FileInput, sorted
    plan = plan_files(inputs, out_dir, manifest, shard=..., overwrite=...)           # what this run does

Inputs: files as given (any name), and folders searched recursively for files with `suffixes`
(hidden files skipped). Each input writes `OUT/<name>`: a file given alone by its base name, a
file found in a folder by its path below that folder. Two inputs with one output name are an
error before anything runs. A shard `I/N` takes the inputs at positions `% N == I` of the sorted list.

Resume: an output is complete when it exists under its final name (plugins write atomically, side
files first), so a rerun skips it; `.partial` leftovers of a killed run are overwritten. The folder
keeps a manifest (`OUT/.vbatch-encode.json`: command, model, plugin, options) and a rerun with
other options is refused (OutputStateError, exit 5) unless `--overwrite`, which redoes every output.
Every shard of a job array writes the same manifest, so they share one folder.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engine.errors import ConfigError, InputError
from .manifest import OutputStateError
from .shard import Shard

MANIFEST_NAME = ".vbatch-encode.json"


@dataclass(frozen=True)
class FileInput:
    path: Path
    name: str             # the output's path below OUT (posix separators)


@dataclass(frozen=True)
class FilePlan:
    todo: tuple[FileInput, ...]      # this run writes these
    done: tuple[FileInput, ...]      # complete from an earlier run (skipped)
    num_inputs: int                  # every input, all shards


def collect_inputs(args: list[str], suffixes: tuple[str, ...]) -> list[FileInput]:
    found: list[FileInput] = []
    for arg in args:
        p = Path(arg)
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in suffixes
                           and not any(part.startswith(".") for part in f.relative_to(p).parts))
            if not files:
                raise InputError(f"holds no {' / '.join(suffixes)} files", file=arg)
            found += [FileInput(f, f.relative_to(p).as_posix()) for f in files]
        elif p.is_file():
            found.append(FileInput(p, p.name))
        else:
            raise InputError("no such file or folder", file=arg)
    by_name: dict[str, FileInput] = {}
    for f in found:
        if f.name in by_name and by_name[f.name].path.resolve() != f.path.resolve():
            raise ConfigError("inputs", f"{by_name[f.name].path} and {f.path} would both write {f.name}",
                              hint="rename one, or run them into different output folders")
        by_name[f.name] = f
    return sorted(by_name.values(), key=lambda f: f.name)


def plan_files(inputs: list[FileInput], out_dir: Path, manifest: dict[str, Any], *, shard: Shard,
               overwrite: bool) -> FilePlan:
    """Checks the folder's manifest (writing it when new) and splits this shard's inputs into todo / done."""
    for f in inputs:
        if (out_dir / f.name).resolve() == f.path.resolve():
            raise ConfigError("--output", f"{out_dir / f.name} is the input {f.path}: its output would overwrite it",
                              hint="write the outputs into another folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    file = out_dir / MANIFEST_NAME
    if file.exists() and not overwrite:
        try:
            old = json.loads(file.read_text())
        except ValueError:
            old = None
        if old != manifest:
            raise OutputStateError(f"{out_dir} holds outputs of another run ({file.name} differs: "
                                   f"{_difference(old, manifest)})",
                                   hint="use the same options, another -o folder, or --overwrite to redo them")
    tmp = file.with_name(file.name + f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, file)
    mine = [f for i, f in enumerate(inputs) if shard.owns(i)]
    done = [] if overwrite else [f for f in mine if (out_dir / f.name).is_file()]
    done_names = {f.name for f in done}
    return FilePlan(tuple(f for f in mine if f.name not in done_names), tuple(done), len(inputs))


def _difference(old: Any, new: dict[str, Any]) -> str:
    if not isinstance(old, dict):
        return "unreadable"
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return ", ".join(f"{k} was {old.get(k)!r}, now {new.get(k)!r}" for k in keys[:3]) or "unknown"
