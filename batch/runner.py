"""run_batch: stream records through the engine, a bounded number in flight, outputs in input order.

Data flow: reader -> job (record -> prompt, params) -> `llm.stream` (the engine's streaming results
API, engine/output_stream.py) -> ReorderWindow -> writer. Called by `vbatch run` (GenerateJob) and
`vbatch embed` (PoolingJob): one loop for every kind of batch job. A record may become several
requests (an OpenAI embeddings line with several inputs): its result waits until all are in.

The stream adds requests while fewer than `max_in_flight` are in the engine and fewer than
`max_pending` are admitted but unwritten (the reorder window's bound). Bad records (RecordErrors)
travel through the stream as pass-through items, so they keep their place and their bound; a
request the job or the engine refuses becomes an error result; neither ever stops the run.
Each finished result goes into the window, and whatever the window can release is written.

`should_stop` (polled before every engine step, e.g. a SIGTERM flag) ends the run early: what
the window can release is written, requests still in the engine are dropped by the stream (a
resumed run does them again) and the summary says `interrupted`.
"""
from __future__ import annotations

import contextlib
import resource
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from ..engine.errors import VBatchError
from ..engine.output_stream import EngineRequest, StreamResult

from .jobs import BatchJob, BatchLLM, GenerateJob
from .record import BatchRecord, RecordError
from .reorder import ReorderWindow
from .result import BatchResult
from .summary import RunSummary
from .writers import Writer

ResultHook = Callable[[BatchResult], None]
_STAT_FIELDS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions")


@dataclass(frozen=True)
class _Part:
    """What travels with each engine request: its record's place, and which of its requests it is."""

    seq: int
    record: BatchRecord | RecordError
    index: int = 0
    count: int = 1
    refusal: VBatchError | None = None    # the job refused the record: nothing runs for it


def _counters(llm: BatchLLM) -> dict[str, float]:
    stats = llm.stats
    return {k: getattr(stats, k) for k in _STAT_FIELDS}


def _peak_device_bytes() -> int | None:
    """Peak CUDA memory of this process, when torch has touched CUDA at all (never imports torch)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.max_memory_allocated())


def run_batch(records: Iterable[BatchRecord | RecordError], writer: Writer, llm: BatchLLM,
              defaults: dict[str, Any] | None = None, *, max_in_flight: int = 512,
              max_pending: int | None = None, chat_template: str | None = None,
              on_result: ResultHook | None = None,
              should_stop: Callable[[], bool] | None = None, first_seq: int = 0,
              job: BatchJob | None = None) -> RunSummary:
    """`job` turns a record into a request (default: GenerateJob(llm, defaults, chat_template))."""
    assert max_in_flight >= 1
    max_pending = max(max_pending or 4 * max_in_flight, max_in_flight)
    job = job or GenerateJob(llm, defaults, chat_template)
    stats_before = _counters(llm)
    start = time.perf_counter()

    # A resumed run continues the numbering, so request ids match an uninterrupted run's.
    window: ReorderWindow[BatchResult] = ReorderWindow(first_seq)
    counts = {"requests": 0, "ok": 0, "errors": 0, "prompt": 0, "generated": 0, "cached": 0}
    num_admitted = 0

    def requests() -> Iterator[EngineRequest]:
        nonlocal num_admitted
        for seq, rec in enumerate(records, start=first_seq):
            num_admitted += 1
            if isinstance(rec, RecordError):
                yield EngineRequest(str(seq), None, None, context=_Part(seq, rec), passthrough=True)
                continue
            try:
                parts = job.requests_for(rec)
            except VBatchError as e:
                yield EngineRequest(str(seq), None, None, context=_Part(seq, rec, refusal=e), passthrough=True)
                continue
            for k, (prompt, params, task) in enumerate(parts):
                # one request keeps the record's number as its id (a resumed run's ids match an uninterrupted one's)
                rid = str(seq) if len(parts) == 1 else f"{seq}.{k}"
                yield EngineRequest(rid, prompt, params, pooling_task=task, context=_Part(seq, rec, k, len(parts)))

    def emit(result: BatchResult) -> None:
        writer.write(result)
        counts["requests"] += 1
        counts["ok" if result.ok else "errors"] += 1
        counts["prompt"] += result.prompt_tokens
        counts["generated"] += result.generated_tokens
        counts["cached"] += result.cached_tokens
        if on_result is not None:
            on_result(result)

    gathering: dict[int, list[StreamResult | None]] = {}   # records with several requests, until all are in

    def to_result(item: StreamResult) -> BatchResult | None:
        part: _Part = item.request.context
        rec = part.record
        if isinstance(rec, RecordError):
            return BatchResult(part.seq, input_error=rec)
        if part.refusal is not None:
            return BatchResult(part.seq, record=rec, error=str(part.refusal))
        if part.count > 1 or rec.inputs is not None:
            got = gathering.setdefault(part.seq, [None] * part.count)
            got[part.index] = item
            if any(g is None for g in got):
                return None
            del gathering[part.seq]
            failed = next((g.error for g in got if g.error is not None), None)
            if failed is not None:
                return BatchResult(part.seq, record=rec, error=str(failed))
            return BatchResult(part.seq, record=rec, output=[g.output for g in got])
        if item.error is not None:
            return BatchResult(part.seq, record=rec, error=str(item.error))
        return BatchResult(part.seq, record=rec, output=item.output)

    stopped = [False]

    def stop_now() -> bool:
        stopped[0] = stopped[0] or (should_stop is not None and should_stop())
        return stopped[0]

    stream = llm.stream(requests(), max_in_flight=max_in_flight,
                        admit=lambda: num_admitted - counts["requests"] < max_pending, should_stop=stop_now)
    with contextlib.closing(stream):
        for item in stream:
            result = to_result(item)
            if result is not None:
                window.put(result.seq, result)
            for result in window.pop_ready():
                emit(result)
            if stop_now():
                break
    is_interrupted = stopped[0]
    for result in window.pop_ready():
        emit(result)
    assert is_interrupted or window.num_held == 0
    stats = _counters(llm)
    delta = {k: stats[k] - stats_before[k] for k in stats}
    queries = delta["prefix_cache_queries"]
    return RunSummary(
        num_requests=counts["requests"], num_ok=counts["ok"], num_errors=counts["errors"],
        prompt_tokens=counts["prompt"], generated_tokens=counts["generated"],
        cached_prompt_tokens=counts["cached"], wall_time_s=time.perf_counter() - start,
        prefix_cache_hit_rate=(delta["prefix_cache_hits"] / queries) if queries else None,
        num_preemptions=int(delta["num_preemptions"]),
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        peak_device_bytes=_peak_device_bytes(), interrupted=is_interrupted,
    )
