"""Scheduler: decides each step which requests compute how many tokens, and applies the results.

Called by the engine loop: `schedule() -> runner.execute_model(output) -> update_from_output()`.
It owns the waiting queue, the running list and the BlockManager (engine/block_manager.py),
and it is the only code that mutates a Request's status, tokens and `num_computed_tokens`.
It never touches tensors; stop *strings* are the detokenizer's job (it calls finish_requests).

vLLM v1 shape: no prefill or decode phases. A request's tokens still to compute are
`all_token_ids[num_computed_tokens:]`: a whole prompt, a prompt chunk, one decode token or
a recompute after preemption all follow from that one counter.

Step (schedule):
  1. Running requests, oldest first, each take min(tokens to compute, budget left) new tokens
     (a decode takes 1; a chunked prefill its next chunk). When blocks run out, the newest
     running request is preempted (blocks freed, counter reset, front of the waiting queue)
     until the allocation fits or the request preempted itself.
  2. Only if nobody was preempted: waiting requests are admitted in FIFO order while
     `max_num_seqs` and the budget allow, starting after their prefix-cache hit. Without
     chunked prefill, a request that does not fit the budget left waits (and so does
     everyone behind it); admission also stops at the first failed allocation.

NOTE (the counter moves in update_from_output): schedule() leaves `num_computed_tokens`
as it was before the step (except that an admitted request starts at its prefix-cache hit,
which is already in the cache), so the runner reads "tokens already in the cache" from the
request itself while it computes `num_new_tokens` more; update_from_output then advances it.

NOTE (pooling): a pooling request is never chunked (the pooler needs the whole prompt's
hidden states in one pass); check_request rejects one longer than the step budget. Models
without a KV cache (encoders) get `NoKVCache` in place of the block manager: nothing to
allocate, so only the token budget and `max_num_seqs` bound a step.

NOTE (prompt length): a generation prompt needs room for at least one output token
(prompt < max_model_len); a pooling prompt may fill it (prompt <= max_model_len). One rule,
here: the engine asks `check_request` before it registers a request anywhere.

NOTE (multi-step decodes): when no waiting request has room (nobody waits, or max_num_seqs are
running) and every running request decodes one token that it samples plainly
(SamplingParams.is_plain, min_tokens met), a step may run up to `num_scheduler_steps` forwards (SchedulerOutput.num_steps), the model feeding back what it samples
with the random draws single steps would make (engine/model_runner.py), ending with the first
forward in which a request samples a stop token. Slots for every step are allocated up front; the
steps never pass a request's max_tokens or max_model_len, and update_from_output applies the tokens
one by one with the stop checks of single steps, so the outputs are the same. Only where the runner
runs such steps (`decode_steps_rows`: how many requests it takes).
Priorities are not used yet: the order is first come, first served.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable

from .block_manager import BlockManager, NoKVCache
from .config import CacheConfig, SchedulerConfig
from .errors import InputError
from .request import Request, RequestStatus
from .scheduler_output import ModelRunnerOutput, RequestUpdate, ScheduledRequest, SchedulerOutput


class Scheduler:
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 *, needs_kv_cache: bool = True, decode_steps_rows: int = 0) -> None:
        self.config = scheduler_config
        # Multi-step decodes (module NOTE): steps per schedule, for at most this many requests.
        self.num_decode_steps = scheduler_config.num_scheduler_steps or 1
        self.decode_steps_rows = decode_steps_rows
        self.block_manager = (BlockManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
                              if needs_kv_cache else NoKVCache())
        self.requests: dict[str, Request] = {}       # unfinished requests by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []              # oldest first: preemption takes the tail
        self._finished_since_last_step: list[str] = []
        self.num_preemptions_total = 0

    # ------------------------------------------------------------------ requests in and out
    def check_request(self, request: Request) -> None:
        """Raise the InputError that add_request would, changing nothing."""
        if request.request_id in self.requests:
            raise InputError(f"request id {request.request_id!r} is already running", field="request_id")
        n, max_len = request.num_prompt_tokens, self.config.max_model_len
        if n == 0:
            raise InputError("the prompt is empty (0 tokens)", field="prompt")
        if request.is_pooling and n > max_len:
            raise InputError(f"the prompt is {n} tokens; max_model_len is {max_len}", field="prompt",
                             hint="shorten the input, truncate it (truncate_prompt_tokens) or raise --max-model-len")
        if not request.is_pooling and n >= max_len:
            raise InputError(f"the prompt is {n} tokens; max_model_len is {max_len} "
                             f"(prompt + at least one output token)", field="prompt",
                             hint="shorten the prompt or raise --max-model-len")
        if request.is_pooling and n > self.config.max_num_batched_tokens:
            raise InputError(f"the prompt is {n} tokens, more than max_num_batched_tokens="
                             f"{self.config.max_num_batched_tokens} (pooling prompts run in one step)",
                             field="prompt", hint="raise --max-num-batched-tokens")

    def add_request(self, request: Request) -> None:
        self.check_request(request)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: str | Iterable[str], status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string); unknown or finished ids are ignored."""
        assert status.is_finished
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._release(request)

    def _release(self, request: Request) -> None:
        self.block_manager.free(request)
        del self.requests[request.request_id]
        self._finished_since_last_step.append(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self.requests)

    # ------------------------------------------------------------------ stats
    @property
    def kv_cache_usage(self) -> float:
        return self.block_manager.usage

    @property
    def prefix_cache_queries(self) -> int:
        """Tokens of requests admitted with a prefix-cache lookup."""
        return self.block_manager.num_queried_tokens

    @property
    def prefix_cache_hits(self) -> int:
        """Tokens of those that were found in the cache."""
        return self.block_manager.num_hit_tokens

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> SchedulerOutput:
        steps = self._decode_steps()
        if steps > 1:
            output = SchedulerOutput(scheduled=tuple(self._scheduled(r, 1) for r in self.running),
                                     num_scheduled_tokens=len(self.running),
                                     finished_request_ids=tuple(self._finished_since_last_step), num_steps=steps)
            self._finished_since_last_step = []
            return output
        budget = self.config.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted_ids: list[str] = []
        budget = self._schedule_running(scheduled, preempted_ids, budget)
        if not preempted_ids:
            budget = self._schedule_waiting(scheduled, budget)
        output = SchedulerOutput(
            scheduled=tuple(scheduled),
            num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            preempted_request_ids=tuple(preempted_ids),
            finished_request_ids=tuple(self._finished_since_last_step),
        )
        self._finished_since_last_step = []
        return output

    def _decode_steps(self) -> int:
        """Forwards for a multi-step decode of every running request (module NOTE), their slots
        allocated; 1: a step as usual."""
        steps = self.num_decode_steps
        rows = len(self.running)
        # NOTE: a waiting request that has no room (max_num_seqs running) waits no longer for this:
        # the steps end on the forward that finishes a request, by a stop token or by length.
        if (steps < 2 or not rows or rows > self.decode_steps_rows or rows > self.config.max_num_batched_tokens
                or (self.waiting and rows < self.config.max_num_seqs)):
            return 1
        max_len = self.config.max_model_len
        for request in self.running:
            params = request.sampling_params
            if (request.num_tokens_to_compute != 1 or not params.is_plain
                    or request.num_output_tokens < params.min_tokens):
                return 1
            # never past the step whose token ends the request by length (_check_stop)
            steps = min(steps, request.max_tokens - request.num_output_tokens, max_len - request.num_tokens)
        blocks = self.block_manager.block_size
        needed = sum(max(0, -(-(r.num_computed_tokens + steps) // blocks)
                            - len(self.block_manager.get_block_ids(r.request_id))) for r in self.running)
        if steps < 2 or needed > self.block_manager.num_free_blocks:
            return 1
        for request in self.running:
            allocated = self.block_manager.allocate_slots(request, steps)
            assert allocated
        return steps

    def _schedule_running(self, scheduled: list[ScheduledRequest], preempted_ids: list[str], budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens_to_compute, budget,
                          self.config.max_model_len - request.num_computed_tokens)
            if num_new > 0 and self._allocate_or_preempt(request, num_new, preempted_ids):
                scheduled.append(self._scheduled(request, num_new))
                budget -= num_new
            i += 1
        return budget

    def _allocate_or_preempt(self, request: Request, num_new: int, preempted_ids: list[str]) -> bool:
        """Allocate, preempting from the tail of `running` until it fits; False if `request` itself went."""
        while not self.block_manager.allocate_slots(request, num_new):
            victim = self.running.pop()
            self._preempt(victim)
            preempted_ids.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.block_manager.free(request, finished=False)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)

    def _schedule_waiting(self, scheduled: list[ScheduledRequest], budget: int) -> int:
        chunking = self.config.enable_chunked_prefill
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hit_blocks, num_hit = self.block_manager.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if num_new > budget and (not chunking or request.is_pooling):
                break
            num_new = min(num_new, budget)
            if not self.block_manager.allocate_slots(request, num_new, hit_blocks, num_hit):
                break
            self.waiting.popleft()
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            scheduled.append(self._scheduled(request, num_new))
            budget -= num_new
        return budget

    def _scheduled(self, request: Request, num_new: int) -> ScheduledRequest:
        return ScheduledRequest(request, num_new, self.block_manager.get_block_ids(request.request_id))

    # ------------------------------------------------------------------ results
    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[RequestUpdate]:
        """Advance counters, append sampled tokens, check stops, free finished requests."""
        row_of = {request_id: i for i, request_id in enumerate(runner_output.req_ids)}
        updates: list[RequestUpdate] = []
        any_finished = False
        for item in scheduler_output.scheduled:
            request = item.request
            if request.is_finished:       # finished from outside since schedule()
                continue
            assert request.status == RequestStatus.RUNNING, request
            row = row_of.get(request.request_id)
            sampled = _at(runner_output.sampled_token_ids, row) or ()
            # a multi-step decode computed the fed token and every sampled one but the last
            request.num_computed_tokens += item.num_new_tokens if scheduler_output.num_steps == 1 else len(sampled)
            new_token_ids = self._append_tokens(request, sampled)
            if request.is_pooling and request.num_computed_tokens >= request.num_prompt_tokens:
                request.status = RequestStatus.FINISHED_STOPPED
            logprobs = _at(runner_output.logprobs, row)
            prompt_logprobs = _at(runner_output.prompt_logprobs, row)
            if request.is_finished:
                any_finished = True
                self._release(request)
            if new_token_ids or logprobs is not None or prompt_logprobs is not None or request.is_finished:
                updates.append(RequestUpdate(
                    request_id=request.request_id,
                    new_token_ids=new_token_ids,
                    new_logprobs=logprobs,
                    new_prompt_logprobs=prompt_logprobs,
                    finish_reason=request.status.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    pooler_output=_at(runner_output.pooler_outputs, row) if request.is_pooling else None,
                ))
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        return updates

    def _append_tokens(self, request: Request, token_ids: Iterable[int]) -> tuple[int, ...]:
        """Append sampled tokens one by one, stopping at the first that finishes the request."""
        appended: list[int] = []
        for token_id in token_ids:
            request.append_output_token(token_id)
            appended.append(token_id)
            if self._check_stop(request, token_id):
                break
        if appended:
            now = time.monotonic()
            if request.first_token_time is None:
                request.first_token_time = now
            request.last_token_time = now
        return tuple(appended)

    def _check_stop(self, request: Request, token_id: int) -> bool:
        params = request.sampling_params
        is_stop_token = token_id in params.all_stop_token_ids or token_id in params.stop_token_ids
        if is_stop_token and request.num_output_tokens >= params.min_tokens:
            request.status = RequestStatus.FINISHED_STOPPED
            # A stop_token_ids hit names the token; EOS (generation_config or tokenizer) is None.
            request.stop_reason = token_id if token_id in params.stop_token_ids else None
            return True
        if request.num_output_tokens >= request.max_tokens or request.num_tokens >= self.config.max_model_len:
            request.status = RequestStatus.FINISHED_LENGTH
            return True
        return False


def _at(values: tuple, row: int | None):
    """values[row], or None when the runner left that field empty or the request out."""
    if row is None or row >= len(values):
        return None
    return values[row]
