"""Clean stops for `vbatch run`: SIGINT (Ctrl-C) and SIGTERM (Slurm's warning before it kills) set a flag.

The runner polls the flag between engine steps, stops admitting, writes what is finished and
returns; `vbatch run` then keeps the partial output (resumable) and exits 130 (SIGINT) or 143
(SIGTERM), the shell's 128 + signal number. A second Ctrl-C raises KeyboardInterrupt at once for
a user who will not wait for the current step. Handlers are only installed while the context is
open, and only in the main thread (Python's rule).
"""
from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any

from .errors import EXIT_INTERRUPTED, EXIT_TERMINATED


class StopSignals:
    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def is_set(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return EXIT_TERMINATED if self.signum == signal.SIGTERM else EXIT_INTERRUPTED

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else "none"

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum == signal.SIGINT and signum == signal.SIGINT:
            raise KeyboardInterrupt  # the second Ctrl-C: stop now
        if self.signum is None:
            self.signum = signum

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *_: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
