"""Named points where a test may have the process killed (SIGKILL), for the crash-test harness.

    crash_point("commit.before_rename")        # no-op unless VBATCH_CRASH_AT names this point

`VBATCH_CRASH_AT=NAME` kills the process the first time it reaches NAME, `NAME:K` the K-th time
(`record.written:17`: right after the 17th output record is handed to the OS). Unset, a point
costs one dict lookup. Used by tests/test_crash_harness.py, which kills runs at every point and
at random moments and checks that the resumed output is the uninterrupted one.

Points: `record.written` (batch/writers.py), `commit.before_rename` / `commit.after_rename`
(batch/atomic_file.py: the final rename of an output, a merged output, a Parquet conversion),
`parquet.before_rename` (the JSONL partial converted to Parquet), `manifest.before_rename`
(batch/manifest.py), `merge.before_commit` (batch/merge.py).
"""
from __future__ import annotations

import os
import signal

_ENV = "VBATCH_CRASH_AT"
_counts: dict[str, int] = {}


def crash_point(name: str) -> None:
    spec = os.environ.get(_ENV)
    if not spec:
        return
    target, _, nth = spec.partition(":")
    if target != name:
        return
    _counts[name] = _counts.get(name, 0) + 1
    if _counts[name] >= int(nth or 1):
        os.kill(os.getpid(), signal.SIGKILL)
