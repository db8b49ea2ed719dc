"""One writer per output: an exclusive `flock` on `OUT.lock`, held for the whole run.

    with output_lock("answers.jsonl", wait=False):      # OutputLockedError if another run holds it
        ...                                              # write answers.jsonl.partial, rename, manifest

The lock is the kernel's (`fcntl.flock` on an open file), so it dies with its holder: a run killed
with SIGKILL leaves at most a lock file that nobody holds, and the next run takes it at once (no
manual cleanup, no pid guessing). The file holds the holder's pid, host, start time and command
line, for the message a second run prints. On release the holder deletes the file while still
holding the lock; a run that opened the file just before then finds, once it holds the lock,
that the path names another file (or none) and starts over, so two runs never hold two locks on
one output. Used by `vbatch run` / `embed` / `encode` (each shard part has its own lock) and
`vbatch merge` (it holds the locks of the parts it reads and of the output it writes).

NOTE: flock is advisory and per open file: it excludes other vbatch runs (any host on a local or
NFSv4 file system that supports it), not other programs writing the file.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator

from ..engine.errors import ConfigError, VBatchError

LOCK_SUFFIX = ".lock"


class OutputLockedError(VBatchError):
    """Another run holds the output's lock."""

    exit_code = 6


def lock_path(output: str) -> str:
    return output + LOCK_SUFFIX


def _holder(path: str) -> str:
    try:
        info = json.loads(open(path, encoding="utf-8").read() or "{}")
    except (OSError, ValueError):
        return "another vbatch run"
    started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.get("started", 0)))
    return f"pid {info.get('pid')} on {info.get('host')} (started {started}: {info.get('command', '?')})"


@contextlib.contextmanager
def output_lock(output: str, *, wait: bool = False, what: str = "output") -> Iterator[str]:
    """Hold the lock of `output` (a file or a folder path) until the block ends; yields the lock path."""
    path = lock_path(output)
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ConfigError("--output", f"the folder {parent} does not exist", hint="create it first")
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:                # read-only file system, no permission, full disk, ...
            raise ConfigError("--output", f"cannot write in {parent}: {e.strerror}",
                              hint="write the output somewhere you may write") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            os.close(fd)
            raise OutputLockedError(f"{output}: another run is writing this {what}: {_holder(path)}",
                                    hint="wait for it to finish, or rerun with --wait-lock to queue behind it") \
                from None
        try:
            same = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)                       # the holder deleted the file as we opened it: start over
    try:
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": time.time(),
                                 "command": " ".join(os.path.basename(a) if i == 0 else a
                                                     for i, a in enumerate(sys.argv))[:300]}).encode())
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)                # while still holding it (see the module docstring)
        os.close(fd)
