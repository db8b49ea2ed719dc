"""What `LLM.encode/embed/classify/score` return (vLLM 0.33 shapes, REFERENCE 3), plus plain-dict forms.

    PoolingRequestOutput(request_id, outputs=PoolingOutput(data: Tensor), prompt_token_ids, ...)
    EmbeddingRequestOutput       .outputs.embedding: list[float]     (embed)
    ClassificationRequestOutput  .outputs.probs: list[float]         (classify)
    ScoringRequestOutput         .outputs.score: float               (score)

The engine's output processor builds PoolingRequestOutputs; the task-specific views are made
from them with `from_base` (the LLM methods do it), exactly as vLLM's are.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch

from .outputs import RequestMetrics

T = TypeVar("T")


@dataclass
class PoolingOutput:
    data: torch.Tensor           # embed: [D]; classify: [num_labels]; token_*: [num_tokens, D]; score: []


@dataclass
class PoolingRequestOutput(Generic[T]):
    request_id: str
    outputs: T
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    input_cost: int | None = None     # a tensor prompt's cost (Prithvi: patches); None: its token count

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids) if self.input_cost is None else self.input_cost


@dataclass
class EmbeddingOutput:
    embedding: list[float]

    @classmethod
    def from_base(cls, output: PoolingOutput) -> "EmbeddingOutput":
        data = output.data
        if data.ndim != 1:
            raise ValueError(f"an embedding is one vector; this output has shape {tuple(data.shape)}")
        return cls(data.float().tolist())

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class ClassificationOutput:
    probs: list[float]

    @classmethod
    def from_base(cls, output: PoolingOutput) -> "ClassificationOutput":
        data = output.data
        if data.ndim != 1:
            raise ValueError(f"class probabilities are one vector; this output has shape {tuple(data.shape)}")
        return cls(data.float().tolist())

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ScoringOutput:
    score: float

    @classmethod
    def from_base(cls, output: PoolingOutput) -> "ScoringOutput":
        data = output.data
        if data.numel() != 1:
            raise ValueError(f"a score is one number; this output has shape {tuple(data.shape)}")
        return cls(float(data.reshape(())))


def _view(cls: type, cls_output: type, base: PoolingRequestOutput) -> Any:
    return cls(request_id=base.request_id, outputs=cls_output.from_base(base.outputs),
                                prompt_token_ids=base.prompt_token_ids, finished=base.finished,
                                prompt=base.prompt, num_cached_tokens=base.num_cached_tokens,
                                metrics=base.metrics, error=base.error, extra=base.extra)


class EmbeddingRequestOutput(PoolingRequestOutput[EmbeddingOutput]):
    @classmethod
    def from_base(cls, base: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return _view(cls, EmbeddingOutput, base)


class ClassificationRequestOutput(PoolingRequestOutput[ClassificationOutput]):
    @classmethod
    def from_base(cls, base: PoolingRequestOutput) -> "ClassificationRequestOutput":
        return _view(cls, ClassificationOutput, base)


class ScoringRequestOutput(PoolingRequestOutput[ScoringOutput]):
    @classmethod
    def from_base(cls, base: PoolingRequestOutput) -> "ScoringRequestOutput":
        return _view(cls, ScoringOutput, base)
