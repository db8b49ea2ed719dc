"""LLMEngine: the step loop. Owns the scheduler, the model runner and the output processor.

    add_request(...)  ->  tokenise, resolve params, fan n > 1 out into child Requests
    step()            ->  schedule -> execute_model -> update_from_output -> outputs

Used by `LLM` (generate/chat run it to completion) and by `vbatch run` (which keeps a bounded
number of requests in flight and calls step() itself).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any

import torch
from transformers import AutoConfig

from .config import EngineConfig
from .device import resolve_device, resolve_dtype
from .errors import ConfigError, InputError, ModelLoadError
from .generation_config import load_generation_defaults
from .model_runner import ModelRunner
from .models.resolve import resolve_model
from .output_processor import OutputProcessor
from .outputs import RequestOutput
from .request import Request, RequestStatus
from .sampling_params import SamplingParams
from .scheduler import Scheduler
from .tokenizer import load_tokenizer

logger = logging.getLogger("vbatch.engine")

PromptInput = str | dict[str, Any]


@dataclass
class EngineStats:
    """Running counters since the engine started (the CLI summary takes differences)."""

    num_requests: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    num_steps: int = 0
    step_seconds: float = 0.0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0      # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0         # of those, tokens found


class LLMEngine:
    def __init__(self, config: EngineConfig, *, quiet: bool = False) -> None:
        config.validate()
        self.quiet = quiet
        t0 = time.perf_counter()
        resolved = resolve_model(config.model.model, quiet=quiet)
        self.model_path = resolved.path
        try:
            self.hf_config = AutoConfig.from_pretrained(str(self.model_path), trust_remote_code=False)
        except (OSError, ValueError) as e:
            raise ModelLoadError(f"cannot read the model config in {self.model_path}: {e}") from e
        self.tokenizer = load_tokenizer(config.model.tokenizer or self.model_path)
        self.generation_defaults = load_generation_defaults(self.model_path, config.model.generation_config)
        config = self._fill_model_limits(config)
        self.config = config
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device)
        torch.manual_seed(config.model.seed)
        self.runner = ModelRunner(config, self.hf_config, self.model_path, self.device, self.dtype)
        self.runner.load_model()
        num_blocks = self.runner.initialize_kv_cache()
        self._check_kv_capacity(num_blocks, config)
        self.scheduler = Scheduler(config.scheduler, config.cache, num_blocks)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.vocab_size = int(self.hf_config.vocab_size)
        self.eos_token_ids = self._eos_token_ids()
        self.stats = EngineStats()
        self.startup_seconds = time.perf_counter() - t0
        logger.info("engine ready in %.1fs: %s on %s/%s, %d KV blocks of %d tokens", self.startup_seconds,
                    config.model.model, self.device, self.dtype, num_blocks, config.cache.block_size)

    # ------------------------------------------------------------------ set-up helpers
    def _fill_model_limits(self, config: EngineConfig) -> EngineConfig:
        model_max = int(getattr(self.hf_config, "max_position_embeddings", 2048) or 2048)
        max_len = config.model.max_model_len or model_max
        if max_len > model_max:
            raise ConfigError("max_model_len", f"{max_len} exceeds the model's max_position_embeddings ({model_max})")
        sched = config.scheduler
        sched = replace(sched, max_model_len=max_len)
        sched = replace(sched, max_num_batched_tokens=sched.token_budget)
        return config.replace(model=replace(config.model, max_model_len=max_len), scheduler=sched).validate()

    @staticmethod
    def _check_kv_capacity(num_blocks: int, config: EngineConfig) -> None:
        """One sequence of max_model_len tokens must fit, or a long request would preempt itself forever."""
        bs = config.cache.block_size
        need = -(-config.scheduler.max_model_len // bs)
        if num_blocks - 1 < need:     # block 0 is the reserved padding block
            raise ConfigError("kv_cache_memory",
                              f"{num_blocks - 1} usable KV blocks of {bs} tokens hold {(num_blocks - 1) * bs} tokens, "
                              f"less than one sequence of max_model_len={config.scheduler.max_model_len}",
                              hint="raise --kv-cache-memory or lower --max-model-len")

    def _eos_token_ids(self) -> tuple[int, ...]:
        ids = list(self.generation_defaults.eos_token_ids)
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in ids:
            ids.append(int(self.tokenizer.eos_token_id))
        return tuple(ids)

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                    raise InputError("must be a list of integers", field="prompt_token_ids")
                bad = [t for t in ids if not 0 <= t < self.vocab_size]
                if bad:
                    raise InputError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})",
                                     field="prompt_token_ids")
                return prompt.get("prompt"), list(ids)
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        raise InputError(f"a prompt must be a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}, "
                         f"got {type(prompt).__name__}", field="prompt")

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams,
                    *, extra: dict[str, Any] | None = None) -> None:
        text, ids = self.tokenize(prompt)
        if not ids:
            raise InputError("the prompt is empty (0 tokens)", field="prompt")
        if len(ids) >= self.max_model_len:
            raise InputError(f"the prompt is {len(ids)} tokens; max_model_len is {self.max_model_len} "
                             f"(prompt + at least one output token)", field="prompt",
                             hint="shorten the prompt or raise --max-model-len")
        params = params.resolve(eos_token_ids=self.eos_token_ids, vocab_size=self.vocab_size, tokenizer=self.tokenizer)
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        now = time.monotonic()
        # n > 1: children share the prompt's blocks through the prefix cache; without prefix
        # caching a salt private to this request lets only the siblings share.
        salt = None if self.config.cache.enable_prefix_caching or params.n == 1 else f"n:{request_id}"
        children = []
        for i in range(params.n):
            child_params = params if params.seed is None or i == 0 else params.replace(seed=params.seed + i)
            child_id = request_id if params.n == 1 else f"{i}_{request_id}"
            children.append(Request(request_id=child_id, prompt_token_ids=ids, sampling_params=child_params,
                                    max_tokens=max_tokens, arrival_time=now, parent_id=request_id, index=i,
                                    cache_salt=salt))
        self.output_processor.add_request(request_id, text, children, extra)
        for c in children:
            self.scheduler.add_request(c)
        self.stats.num_requests += 1
        self.stats.prompt_tokens += len(ids)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        parent = self.output_processor._parents.get(request_id)
        if parent is None:
            return None
        self.scheduler.finish_requests([c.request.request_id for c in parent.children], RequestStatus.FINISHED_ABORTED)
        return self.output_processor.abort(request_id)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.num_unfinished > 0

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.num_unfinished

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests that finished in it."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if self.scheduler.has_unfinished_requests():
                raise RuntimeError("the scheduler has unfinished requests but scheduled nothing (KV cache too small?)")
            return []
        runner_out = self.runner.execute_model(sched)
        updates = self.scheduler.update_from_output(sched, runner_out)
        finished, stop_ids = self.output_processor.process(updates)
        if stop_ids:
            self.scheduler.finish_requests(stop_ids, RequestStatus.FINISHED_STOPPED)
        self.stats.generation_tokens += sum(len(u.new_token_ids) for u in updates)
        st = self.stats
        st.num_steps += 1
        st.step_seconds += time.perf_counter() - t0
        st.num_preemptions = self.scheduler.num_preemptions_total
        st.prefix_cache_queries = self.scheduler.prefix_cache_queries
        st.prefix_cache_hits = self.scheduler.prefix_cache_hits
        return finished
