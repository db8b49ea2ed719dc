"""A crash-safe output file: written at `PATH.partial`, renamed onto `PATH` only by `commit()`.

A run that dies (or a writer never closed) leaves no file at the final path, only the
partial one holding the records written so far (a kill can tear its last line; `vbatch.batch.resume`
cuts that away). `append=True` reopens an existing partial file to resume it. Used by every
writer in `vbatch.batch.writers` and by `vbatch.batch.merge`.
"""
from __future__ import annotations

import os
from typing import BinaryIO

from .crash_points import crash_point

PARTIAL_SUFFIX = ".partial"


def partial_path(path: str) -> str:
    return path + PARTIAL_SUFFIX


class AtomicFile:
    def __init__(self, path: str, *, append: bool = False) -> None:
        self.path = path
        self.partial = partial_path(path)
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        self.file: BinaryIO = open(self.partial, "ab" if append else "wb")
        self.closed = False

    def write(self, data: bytes) -> None:
        self.file.write(data)

    def flush(self) -> None:
        """Hand what is buffered to the OS: it survives a killed process (not a power cut)."""
        self.file.flush()

    def sync(self) -> None:
        """Make everything written so far durable (a checkpoint a resume can trust)."""
        self.file.flush()
        os.fsync(self.file.fileno())

    def commit(self) -> None:
        """Durably move the finished file onto its final path (atomic on one filesystem)."""
        if self.closed:
            return
        self.sync()
        self.file.close()
        self.closed = True
        crash_point("commit.before_rename")
        os.replace(self.partial, self.path)
        crash_point("commit.after_rename")
        fsync_dir(os.path.dirname(os.path.abspath(self.path)))

    def abandon(self) -> None:
        """Stop writing; keep the partial file (its whole records survive) and no final file."""
        if self.closed:
            return
        # A full disk may refuse the last flush too: the records already on disk still survive (a torn
        # last line is cut by the resume), and the error that brought us here is the one to report.
        try:
            self.sync()
        except OSError:
            pass
        finally:
            try:
                self.file.close()
            except OSError:
                pass
            self.closed = True


def fsync_dir(folder: str) -> None:
    # The rename itself must be durable; some filesystems refuse to open a folder, which is fine.
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_file_atomically(path: str, data: bytes) -> None:
    """A whole file in one go: written at PATH.partial, renamed onto PATH (never half there)."""
    out = AtomicFile(path)
    try:
        out.write(data)
    except BaseException:
        out.abandon()
        raise
    out.commit()
