"""Request: one sequence's progress through the engine (the only mutable per-request state).

Written by the Scheduler only (status, tokens, `num_computed_tokens`, timings); read by the block
manager, the model runner, the sampler and the output processor, each of which keeps its own
per-request state in its own tables keyed by request id (block hashes, seeded generators,
detokenizers), never on the request. One progress counter,
`num_computed_tokens`, covers prefill, chunked prefill, prefix-cache hits, decode and
recompute after preemption: the tokens still to compute are `all_token_ids[num_computed_tokens:]`.

A user request with `n > 1` becomes n Requests ("children") sharing one `parent_id`; they
share the prompt's KV blocks through the prefix cache (`cache_salt` keeps them private
when prefix caching is off).

Kinds of request: generation (`sampling_params` set) or pooling (`pooling_params` set: the prompt
runs once, whole, and the request finishes with the pooler's output instead of sampled tokens).
Inputs beyond token ids travel in `model_inputs` (token_type_ids of a sentence pair; a tile's
pixel tensor for a model without tokens, whose scheduling cost the model declares as
`input_cost`, e.g. its patch count). `mm_features`: multimodal items (encoder inputs, placeholder
positions, content hashes); their hashes join the block hashes as extra keys.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from .sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything after this line is finished.
    FINISHED_STOPPED = 10
    FINISHED_LENGTH = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True)
class MultiModalFeature:
    """One multimodal item of a prompt (filled by the multimodal pipeline, later)."""

    modality: str           # "image" | "audio" | ...
    identifier: str         # content hash or user uuid; joins the prefix-cache block hash
    offset: int             # first placeholder token position in the prompt
    length: int             # number of placeholder tokens
    data: Any = None        # processed encoder inputs


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams | None   # generation: already resolve()d by the engine; None: pooling
    max_tokens: int                          # effective: min(params.max_tokens, max_model_len - prompt); pooling: 0
    arrival_time: float = field(default_factory=time.monotonic)
    parent_id: str | None = None             # the user request (n > 1 fans out into children)
    index: int = 0                           # child index within the parent (CompletionOutput.index)
    cache_salt: str | None = None            # None: shares the global prefix cache
    pooling_params: Any = None               # engine/pooling_params.PoolingParams (verified): a pooling request
    model_inputs: dict[str, Any] = field(default_factory=dict)   # inputs besides token ids, by name
    input_cost: int | None = None            # tensor-only prompts: scheduling cost in tokens (None: the token count)
    mm_features: list[MultiModalFeature] = field(default_factory=list)
    priority: int = 0

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)     # prompt + output, appended in place
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1               # prefix-cache hit on first schedule (-1: not yet)
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    # ------------------------------------------------------------------ derived counts
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids) if self.input_cost is None else self.input_cost

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids) if self.input_cost is None else self.input_cost + len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def is_pooling(self) -> bool:
        return self.pooling_params is not None

    @property
    def needs_prompt_logprobs(self) -> bool:
        return not self.is_pooling and self.sampling_params.prompt_logprobs is not None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:  # short: requests show up in scheduler debug logs
        return (f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
                f"out={self.num_output_tokens}, computed={self.num_computed_tokens})")
