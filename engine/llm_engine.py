"""LLMEngine: the step loop. Owns the scheduler, the model runner and the output processor.

    add_request(...)  ->  tokenise, check params, one Request (pooling) or n child Requests (generation)
    step()            ->  schedule -> execute_model -> update_from_output -> outputs
    stream(...)       ->  the streaming results API over both (engine/output_stream.py)

Two kinds of model behind one loop: generation models (the decoder runner on the paged KV cache,
engine/model_runner.py) and encoder-only pooling models (engine/pooling_runner.py, no KV cache);
the model class decides (`models/registry.py`). Generation requests carry SamplingParams, pooling
requests PoolingParams; asking a model for the other kind is an UnsupportedTaskError.

Used by `LLM` and, through `stream`, by `vbatch run` / `vbatch embed` and the plugin driver.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from .config import EngineConfig
from .device import resolve_device, resolve_dtype
from .errors import ConfigError, InputError, UnsupportedTaskError
from .generation_config import load_generation_defaults
from .model_runner import ModelRunner
from .models.hf_config import load_hf_config
from .models.pooling_config import read_pooler_config
from .models.registry import get_model_class, is_pooling_model
from .models.resolve import resolve_model
from .output_processor import OutputProcessor
from .output_stream import EngineRequest, StreamResult, stream_outputs
from .outputs import RequestOutput
from .pooling_outputs import PoolingRequestOutput
from .pooling_params import PoolingParams
from .pooling_runner import PoolingModelRunner
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


# Forwards per multi-step decode where the model runs them natively (SchedulerConfig.num_scheduler_steps
# None). NOTE: 8 leaves one round of Python (about 1 ms on CPU) per 8 forwards of a batch-1 decode
# (about 10 ms each); 16 measured the same. Nothing is wasted when a request stops: the steps end there.
DEFAULT_DECODE_STEPS = 8

# A tensor model's default max_model_len (its largest input's cost): a 1,440 x 1,440 Prithvi tile.
TENSOR_DEFAULT_MAX_LEN = 8192


class LLMEngine:
    def __init__(self, config: EngineConfig, *, quiet: bool = False) -> None:
        config.validate()
        self.quiet = quiet
        t0 = time.perf_counter()
        resolved = resolve_model(config.model.model, quiet=quiet)
        self.model_path = resolved.path
        self.hf_config = load_hf_config(self.model_path)
        model_cls = get_model_class(self.hf_config)
        # A model that takes tensors (a Prithvi tile) has no tokenizer unless one is named.
        takes_tokens = getattr(model_cls, "input_kind", "tokens") == "tokens"
        self.tokenizer = load_tokenizer(config.model.tokenizer or self.model_path) \
            if takes_tokens or config.model.tokenizer else None
        self.is_pooling_model = is_pooling_model(self.hf_config)
        self.generation_defaults = load_generation_defaults(self.model_path, config.model.generation_config)
        config = self._fill_model_limits(config)
        self.config = config
        self.device = resolve_device(config.model.device)
        self.dtype = resolve_dtype(config.model.dtype, self.device,
                                   exact_on_cpu=getattr(get_model_class(self.hf_config), "exact_on_cpu", False),
                                   quantization=config.model.quantization)
        torch.manual_seed(config.model.seed)
        runner_cls = PoolingModelRunner if self.is_pooling_model else ModelRunner
        runner = runner_cls(config, self.hf_config, self.model_path, self.device, self.dtype)
        runner.load_model()
        self._assemble(config, runner, self.tokenizer, vocab_size=int(getattr(self.hf_config, "vocab_size", 0) or 0),
                       eos_token_ids=self._eos_token_ids(), model_name=resolved.name)
        self.startup_seconds = time.perf_counter() - t0
        logger.info("engine ready in %.1fs: %s on %s/%s, %s", self.startup_seconds, config.model.model,
                    self.device, self.dtype, f"{self.num_kv_blocks} KV blocks of {config.cache.block_size} tokens"
                    if runner.needs_kv_cache else "pooling model, no KV cache")

    def _assemble(self, config: EngineConfig, runner: Any, tokenizer: Any, *, vocab_size: int,
                  eos_token_ids: tuple[int, ...], model_name: str) -> None:
        """Everything around a loaded model runner: its KV cache, the scheduler, the output processor."""
        self.config, self.runner, self.tokenizer = config, runner, tokenizer
        self.is_pooling_model = runner.runs_pooling
        num_blocks = runner.initialize_kv_cache()
        if runner.needs_kv_cache:
            self._check_kv_capacity(num_blocks, config)
        self.num_kv_blocks = num_blocks
        rows_of = getattr(runner, "decode_steps_rows", None)
        rows = rows_of() if rows_of is not None and runner.needs_kv_cache else 0
        steps = config.scheduler.num_scheduler_steps
        if steps is None or rows == 0:   # auto; or asked for where the model cannot run them
            if steps is not None and steps > 1:
                logger.warning("num_scheduler_steps=%d: this model and device run one step at a time", steps)
            config = replace(config, scheduler=replace(
                config.scheduler, num_scheduler_steps=DEFAULT_DECODE_STEPS if rows else 1))
            self.config = config
        self.scheduler = Scheduler(config.scheduler, config.cache, num_blocks, needs_kv_cache=runner.needs_kv_cache,
                                   decode_steps_rows=rows)
        self.pooling_info = runner.model_info(model_name) if runner.runs_pooling else None
        self.output_processor = OutputProcessor(tokenizer)
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.stats = EngineStats()

    @classmethod
    def with_runner(cls, config: EngineConfig, runner: Any, tokenizer: Any, *, vocab_size: int,
                    eos_token_ids: tuple[int, ...] = (), model_name: str = "model") -> "LLMEngine":
        """SEAM: an engine around a runner built elsewhere (`runs_pooling`, `needs_kv_cache`,
        `initialize_kv_cache()`, `execute_model()`, and `model_info(name)` for pooling; optionally
        `decode_steps_rows()`, the most requests its multi-step decodes take, absent: none). The engine
        tests drive the request kinds through it with a fake runner; a Ray actor may hand in its own."""
        engine = cls.__new__(cls)
        engine.quiet, engine.model_path, engine.hf_config = True, None, None
        engine.generation_defaults = None
        engine.device, engine.dtype = torch.device("cpu"), torch.float32
        engine._assemble(config.validate(), runner, tokenizer, vocab_size=vocab_size,
                         eos_token_ids=tuple(eos_token_ids), model_name=model_name)
        engine.startup_seconds = 0.0
        return engine

    # ------------------------------------------------------------------ set-up helpers
    def _fill_model_limits(self, config: EngineConfig) -> EngineConfig:
        cls = get_model_class(self.hf_config)
        # A tensor model's limit is its own (Prithvi: patches per tile; the position table interpolates).
        model_max = int(getattr(self.hf_config, "max_position_embeddings", 0) or getattr(cls, "max_input_cost", 0)
                        or 2048)
        default = model_max
        if getattr(cls, "input_kind", "tokens") == "tensors":
            default = min(model_max, TENSOR_DEFAULT_MAX_LEN)
        elif self.is_pooling_model:   # sentence-transformers folders say what length the model was trained for
            pooler = read_pooler_config(self.model_path, get_model_class(self.hf_config).default_pooling_type)
            default = min(model_max, pooler.max_seq_length or model_max)
        max_len = config.model.max_model_len or default
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
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if eos is not None and eos not in ids:
            ids.append(int(eos))
        return tuple(ids)

    @property
    def max_model_len(self) -> int:
        return self.config.scheduler.max_model_len

    # ------------------------------------------------------------------ requests
    def tokenize(self, prompt: PromptInput, *, max_length: int | None = None) -> tuple[str | None, list[int]]:
        """(text, token ids); `max_length` cuts a text's tokens the tokenizer's way (special tokens kept)."""
        cut = {} if max_length is None else {"truncation": True, "max_length": max_length}
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt, **cut)
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
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"], **cut)
        raise InputError(f"a prompt must be a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}, "
                         f"got {type(prompt).__name__}", field="prompt")

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams | PoolingParams,
                    *, extra: dict[str, Any] | None = None, pooling_task: str | None = None) -> None:
        """Queue one request. Every check runs before anything is registered: a refused request
        (InputError, SamplingParamsError, PoolingParamsError, UnsupportedTaskError) leaves no trace."""
        if request_id in self.output_processor:
            raise InputError(f"request id {request_id!r} is already running", field="request_id")
        if isinstance(params, PoolingParams):
            requests = self._pooling_request(request_id, prompt, params, pooling_task)
            text = prompt if isinstance(prompt, str) else (prompt.get("prompt") if isinstance(prompt, dict) else None)
        else:
            requests, text = self._generation_requests(request_id, prompt, params)
        for r in requests:
            self.scheduler.check_request(r)
        self.output_processor.add_request(request_id, text, requests, extra)
        for r in requests:
            self.scheduler.add_request(r)
        self.stats.num_requests += 1
        self.stats.prompt_tokens += requests[0].num_prompt_tokens

    def _generation_requests(self, request_id: str, prompt: PromptInput,
                             params: SamplingParams) -> tuple[list[Request], str | None]:
        if self.is_pooling_model:
            raise UnsupportedTaskError(f"{self.config.model.model} is a pooling model: it embeds or classifies, "
                                       "it does not generate", hint="use embed / encode / classify, or a generation model")
        if not isinstance(params, SamplingParams):
            raise InputError(f"params must be SamplingParams or PoolingParams, got {type(params).__name__}",
                             field="params")
        text, ids = self.tokenize(prompt)
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
        return children, text

    def _pooling_request(self, request_id: str, prompt: PromptInput, params: PoolingParams,
                         pooling_task: str | None) -> list[Request]:
        if not self.is_pooling_model:
            raise UnsupportedTaskError(f"{self.config.model.model} is a generation model; pooling (embed, classify, "
                                       "score) needs a pooling model", hint="e.g. --model all-minilm-l6-v2")
        task = pooling_task or params.task
        if task is None:
            raise UnsupportedTaskError("a pooling request needs a task (embed, classify, score, token_embed, ...)",
                                       hint="use LLM.embed / classify / score, or encode(..., pooling_task=...)")
        params = params.verify(task, self.pooling_info)
        if self.runner_takes_tensors:
            return [self._tensor_request(request_id, prompt, params)]
        if isinstance(prompt, dict) and "multi_modal_data" in prompt:
            raise InputError(f"{self.config.model.model} reads text (token ids), not multi_modal_data",
                             field="multi_modal_data")
        limit = params.truncate_prompt_tokens
        limit = self.max_model_len if limit == -1 else limit
        _, ids = self.tokenize(prompt, max_length=limit)
        inputs: dict[str, Any] = {}
        types = prompt.get("token_type_ids") if isinstance(prompt, dict) else None
        if types is not None:
            if len(types) != len(ids) or not all(t in (0, 1) for t in types):
                raise InputError("must be 0/1 per token, as many as the prompt's tokens", field="token_type_ids")
            inputs["token_type_ids"] = list(types)
        if limit is not None and len(ids) > limit:        # token ids given: keep the last `limit` (vLLM's rule)
            ids = ids[-limit:]
            if "token_type_ids" in inputs:
                inputs["token_type_ids"] = inputs["token_type_ids"][-limit:]
        return [Request(request_id=request_id, prompt_token_ids=ids, sampling_params=None, max_tokens=0,
                        parent_id=request_id, pooling_params=params, model_inputs=inputs)]

    def _tensor_request(self, request_id: str, prompt: PromptInput, params: PoolingParams) -> Request:
        """A prompt of named tensors (vLLM's `{"multi_modal_data": {"pixel_values": ...}}`) for a model
        without tokens: the model checks them and declares their scheduling cost (Prithvi: patches)."""
        if not (isinstance(prompt, dict) and isinstance(prompt.get("multi_modal_data"), dict)):
            got = "text" if isinstance(prompt, str) or (isinstance(prompt, dict) and "prompt" in prompt) \
                else type(prompt).__name__
            raise InputError(f"{self.config.model.model} takes tensors: a prompt must be "
                             f"{{'multi_modal_data': {{name: tensor, ...}}}}, got {got}", field="multi_modal_data")
        if params.truncate_prompt_tokens is not None:
            raise InputError("does not apply to a tensor prompt", field="truncate_prompt_tokens")
        inputs, cost = self.runner.check_tensor_inputs(prompt["multi_modal_data"])
        return Request(request_id=request_id, prompt_token_ids=[], sampling_params=None, max_tokens=0,
                       parent_id=request_id, pooling_params=params, model_inputs=inputs, input_cost=cost)

    @property
    def runner_takes_tensors(self) -> bool:
        return getattr(self.runner, "takes_tensors", False)

    def abort_request(self, request_id: str) -> RequestOutput | PoolingRequestOutput | None:
        child_ids = self.output_processor.child_ids(request_id)
        if not child_ids:
            return None
        self.scheduler.finish_requests(child_ids, RequestStatus.FINISHED_ABORTED)
        return self.output_processor.abort(request_id)

    def stream(self, requests: Iterable[EngineRequest], *, max_in_flight: int | None = None,
               admit: Callable[[], bool] | None = None,
               should_stop: Callable[[], bool] | None = None) -> Iterator[StreamResult]:
        """The streaming results API (engine/output_stream.py) on this engine."""
        return stream_outputs(self, requests, max_in_flight=max_in_flight, admit=admit, should_stop=should_stop)

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.num_unfinished > 0

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.num_unfinished

    # ------------------------------------------------------------------ the loop
    def step(self) -> list[RequestOutput | PoolingRequestOutput]:
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
