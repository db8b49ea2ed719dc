"""What `LLM.generate/chat` return (vLLM 0.33 shapes, REFERENCE 1.4), plus their plain-dict form.

Built by the output processor from RequestUpdates; `to_dict()` is the record the CLI writes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated (or prompt) position: token id -> Logprob (the chosen token and the top-k).
PositionLogprobs = dict[int, Logprob]


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None       # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None   # the stop string or token id that fired; None for EOS

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready record; logprob dicts become lists of {token_id, logprob, rank, token}.

        Built field by field (not `dataclasses.asdict`, which deep-copies every list and was
        most of the writer's CPU time on a 200k-record run)."""
        m = self.metrics
        return {
            "request_id": self.request_id,
            "prompt": self.prompt,
            "prompt_token_ids": self.prompt_token_ids,
            "prompt_logprobs": (None if self.prompt_logprobs is None
                                else [None if p is None else _position_list(p) for p in self.prompt_logprobs]),
            "outputs": [_completion_dict(o) for o in self.outputs],
            "finished": self.finished,
            "metrics": None if m is None else {f: getattr(m, f) for f in _METRIC_FIELDS},
            "num_cached_tokens": self.num_cached_tokens,
            "error": self.error,
            "extra": self.extra,
        }


_METRIC_FIELDS = ("arrival_time", "first_scheduled_time", "first_token_time", "last_token_time",
                  "finished_time", "num_generation_tokens", "num_preemptions")


def _position_list(pos: PositionLogprobs) -> list[dict[str, Any]]:
    return [{"token_id": t, "logprob": lp.logprob, "rank": lp.rank, "token": lp.decoded_token}
            for t, lp in pos.items()]


def _completion_dict(o: CompletionOutput) -> dict[str, Any]:
    return {
        "index": o.index, "text": o.text, "token_ids": o.token_ids, "cumulative_logprob": o.cumulative_logprob,
        "logprobs": None if o.logprobs is None else [_position_list(p) for p in o.logprobs],
        "finish_reason": o.finish_reason, "stop_reason": o.stop_reason,
    }

