"""LLM: the offline Python API users know from vLLM (`generate`, `chat`, `encode`, `embed`, `classify`, `score`).

    llm = LLM("smollm2-135m-instruct")
    outs = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                    SamplingParams(temperature=0, max_tokens=32))
    emb = LLM("all-minilm-l6-v2").embed(["A man is eating food."])[0].outputs.embedding

A thin layer: it builds an EngineConfig and runs every prompt through the engine's streaming
results API (`stream`, also what the batch runner consumes), returning outputs in input order.
Every prompt is checked before any runs: one bad prompt raises and nothing is left queued.
"""
from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

from .config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, parse_bytes
from .errors import ConfigError, InputError, UnsupportedTaskError
from .llm_engine import LLMEngine, PromptInput
from .models.catalogue import DEFAULT_MODEL
from .output_stream import EngineRequest
from .outputs import RequestOutput
from .pooling_outputs import (ClassificationRequestOutput, EmbeddingRequestOutput, PoolingOutput,
                              PoolingRequestOutput, ScoringRequestOutput)
from .pooling_params import PoolingParams
from .sampling_params import SamplingParams
from .tokenizer import apply_chat_template

Conversation = list[dict[str, Any]]


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, *, tokenizer: str | None = None, dtype: str = "auto",
                 weight_dtype: str = "auto", quantization: str | None = None, max_model_len: int | None = None,
                 max_num_seqs: int = 256, num_scheduler_steps: int | None = None,
                 max_num_batched_tokens: int | None = None, enable_prefix_caching: bool = True,
                 enable_chunked_prefill: bool = True, kv_cache_memory: int | str | None = None,
                 kv_cache_dtype: str = "auto",
                 block_size: int = 16, seed: int = 0, generation_config: str = "auto", device: str = "auto",
                 gpu_memory_utilization: float = 0.9, num_gpu_blocks_override: int | None = None,
                 num_threads: int | None = None, io_processor_plugin: str | None = None,
                 io_processor_options: dict[str, Any] | None = None, quiet: bool = False) -> None:
        model_cfg = ModelConfig(model=str(model), tokenizer=tokenizer, dtype=dtype, weight_dtype=weight_dtype,
                                quantization=quantization, max_model_len=max_model_len,
                                seed=seed, generation_config=generation_config, device=device,
                                num_threads=num_threads)
        cache_cfg = CacheConfig(block_size=block_size, kv_cache_dtype=kv_cache_dtype,
                                kv_cache_memory=None if kv_cache_memory is None else parse_bytes(kv_cache_memory),
                                gpu_memory_utilization=gpu_memory_utilization,
                                enable_prefix_caching=enable_prefix_caching,
                                num_gpu_blocks_override=num_gpu_blocks_override)
        sched_cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                    enable_chunked_prefill=enable_chunked_prefill,
                                    max_model_len=max_model_len or 1, num_scheduler_steps=num_scheduler_steps)
        self.engine = LLMEngine(EngineConfig(model_cfg, cache_cfg, sched_cfg), quiet=quiet)
        self._counter = 0
        self.io_processor = self._load_plugin(str(model), io_processor_plugin, io_processor_options or {})

    def _load_plugin(self, model: str, explicit: str | None, options: dict[str, Any]):
        """The IO processor plugin: `io_processor_plugin`, else the model config's key (io_plugins/registry.py)."""
        from ..io_plugins.interface import PluginConfig
        from ..io_plugins.registry import build_plugin, select_plugin

        name = select_plugin(explicit, self.engine.hf_config)
        if name is None:
            if options:
                raise ConfigError("io_processor_options", "given, but no IO processor plugin is chosen")
            return None
        return build_plugin(name, PluginConfig(model=model, model_path=self.engine.model_path,
                                               hf_config=self.engine.hf_config, options=dict(options)))

    # ------------------------------------------------------------------ info
    def get_tokenizer(self):
        return self.engine.tokenizer

    @property
    def is_pooling_model(self) -> bool:
        """True for encoder-only pooling models (embed/classify/score), False for generation models."""
        return self.engine.is_pooling_model

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

    # ------------------------------------------------------------------ pooling
    def encode(self, prompts: PromptInput | Sequence[PromptInput],
               pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
               pooling_task: str | None = None, truncate_prompt_tokens: int | None = None,
               ) -> list[PoolingRequestOutput]:
        """Run a pooling model; `.outputs.data` is the pooler's tensor. The task comes from
        `pooling_task` or the params (vLLM requires one; embed/classify/score set it for you)."""
        prompts = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        # With a plugin, payloads go through it; prompts already in the engine's form go straight in.
        engine_form = all(isinstance(p, dict) and ("multi_modal_data" in p or "prompt_token_ids" in p)
                          for p in prompts)
        if self.io_processor is not None and pooling_task in (None, "plugin") and not engine_form:
            return self._encode_with_plugin(prompts, pooling_params)
        params = self._pooling_params_list(pooling_params, len(prompts), truncate_prompt_tokens)
        info = self.engine.pooling_info
        if pooling_task is None and info is not None and len(info.supported_tasks) == 1:
            pooling_task = info.supported_tasks[0]       # a model with one task (a tile model's "plugin")
        if pooling_task is None and any(p.task is None for p in params):
            raise UnsupportedTaskError("LLM.encode needs pooling_task (embed, classify, score, token_embed, ...)",
                                       hint="or use LLM.embed / LLM.classify / LLM.score")
        return self._run(self._tokenize_texts(prompts, params), params, pooling_task=pooling_task)

    def _tokenize_texts(self, prompts: list, params: list[PoolingParams]) -> list:
        """Text prompts tokenised in batches (the fast tokenizer's batch call is ~7x faster than one
        text at a time), cut as the engine would cut them; other prompts pass unchanged."""
        limits: dict[int | None, list[int]] = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            if isinstance(prompt, str) or (isinstance(prompt, dict) and set(prompt) == {"prompt"}
                                           and isinstance(prompt["prompt"], str)):
                limit = self.engine.max_model_len if p.truncate_prompt_tokens == -1 else p.truncate_prompt_tokens
                limits.setdefault(limit, []).append(i)
        out = list(prompts)
        tok = self.engine.tokenizer
        if tok is None:           # a tensor model: the engine names what a prompt must be
            return out
        for limit, rows in limits.items():
            texts = [prompts[i] if isinstance(prompts[i], str) else prompts[i]["prompt"] for i in rows]
            cut = {} if limit is None else {"truncation": True, "max_length": limit}
            for i, text, ids in zip(rows, texts, tok(texts, **cut)["input_ids"]):
                out[i] = {"prompt": text, "prompt_token_ids": list(ids)}
        return out

    def _encode_with_plugin(self, payloads: list, pooling_params: PoolingParams | None) -> list[PoolingRequestOutput]:
        """Every payload through the plugin and one engine run (io_plugins/driver.py); each output's
        `.outputs` is what the plugin's post_process returned, in input order. A payload that fails
        raises an InputError naming it (the others' requests are aborted)."""
        from ..io_plugins.driver import PluginInput, run_plugin

        done: dict[str, Any] = {}
        inputs = [PluginInput(str(i), data) for i, data in enumerate(payloads)]
        with contextlib.closing(run_plugin(self, self.io_processor, inputs, pooling_params=pooling_params)) as results:
            for r in results:
                if r.error is not None:
                    raise InputError(f"input {r.key}: {r.error}", field="plugin")
                done[r.key] = r
        return [PoolingRequestOutput(request_id=i.key, outputs=done[i.key].output, prompt_token_ids=[])
                for i in inputs]

    def embed(self, prompts: PromptInput | Sequence[PromptInput],
              pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
              truncate_prompt_tokens: int | None = None) -> list[EmbeddingRequestOutput]:
        """One vector per prompt (`.outputs.embedding`), pooled as the model folder says, L2-normalised."""
        outs = self.encode(prompts, pooling_params, pooling_task="embed", truncate_prompt_tokens=truncate_prompt_tokens)
        return [EmbeddingRequestOutput.from_base(o) for o in outs]

    def classify(self, prompts: PromptInput | Sequence[PromptInput],
                 pooling_params: PoolingParams | Sequence[PoolingParams] | None = None, *,
                 truncate_prompt_tokens: int | None = None) -> list[ClassificationRequestOutput]:
        """Class probabilities per prompt (`.outputs.probs`), from a classification model."""
        outs = self.encode(prompts, pooling_params, pooling_task="classify",
                           truncate_prompt_tokens=truncate_prompt_tokens)
        return [ClassificationRequestOutput.from_base(o) for o in outs]

    def score(self, data_1: str | Sequence[str], data_2: str | Sequence[str], *,
              pooling_params: PoolingParams | None = None,
              truncate_prompt_tokens: int | None = None) -> list[ScoringRequestOutput]:
        """A score per (data_1[i], data_2[i]) pair; one text on either side pairs with every text on
        the other. A cross-encoder (one-label classifier) reads each pair together; an embedding
        model scores the cosine similarity of the two embeddings (vLLM's rules)."""
        left = [data_1] if isinstance(data_1, str) else list(data_1)
        right = [data_2] if isinstance(data_2, str) else list(data_2)
        if len(left) == 1 and len(right) > 1:
            left = left * len(right)
        if len(right) == 1 and len(left) > 1:
            right = right * len(left)
        if len(left) != len(right):
            raise ConfigError("data_2", f"has {len(right)} texts for {len(left)} in data_1; give one, or as many")
        info = self.engine.pooling_info
        if info is not None and "score" in info.supported_tasks:
            tok = self.engine.tokenizer
            pairs = []
            for a, b in zip(left, right):
                enc = tok(a, b, truncation=truncate_prompt_tokens is not None,
                          max_length=None if truncate_prompt_tokens in (None, -1) else truncate_prompt_tokens)
                pair = {"prompt_token_ids": list(enc["input_ids"])}
                if "token_type_ids" in enc:
                    pair["token_type_ids"] = list(enc["token_type_ids"])
                pairs.append(pair)
            outs = self.encode(pairs, pooling_params, pooling_task="score")
            return [ScoringRequestOutput.from_base(o) for o in outs]
        import torch
        embs = self.embed(left + right, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens)
        scored = []
        for i, (a, b) in enumerate(zip(embs[:len(left)], embs[len(left):])):
            cos = torch.nn.functional.cosine_similarity(torch.tensor(a.outputs.embedding),
                                                        torch.tensor(b.outputs.embedding), dim=0)
            base = PoolingRequestOutput(request_id=str(i), outputs=PoolingOutput(cos),
                                        prompt_token_ids=a.prompt_token_ids + b.prompt_token_ids)
            scored.append(ScoringRequestOutput.from_base(base))
        return scored

    # ------------------------------------------------------------------ streaming
    def stream(self, requests, *, max_in_flight: int | None = None, admit=None, should_stop=None):
        """The engine's streaming results API (engine/output_stream.py): EngineRequests in, StreamResults
        out as they finish. What `vbatch run` / `vbatch embed` and the plugin driver consume."""
        return self.engine.stream(requests, max_in_flight=max_in_flight, admit=admit, should_stop=should_stop)

    @property
    def stats(self):
        """The engine's running counters (engine/llm_engine.EngineStats)."""
        return self.engine.stats

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

    def _pooling_params_list(self, pooling_params, n: int, truncate: int | None) -> list[PoolingParams]:
        if pooling_params is None or isinstance(pooling_params, PoolingParams):
            params = [pooling_params or PoolingParams()] * n
        else:
            params = list(pooling_params)
            if len(params) != n:
                raise ConfigError("pooling_params", f"got {len(params)} PoolingParams for {n} prompts; "
                                  "pass one object or one per prompt")
        if truncate is not None:
            params = [p.replace(truncate_prompt_tokens=truncate) for p in params]
        return params

    def _run(self, prompts: list[PromptInput], params: list, *, pooling_task: str | None = None) -> list:
        """Every prompt through one engine stream; outputs in input order. All are added before the
        first step (no in-flight bound), so a bad prompt raises before anything runs."""
        requests = []
        for prompt, p in zip(prompts, params):
            requests.append(EngineRequest(str(self._counter), prompt, p, pooling_task=pooling_task))
            self._counter += 1
        done: dict[str, RequestOutput | PoolingRequestOutput] = {}
        with contextlib.closing(self.engine.stream(requests)) as results:
            for result in results:
                if result.error is not None:
                    raise result.error        # closing the stream aborts everything it queued
                done[result.request.request_id] = result.output
        return [done[r.request_id] for r in requests]
