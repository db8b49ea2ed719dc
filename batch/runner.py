"""run_batch: stream records through the engine, a bounded number in flight, outputs in input order.

Data flow: reader -> (sampling params, chat template) -> `llm.engine.add_request` ->
`llm.engine.step()` until requests finish -> ReorderWindow -> writer. Called by `vbatch run`.

Engine interface relied on (vbatch.LLM): `get_default_sampling_params()`,
`preprocess_chat(messages, chat_template=..., add_generation_prompt=True)`, and on `llm.engine`:
`add_request(request_id, prompt_dict, params)`, `has_unfinished_requests()`, `step()` (the
requests that finished this step), `stats` (counters dict).

Steps of the loop:
1. Admit records while fewer than `max_in_flight` are in the engine and fewer than
   `max_pending` are admitted but unwritten (the reorder window's bound). Bad records and
   requests the engine refuses become error results at once; they never stop the run.
2. Write every result the reorder window can release (input order).
3. Run one engine step; each finished RequestOutput goes into the window.

`should_stop` (polled once per loop, e.g. a SIGTERM flag) ends the run early: admitting stops,
what the window can release is written, requests still in the engine are dropped (a resumed run
does them again) and the summary says `interrupted`.
"""
from __future__ import annotations

import contextlib
import resource
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

from ..engine.errors import VBatchError

from .record import BatchRecord, RecordError
from .reorder import ReorderWindow
from .result import BatchResult
from .summary import RunSummary
from .writers import Writer

ResultHook = Callable[[BatchResult], None]


def _params_for(base: Any, defaults: dict[str, Any], record: BatchRecord) -> Any:
    # Precedence: record > command line > model generation_config (already in `base`).
    return base.replace(**{**defaults, **record.sampling_overrides})


def _prompt_for(llm: Any, record: BatchRecord, chat_template: str | None) -> dict[str, Any]:
    if record.kind == "messages":
        # preprocess_chat gives {"prompt", "prompt_token_ids"} (ids without a second BOS) or the text.
        chat = llm.preprocess_chat(list(record.messages or []), chat_template=chat_template,
                                   add_generation_prompt=True, continue_final_message=False)
        return dict(chat) if isinstance(chat, dict) else {"prompt": chat}
    return record.engine_prompt()


def _stat_counters(llm: Any) -> dict[str, float]:
    """The engine's numeric counters, from a stats dict or dataclass (missing ones read as 0)."""
    stats = getattr(llm.engine, "stats", None)
    if stats is None:
        return {}
    items = stats.items() if isinstance(stats, dict) else vars(stats).items()
    return {k: v for k, v in items if isinstance(v, (int, float)) and not isinstance(v, bool)}


def _peak_device_bytes() -> int | None:
    """Peak CUDA memory of this process, when torch has touched CUDA at all (never imports torch)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    return int(torch.cuda.max_memory_allocated())


def run_batch(records: Iterable[BatchRecord | RecordError], writer: Writer, llm: Any,
              defaults: dict[str, Any] | None = None, *, max_in_flight: int = 512,
              max_pending: int | None = None, chat_template: str | None = None,
              on_result: ResultHook | None = None,
              should_stop: Callable[[], bool] | None = None, first_seq: int = 0) -> RunSummary:
    assert max_in_flight >= 1
    max_pending = max(max_pending or 4 * max_in_flight, max_in_flight)
    defaults = dict(defaults or {})
    engine = llm.engine
    base = llm.get_default_sampling_params()
    stats_before = _stat_counters(llm)
    start = time.perf_counter()

    # A resumed run continues the numbering, so request ids match an uninterrupted run's.
    window: ReorderWindow[BatchResult] = ReorderWindow(first_seq)
    in_engine: dict[str, tuple[int, BatchRecord]] = {}
    source = iter(records)
    is_exhausted = False
    next_seq = first_seq
    counts = {"requests": 0, "ok": 0, "errors": 0, "prompt": 0, "generated": 0, "cached": 0}

    def emit(result: BatchResult) -> None:
        writer.write(result)
        counts["requests"] += 1
        counts["ok" if result.ok else "errors"] += 1
        out = result.output
        if out is not None:
            counts["prompt"] += len(out.prompt_token_ids or [])
            counts["generated"] += sum(len(c.token_ids) for c in out.outputs)
            counts["cached"] += int(out.num_cached_tokens or 0)
        if on_result is not None:
            on_result(result)

    is_interrupted = False
    try:
        while True:
            if should_stop is not None and should_stop():
                is_interrupted = True
                for result in window.pop_ready():
                    emit(result)
                break
            # 1. admit
            while (not is_exhausted and len(in_engine) < max_in_flight
                   and len(in_engine) + window.num_held < max_pending):
                try:
                    rec = next(source)
                except StopIteration:
                    is_exhausted = True
                    break
                seq, next_seq = next_seq, next_seq + 1
                if isinstance(rec, RecordError):
                    window.put(seq, BatchResult(seq, input_error=rec))
                    continue
                request_id = str(seq)
                try:
                    params = _params_for(base, defaults, rec)
                    engine.add_request(request_id, _prompt_for(llm, rec, chat_template), params)
                except VBatchError as e:
                    window.put(seq, BatchResult(seq, record=rec, error=str(e)))
                    continue
                in_engine[request_id] = (seq, rec)
            # 2. write what is ready, in order
            for result in window.pop_ready():
                emit(result)
            if not in_engine:
                if is_exhausted:
                    break
                continue
            # 3. one engine step
            finished = engine.step()
            for out in finished:
                seq, rec = in_engine.pop(out.request_id)
                window.put(seq, BatchResult(seq, record=rec, output=out))
            assert finished or engine.has_unfinished_requests(), "engine lost requests it was given"
    finally:
        # A stopped or failed run leaves nothing in the engine: a reused LLM starts clean.
        abort = getattr(engine, "abort_request", None)
        if abort is not None:
            for request_id in list(in_engine):
                with contextlib.suppress(Exception):  # never hide the error that ended the run
                    abort(request_id)
    assert is_interrupted or window.num_held == 0
    stats = _stat_counters(llm)
    delta = {k: stats.get(k, 0) - stats_before.get(k, 0) for k in stats}
    queries = delta.get("prefix_cache_queries", 0)
    return RunSummary(
        num_requests=counts["requests"], num_ok=counts["ok"], num_errors=counts["errors"],
        prompt_tokens=counts["prompt"], generated_tokens=counts["generated"],
        cached_prompt_tokens=counts["cached"], wall_time_s=time.perf_counter() - start,
        prefix_cache_hit_rate=(delta.get("prefix_cache_hits", 0) / queries) if queries else None,
        num_preemptions=int(delta.get("num_preemptions", 0)),
        peak_rss_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        peak_device_bytes=_peak_device_bytes(), interrupted=is_interrupted,
    )
