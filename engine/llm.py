"""LLM: the offline Python API users know from vLLM (`generate`, `chat`, defaults from generation_config).

    llm = LLM("smollm2-135m-instruct")
    outs = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0, max_tokens=32))

A thin layer: it builds an EngineConfig, adds every prompt to the LLMEngine and steps the
engine until all are done, returning outputs in input order.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from .config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, parse_bytes
from .errors import ConfigError
from .llm_engine import LLMEngine, PromptInput
from .models.catalogue import DEFAULT_MODEL
from .outputs import RequestOutput
from .sampling_params import SamplingParams
from .tokenizer import apply_chat_template

Conversation = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, *, tokenizer: str | None = None, dtype: str = "auto",
                 weight_dtype: str = "auto", max_model_len: int | None = None, max_num_seqs: int = 256,
                 max_num_batched_tokens: int | None = None, enable_prefix_caching: bool = True,
                 enable_chunked_prefill: bool = True, kv_cache_memory: int | str | None = None,
                 kv_cache_dtype: str = "auto",
                 block_size: int = 16, seed: int = 0, generation_config: str = "auto", device: str = "auto",
                 gpu_memory_utilization: float = 0.9, num_gpu_blocks_override: int | None = None,
                 num_threads: int | None = None, quiet: bool = False) -> None:
        model_cfg = ModelConfig(model=str(model), tokenizer=tokenizer, dtype=dtype, weight_dtype=weight_dtype,
                                max_model_len=max_model_len,
                                seed=seed, generation_config=generation_config, device=device,
                                num_threads=num_threads)
        cache_cfg = CacheConfig(block_size=block_size, kv_cache_dtype=kv_cache_dtype,
                                kv_cache_memory=None if kv_cache_memory is None else parse_bytes(kv_cache_memory),
                                gpu_memory_utilization=gpu_memory_utilization,
                                enable_prefix_caching=enable_prefix_caching,
                                num_gpu_blocks_override=num_gpu_blocks_override)
        sched_cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                    enable_chunked_prefill=enable_chunked_prefill,
                                    max_model_len=max_model_len or 1)
        self.engine = LLMEngine(EngineConfig(model_cfg, cache_cfg, sched_cfg), quiet=quiet)
        self._counter = 0

    # ------------------------------------------------------------------ info
    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """generation_config defaults (REFERENCE 1.2) when the model has any, else vLLM's neutral ones."""
        overrides = self.engine.generation_defaults.sampling_overrides
        return SamplingParams(**overrides) if overrides else SamplingParams()

    # ------------------------------------------------------------------ generation
    def generate(self, prompts: PromptInput | Sequence[PromptInput],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs in input order. Never applies a chat template."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = self._params_list(sampling_params, len(prompts))
        return self._run(list(prompts), params)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: dict[str, Any] | None = None,
             ) -> list[RequestOutput]:
        """Apply the chat template to each conversation (one list of messages, or a list of them), then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        prompts = [self.preprocess_chat(c, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
                                        continue_final_message=continue_final_message,
                                        chat_template_kwargs=chat_template_kwargs) for c in conversations]
        params = self._params_list(sampling_params, len(prompts))
        return self._run(prompts, params)

    def preprocess_chat(self, messages: Conversation, *, chat_template: str | None = None,
                        add_generation_prompt: bool = True, continue_final_message: bool = False,
                        chat_template_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
        """The prompt a conversation becomes: {'prompt': text, 'prompt_token_ids': ids}.

        Token ids come from the rendered text without adding special tokens again (the template
        already holds BOS or role markers)."""
        text = apply_chat_template(self.engine.tokenizer, messages, chat_template=chat_template,
                                   add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message,
                                   **(chat_template_kwargs or {}))
        ids = self.engine.tokenizer.encode(text, add_special_tokens=False)
        return {"prompt": text, "prompt_token_ids": ids}

    # ------------------------------------------------------------------ internals
    def _params_list(self, sampling_params, n: int) -> list[SamplingParams]:
        if sampling_params is None:
            return [self.get_default_sampling_params()] * n
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        params = list(sampling_params)
        if len(params) != n:
            raise ConfigError("sampling_params", f"got {len(params)} SamplingParams for {n} prompts; "
                              "pass one object or one per prompt")
        return params

    def _run(self, prompts: list[PromptInput], params: list[SamplingParams]) -> list[RequestOutput]:
        ids: list[str] = []
        try:
            for prompt, sp in zip(prompts, params):
                rid = str(self._counter)
                self._counter += 1
                self.engine.add_request(rid, prompt, sp)
                ids.append(rid)
        except Exception:
            for rid in ids:          # nothing half-queued survives a bad prompt
                self.engine.abort_request(rid)
            raise
        done: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                done[out.request_id] = out
        return [done[r] for r in ids]
