"""OutputProcessor: turns RequestUpdates into RequestOutputs (text, logprobs, n > 1 fan-in) and
pooling requests' updates into PoolingRequestOutputs.

Called by LLMEngine after every step. Owns the per-request output state (detokenizer, text,
logprob lists), in its own tables by request id; the scheduler owns the tokens and progress. A stop string found here ends a
request: the processor returns its id so the engine tells the scheduler to finish it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .detokenizer import IncrementalDetokenizer
from .outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
from .pooling_outputs import PoolingOutput, PoolingRequestOutput
from .request import Request
from .scheduler_output import Logprobs, RequestUpdate


@dataclass
class _ChildState:
    request: Request
    detokenizer: IncrementalDetokenizer
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _ParentState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_ChildState]
    prompt_logprobs: list[PositionLogprobs | None] | None
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


@dataclass
class _PoolingState:
    """A pooling request (never fanned out): one update, with its finish, carries the result."""

    request_id: str
    prompt: str | None
    request: Request
    metrics: RequestMetrics
    extra: dict[str, Any] = field(default_factory=dict)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _ParentState | _PoolingState] = {}
        self._child_to_parent: dict[str, tuple[str, int]] = {}

    def add_request(self, request_id: str, prompt: str | None, children: list[Request],
                    extra: dict[str, Any] | None = None) -> None:
        assert request_id not in self._parents, request_id   # the engine refuses duplicates first
        first = children[0]
        if first.is_pooling:
            assert len(children) == 1
            self._parents[request_id] = _PoolingState(request_id, prompt, first,
                                                      RequestMetrics(arrival_time=first.arrival_time), extra or {})
            self._child_to_parent[first.request_id] = (request_id, 0)
            return
        sp = first.sampling_params
        states = [_ChildState(c, IncrementalDetokenizer(self.tokenizer, c.prompt_token_ids, c.sampling_params),
                              [] if sp.logprobs is not None else None,
                              0.0 if sp.logprobs is not None else None) for c in children]
        self._parents[request_id] = _ParentState(
            request_id, prompt, list(first.prompt_token_ids), states,
            [None] if sp.prompt_logprobs is not None else None,
            RequestMetrics(arrival_time=first.arrival_time), extra=extra or {})
        for i, c in enumerate(children):
            self._child_to_parent[c.request_id] = (request_id, i)

    @property
    def num_unfinished(self) -> int:
        return len(self._parents)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._parents

    def child_ids(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        if parent is None:
            return []
        if isinstance(parent, _PoolingState):
            return [parent.request.request_id]
        return [c.request.request_id for c in parent.children]

    def process(self, updates: list[RequestUpdate]) -> tuple[list[RequestOutput | PoolingRequestOutput], list[str]]:
        """Returns (finished outputs, child request ids a stop string finished)."""
        finished_parents: list[str] = []
        stop_string_ids: list[str] = []
        pooled: list[PoolingRequestOutput] = []
        for u in updates:
            parent_id, idx = self._child_to_parent[u.request_id]
            parent = self._parents[parent_id]
            if isinstance(parent, _PoolingState):
                if u.finish_reason is not None:
                    pooled.append(self._finish_pooling(parent_id, u.pooler_output, None))
                continue
            child = parent.children[idx]
            parent.num_cached_tokens = max(parent.num_cached_tokens, u.num_cached_tokens)
            if u.new_prompt_logprobs is not None and parent.prompt_logprobs is not None:
                self._add_prompt_logprobs(parent, u.new_prompt_logprobs)
            if u.new_token_ids:
                if u.new_logprobs is not None and child.logprobs is not None:
                    self._add_logprobs(child, u.new_logprobs)
                # A "stop" finish from the scheduler always means a stop token id (or EOS) ended it.
                stop_str = child.detokenizer.update(u.new_token_ids, stop_terminated=u.finish_reason == "stop")
                if stop_str is not None:
                    # A stop string wins over a "length" finish in the same step (vLLM does the same).
                    child.finish_reason, child.stop_reason = "stop", stop_str
                    if u.finish_reason is None:
                        stop_string_ids.append(u.request_id)
            if u.finish_reason is not None and child.finish_reason is None:
                child.finish_reason, child.stop_reason = u.finish_reason, u.stop_reason
            if child.finish_reason is not None and parent.finished and parent_id not in finished_parents:
                finished_parents.append(parent_id)
        return [self._finish(pid) for pid in finished_parents] + pooled, stop_string_ids

    def abort(self, parent_id: str, reason: str = "abort") -> RequestOutput | PoolingRequestOutput | None:
        parent = self._parents.get(parent_id)
        if parent is None:
            return None
        if isinstance(parent, _PoolingState):
            return self._finish_pooling(parent_id, None, reason)
        for c in parent.children:
            if c.finish_reason is None:
                c.finish_reason = reason
        return self._finish(parent_id)

    # ------------------------------------------------------------------ helpers
    def _decode(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _positions(self, lp: Logprobs) -> list[PositionLogprobs]:
        out = []
        for ids, vals, rank in zip(lp.token_ids, lp.logprobs, lp.ranks):
            pos: PositionLogprobs = {}
            for j, (t, v) in enumerate(zip(ids, vals)):
                if t not in pos:   # the chosen token may also be in the top-k: keep its own entry
                    pos[t] = Logprob(v, rank if j == 0 else j, self._decode(t))
            out.append(pos)
        return out

    def _add_logprobs(self, child: _ChildState, lp: Logprobs) -> None:
        for pos, ids, vals in zip(self._positions(lp), lp.token_ids, lp.logprobs):
            child.logprobs.append(pos)
            child.cumulative_logprob += vals[0]

    def _add_prompt_logprobs(self, parent: _ParentState, lp: Logprobs) -> None:
        have = len(parent.prompt_logprobs)          # entries for prompt tokens 0..have-1
        for k, pos in enumerate(self._positions(lp)):
            if lp.start_position + k == have:       # recompute after preemption repeats positions
                parent.prompt_logprobs.append(pos)
                have += 1

    def _finish_pooling(self, parent_id: str, data: Any, error: str | None) -> PoolingRequestOutput:
        state = self._parents.pop(parent_id)
        self._child_to_parent.pop(state.request.request_id, None)
        return _pooling_output(state, data, error)

    def _finish(self, parent_id: str) -> RequestOutput:
        parent = self._parents.pop(parent_id)
        now = time.monotonic()
        m = parent.metrics
        outputs = []
        for i, c in enumerate(parent.children):
            self._child_to_parent.pop(c.request.request_id, None)
            r = c.request
            m.first_scheduled_time = _min(m.first_scheduled_time, r.first_scheduled_time)
            m.first_token_time = _min(m.first_token_time, r.first_token_time)
            m.last_token_time = max(filter(None, (m.last_token_time, r.last_token_time)), default=None)
            m.num_generation_tokens += r.num_output_tokens
            m.num_preemptions += r.num_preemptions
            outputs.append(CompletionOutput(
                index=r.index, text=c.detokenizer.output_text, token_ids=list(r.output_token_ids),
                cumulative_logprob=c.cumulative_logprob, logprobs=c.logprobs,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        m.finished_time = now
        return RequestOutput(
            request_id=parent_id, prompt=parent.prompt, prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=parent.prompt_logprobs, outputs=outputs, finished=True, metrics=m,
            num_cached_tokens=max(parent.num_cached_tokens, 0), extra=parent.extra)


def _pooling_output(state: _PoolingState, data: Any, error: str | None) -> PoolingRequestOutput:
    import torch  # the output carries the pooler's tensor

    r, m = state.request, state.metrics
    m.first_scheduled_time = r.first_scheduled_time
    m.finished_time = time.monotonic()
    return PoolingRequestOutput(
        request_id=state.request_id, outputs=PoolingOutput(data if data is not None else torch.empty(0)),
        prompt_token_ids=list(r.prompt_token_ids), finished=True, prompt=state.prompt,
        num_cached_tokens=max(r.num_cached_tokens, 0), metrics=m, error=error, extra=state.extra,
        input_cost=r.input_cost)


def _min(a: float | None, b: float | None) -> float | None:
    vals = [x for x in (a, b) if x is not None]
    return min(vals) if vals else None
