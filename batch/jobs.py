"""How a batch record becomes an engine request: one job per command (`vbatch run`, `vbatch embed`).

Called by the batch runner (batch/runner.py) for every good record. A job returns the request's
prompt, params and pooling task; a VBatchError it raises becomes that record's error result.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from ..engine.pooling_params import PoolingParams
from .record import BatchRecord


class BatchLLM(Protocol):
    """What the batch runner needs of `vbatch.LLM` (test doubles implement the same)."""

    def get_default_sampling_params(self) -> Any: ...
    def preprocess_chat(self, messages: list[dict[str, Any]], *, chat_template: str | None = None,
                        add_generation_prompt: bool = True, continue_final_message: bool = False) -> dict[str, Any]: ...
    def stream(self, requests, *, max_in_flight=None, admit=None, should_stop=None): ...
    @property
    def stats(self) -> Any: ...     # engine/llm_engine.EngineStats


class BatchJob(Protocol):
    def requests_for(self, record: BatchRecord) -> list[tuple[Any, Any, str | None]]:
        """(prompt, params, pooling_task) of each engine request one good record becomes (usually one)."""


class GenerateJob:
    """`vbatch run`: sampling params by precedence record > command line > the model's generation_config;
    chat records through the chat template."""

    def __init__(self, llm: BatchLLM, defaults: dict[str, Any] | None = None, chat_template: str | None = None) -> None:
        self.llm, self.defaults, self.chat_template = llm, dict(defaults or {}), chat_template
        self.base = llm.get_default_sampling_params()

    def requests_for(self, record: BatchRecord) -> list[tuple[Any, Any, str | None]]:
        params = self.base.replace(**{**self.defaults, **record.sampling_overrides})
        if record.kind == "messages":
            # {"prompt", "prompt_token_ids"}: ids without a second BOS (the template holds it)
            prompt = self.llm.preprocess_chat(list(record.messages or []), chat_template=self.chat_template,
                                              add_generation_prompt=True, continue_final_message=False)
        else:
            prompt = record.engine_prompt()
        return [(prompt, params, None)]


@dataclass(frozen=True)
class PoolingJob:
    """`vbatch embed` (task embed) and `vbatch encode` (any pooling task): one pooling request per
    input (PoolingParams from the command line, a record's own `dimensions` / `normalize` /
    `truncate_prompt_tokens` on top)."""

    params: PoolingParams = PoolingParams()
    task: str = "embed"

    def requests_for(self, record: BatchRecord) -> list[tuple[Any, Any, str | None]]:
        params = self.params.replace(**record.pooling_overrides) if record.pooling_overrides else self.params
        return [(prompt, params, self.task) for prompt in record.engine_prompts()]
