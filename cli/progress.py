"""Progress of a batch command on stderr: a Rich bar on a terminal, timestamped lines otherwise.

Fed one BatchResult at a time by the runner's `on_result` hook; knows nothing of the engine.
The rate counts generated tokens (`vbatch run`) or input tokens (`vbatch embed`: `unit="input"`).
"""
from __future__ import annotations

import sys
import time
from typing import Any


class PlainProgress:
    """One line every `every_s` seconds (and at the end), for logs and batch schedulers."""

    def __init__(self, total: int | None, *, stream: Any = None, every_s: float = 10.0,
                 unit: str = "generated") -> None:
        self.total, self.every_s, self.unit = total, every_s, unit
        self.stream = stream if stream is not None else sys.stderr
        self.start = self.last = time.monotonic()
        self.done = self.errors = self.tokens = 0

    def update(self, result: Any) -> None:
        self.done += 1
        self.errors += 0 if result.ok else 1
        self.tokens += _tokens(result, self.unit)
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            self._line(now)

    def _line(self, now: float) -> None:
        elapsed = max(now - self.start, 1e-9)
        of = f"/{self.total}" if self.total is not None else ""
        eta = ""
        if self.total and self.done:
            eta = f", eta {max(self.total - self.done, 0) * elapsed / self.done:.0f}s"
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        print(f"[{stamp}] {self.done}{of} records, {self.errors} errors, "
              f"{self.tokens / elapsed:.1f} {self.unit} tok/s{eta}", file=self.stream, flush=True)

    def close(self) -> None:
        self._line(time.monotonic())


def _tokens(result: Any, unit: str) -> int:
    return result.prompt_tokens if unit == "input" else result.generated_tokens


class RichProgress:
    def __init__(self, total: int | None, unit: str = "generated") -> None:
        from rich.console import Console
        from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                   TimeRemainingColumn)

        self.start = time.monotonic()
        self.tokens, self.unit = 0, unit
        self.progress = Progress(
            TextColumn("[bold]records"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[tok_s]:.1f} " + ("input " if unit == "input" else "") + "tok/s"), TimeElapsedColumn(), TimeRemainingColumn(),
            console=Console(stderr=True), transient=False)
        self.task = self.progress.add_task("run", total=total, tok_s=0.0)
        self.progress.start()

    def update(self, result: Any) -> None:
        self.tokens += _tokens(result, self.unit)
        rate = self.tokens / max(time.monotonic() - self.start, 1e-9)
        self.progress.update(self.task, advance=1, tok_s=rate)

    def close(self) -> None:
        self.progress.stop()


def make_progress(total: int | None, unit: str = "generated") -> PlainProgress | RichProgress:
    return RichProgress(total, unit) if sys.stderr.isatty() else PlainProgress(total, unit=unit)
