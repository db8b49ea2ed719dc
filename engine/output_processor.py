"""OutputProcessor: turns RequestUpdates into RequestOutputs (text, logprobs, n > 1 fan-in).

Called by LLMEngine after every step. Owns the per-request output state (detokenizer, text,
logprob lists); the scheduler owns the tokens and progress. A stop string found here ends a
request: the processor returns its id so the engine tells the scheduler to finish it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from .detokenizer import IncrementalDetokenizer
from .outputs import CompletionOutput, Logprob, PositionLogprobs, RequestMetrics, RequestOutput
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


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _ParentState] = {}
        self._child_to_parent: dict[str, tuple[str, int]] = {}

    def add_request(self, request_id: str, prompt: str | None, children: list[Request],
                    extra: dict[str, Any] | None = None) -> None:
        first = children[0]
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

    def process(self, updates: list[RequestUpdate]) -> tuple[list[RequestOutput], list[str]]:
        """Returns (finished RequestOutputs, child request ids a stop string finished)."""
        finished_parents: list[str] = []
        stop_string_ids: list[str] = []
        for u in updates:
            parent_id, idx = self._child_to_parent[u.request_id]
            parent = self._parents[parent_id]
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
        return [self._finish(pid) for pid in finished_parents], stop_string_ids

    def abort(self, parent_id: str, reason: str = "abort") -> RequestOutput | None:
        parent = self._parents.get(parent_id)
        if parent is None:
            return None
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


def _min(a: float | None, b: float | None) -> float | None:
    vals = [x for x in (a, b) if x is not None]
    return min(vals) if vals else None
