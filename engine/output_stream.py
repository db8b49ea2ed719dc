"""The engine's one streaming results API: requests in (lazily, bounded), finished outputs out.

    for result in llm.stream(requests, max_in_flight=512):
        result.request.context   # what the caller attached (a batch record, a file and tile index)
        result.output            # RequestOutput | PoolingRequestOutput, or None when refused
        result.error             # the VBatchError that refused it (nothing ran for it)

Consumed by `LLM.generate/encode/...` (every prompt up front), the batch runner (`vbatch run` and
`vbatch embed`: bounded in flight, outputs reordered by the caller), the plugin driver (many
files' tiles through one engine run) and later a Ray actor. Results come as requests finish, in
finishing order; refused requests come back at once. Ownership: while the iterator runs it owns
the engine; when it ends for any reason (all done, the consumer stops iterating, `should_stop`,
or an exception from a step) every request it added and that has not finished is aborted, so a
reused engine starts clean.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from .errors import VBatchError


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt: Any                        # a string, {"prompt": ...}, {"prompt_token_ids": [...]}, ...
    params: Any                        # SamplingParams (generation) | PoolingParams (pooling)
    pooling_task: str | None = None    # pooling: the task (embed, classify, ...) unless params say it
    context: Any = None                # the caller's own; comes back on the result untouched
    passthrough: bool = False          # the caller already failed it: it comes back, in order, unrun


@dataclass(frozen=True)
class StreamResult:
    request: EngineRequest
    output: Any = None                 # RequestOutput | PoolingRequestOutput
    error: VBatchError | None = None   # why the engine refused the request

    @property
    def ok(self) -> bool:
        return self.output is not None and self.error is None


class StepEngine(Protocol):
    """The engine primitives the stream drives (LLMEngine; test doubles implement the same)."""

    def add_request(self, request_id: str, prompt: Any, params: Any, *, pooling_task: str | None = None) -> None: ...
    def step(self) -> list[Any]: ...
    def abort_request(self, request_id: str) -> Any: ...
    def has_unfinished_requests(self) -> bool: ...


def stream_outputs(engine: StepEngine, requests: Iterable[EngineRequest], *, max_in_flight: int | None = None,
                   admit: Callable[[], bool] | None = None,
                   should_stop: Callable[[], bool] | None = None) -> Iterator[StreamResult]:
    """Add requests while fewer than `max_in_flight` (None: no bound) are in the engine and `admit()`
    allows (the consumer's own bound, e.g. a reorder window), step, and yield each result.

    `should_stop()` is polled before every step; when true the stream aborts what is in flight
    and ends (the consumer knows why). A consumer that wants results in input order keeps them."""
    assert max_in_flight is None or max_in_flight >= 1
    in_flight: dict[str, EngineRequest] = {}
    source = iter(requests)
    is_exhausted = False
    try:
        while True:
            while not is_exhausted and (max_in_flight is None or len(in_flight) < max_in_flight):
                # The consumer's bound holds only while something is in flight: with nothing running,
                # refusing more would wait forever.
                if in_flight and admit is not None and not admit():
                    break
                try:
                    req = next(source)
                except StopIteration:
                    is_exhausted = True
                    break
                if req.passthrough:
                    yield StreamResult(req)
                    continue
                try:
                    engine.add_request(req.request_id, req.prompt, req.params, pooling_task=req.pooling_task)
                except VBatchError as e:
                    yield StreamResult(req, error=e)
                    continue
                in_flight[req.request_id] = req
            if not in_flight:
                if is_exhausted:
                    return
                continue
            if should_stop is not None and should_stop():
                return
            finished = engine.step()
            if not finished and not engine.has_unfinished_requests():
                raise RuntimeError(f"the engine lost {len(in_flight)} requests it was given")
            for out in finished:
                yield StreamResult(in_flight.pop(out.request_id), output=out)
    finally:
        for request_id in list(in_flight):
            with contextlib.suppress(Exception):  # never hide the error that ended the stream
                engine.abort_request(request_id)
