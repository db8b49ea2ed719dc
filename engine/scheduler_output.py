"""The typed hand-offs of one engine step: scheduler -> runner -> scheduler.

`step = schedule() -> runner.execute_model(SchedulerOutput) -> update_from_output(ModelRunnerOutput)`.
Frozen contracts; they reference live Request objects (one process), which the runner only reads.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .request import Request


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int                  # tokens computed this step: all_token_ids[computed:computed+new]
    block_ids: tuple[int, ...]           # the request's whole block table after allocation

    @property
    def num_computed_tokens(self) -> int:
        # NOTE: the scheduler advances request.num_computed_tokens only in update_from_output,
        # so while the runner runs, the request still holds the value before this step.
        return self.request.num_computed_tokens

    @property
    def will_sample(self) -> bool:
        """True when this step reaches the end of the known tokens, so the next token is sampled."""
        r = self.request
        return r.num_computed_tokens + self.num_new_tokens >= r.num_tokens and not r.is_pooling


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledRequest, ...]
    num_scheduled_tokens: int
    preempted_request_ids: tuple[str, ...] = ()
    # Requests finished since the last step (the runner drops any state it keeps for them).
    finished_request_ids: tuple[str, ...] = ()
    # Forwards this step runs (> 1: a multi-step decode, engine/scheduler.py): every request feeds its
    # one token, then the tokens it samples (plainly: greedy or temperature only); each returns up to
    # num_steps tokens.
    num_steps: int = 1

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class Logprobs:
    """Top-k logprobs of one or more positions of one request (numpy-free plain lists).

    token_ids[i][0] is the sampled (or, for prompts, the actual next) token, followed by the
    top-k; logprobs[i] matches token_ids[i]; ranks[i] is the rank of token_ids[i][0] (1 = best).
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]
    # Prompt logprobs only: the prompt index of the token that position 0 scores (chunks and
    # recompute after preemption arrive with their own start, so the collector can drop repeats).
    start_position: int = 0


@dataclass(frozen=True)
class ModelRunnerOutput:
    req_ids: tuple[str, ...]                          # same order as SchedulerOutput.scheduled
    sampled_token_ids: tuple[tuple[int, ...], ...]    # empty tuple: no token this step (partial prefill)
    logprobs: tuple[Logprobs | None, ...] = ()        # per request; for its sampled token(s)
    prompt_logprobs: tuple[Logprobs | None, ...] = () # per request; for the prompt positions of this chunk
    pooler_outputs: tuple[object | None, ...] = ()    # per request: the pooler's tensor (pooling requests)
    extra: dict = field(default_factory=dict)         # timings and counters for metrics


@dataclass(frozen=True)
class RequestUpdate:
    """One request's news after a step (scheduler.update_from_output -> output processor)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: Logprobs | None = None
    new_prompt_logprobs: Logprobs | None = None
    finish_reason: str | None = None       # "stop" | "length" | "abort" | "error"; None: still running
    stop_reason: int | str | None = None   # the stop token id that fired (None for EOS)
    num_cached_tokens: int = 0
    pooler_output: object | None = None   # a pooling request's result (a tensor), with its finish

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
