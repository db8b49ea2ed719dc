"""BatchResult: one input record's outcome, in input order; what the runner hands to a writer.

Exactly one of `record` (a good input record) / `input_error` (a RecordError) is set; a good
record then carries the engine's RequestOutput, or `error` when the engine refused it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .record import BatchRecord, RecordError


@dataclass(frozen=True)
class BatchResult:
    seq: int                               # 0-based position among the input's records
    record: BatchRecord | None = None
    input_error: RecordError | None = None
    output: Any = None                     # vbatch.engine.outputs.RequestOutput
    error: str | None = None               # why the engine did not run the record

    @property
    def id(self) -> str | None:
        return self.record.id if self.record is not None else (self.input_error.id if self.input_error else None)

    @property
    def custom_id(self) -> str | None:
        if self.record is not None and self.record.openai is not None:
            return self.record.openai.custom_id
        return self.input_error.custom_id if self.input_error is not None else None

    @property
    def error_message(self) -> str | None:
        """The record's error, from whichever stage failed (None when it succeeded)."""
        if self.input_error is not None:
            return str(self.input_error)
        if self.error is not None:
            return self.error
        return getattr(self.output, "error", None) if self.output is not None else "no output"

    @property
    def ok(self) -> bool:
        return self.error_message is None

    @property
    def outputs(self) -> list[Any]:
        """The engine outputs behind this record (several when the record fanned out into requests)."""
        if self.output is None:
            return []
        return list(self.output) if isinstance(self.output, list) else [self.output]

    @property
    def prompt_tokens(self) -> int:
        return sum(getattr(o, "num_prompt_tokens", None) or len(o.prompt_token_ids or []) for o in self.outputs)

    @property
    def generated_tokens(self) -> int:
        """Sampled tokens (generation outputs); 0 for pooling outputs, which generate nothing."""
        return sum(sum(len(c.token_ids) for c in o.outputs) for o in self.outputs if isinstance(o.outputs, list))

    @property
    def cached_tokens(self) -> int:
        return sum(int(o.num_cached_tokens or 0) for o in self.outputs)
