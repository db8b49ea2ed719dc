"""The records a batch reader yields: BatchRecord (good) or RecordError (bad), plus OpenAIMeta.

Readers (`vbatch.batch.readers`) build them; `vbatch validate` prints RecordErrors; the runner
turns BatchRecords into engine requests and RecordErrors into error output records. Frozen:
a record travels through the reorder window untouched.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

RecordKind = Literal["prompt", "messages", "token_ids", "tensors"]


@dataclass(frozen=True)
class OpenAIMeta:
    """Where an OpenAI Batch line came from; the OpenAI writer echoes it in the response."""

    custom_id: str
    url: str                      # "/v1/chat/completions" | "/v1/completions"
    model: str | None = None      # body.model, echoed in the response body
    top_logprobs: int | None = None  # how many alternatives the response lists per token
    encoding_format: str | None = None  # /v1/embeddings: "float" | "base64"


@dataclass(frozen=True)
class BatchRecord:
    id: str
    line: int                     # 1-based line (JSONL) or 0-based row (Parquet)
    kind: RecordKind
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt_token_ids: list[int] | None = None
    sampling_overrides: dict[str, Any] = field(default_factory=dict)
    pooling_overrides: dict[str, Any] = field(default_factory=dict)   # embed records: PoolingParams fields
    openai: OpenAIMeta | None = None
    inputs: tuple[Any, ...] | None = None   # several inputs in one record (an embeddings line): texts or id lists
    multi_modal_data: dict[str, Any] | None = None   # kind "tensors": named tensors (nested lists) for the model

    def engine_prompt(self) -> dict[str, Any]:
        """The `add_request` prompt for kinds that need no chat template."""
        assert self.kind != "messages", "messages need the chat template first"
        if self.kind == "token_ids":
            return {"prompt_token_ids": list(self.prompt_token_ids or [])}
        if self.kind == "tensors":
            return {"multi_modal_data": dict(self.multi_modal_data or {})}
        return {"prompt": self.prompt}

    def engine_prompts(self) -> list[dict[str, Any]]:
        """One `add_request` prompt per input (a record with `inputs` fans out, in order)."""
        if self.inputs is None:
            return [self.engine_prompt()]
        return [{"prompt_token_ids": list(x)} if isinstance(x, list) else {"prompt": x} for x in self.inputs]


@dataclass(frozen=True)
class RecordError:
    """One problem with one record; `str()` is the `file:line: field: message` line."""

    id: str | None
    line: int
    field: str
    message: str
    file: str = "-"
    custom_id: str | None = None  # OpenAI input: lets the error line keep its custom_id

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.field}: {self.message}"
