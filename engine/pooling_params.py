"""PoolingParams: what a pooling request returns (vLLM 0.33 fields and rules, REFERENCE 3).

A request is generation (SamplingParams) or pooling (PoolingParams); a pooling request runs its
prompt once and finishes with the pooler's output instead of sampled tokens. Frozen: one object
may serve many requests. `__post_init__` checks each field alone (a PoolingParamsError naming
it); `verify(task, model)` checks them against the task and the model and fills the defaults the
task implies (embed: normalize; classify: the activation), returning a new object.

Tasks (vLLM's PoolingTask):
    embed           one vector per prompt (the model's pooling: mean / CLS / last token), L2-normalised
    classify        class probabilities per prompt (softmax; sigmoid for one label)
    score           one number per prompt pair (a cross-encoder's logit through its activation)
    token_embed     one vector per prompt token
    token_classify  class probabilities per prompt token
    plugin          whatever an IO processor plugin's model returns (io_plugins/), left as the model gives it
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from .errors import PoolingParamsError

PoolingTask = Literal["embed", "classify", "score", "token_embed", "token_classify", "plugin"]
POOLING_TASKS: tuple[str, ...] = get_args(PoolingTask)

# The fields each task may set (others are an error: vLLM rejects e.g. `dimensions` for classify).
_TASK_FIELDS: dict[str, frozenset[str]] = {
    "embed": frozenset({"dimensions", "normalize"}),
    "token_embed": frozenset({"dimensions", "normalize"}),
    "classify": frozenset({"use_activation"}),
    "score": frozenset({"use_activation"}),
    "token_classify": frozenset({"use_activation"}),
    "plugin": frozenset({"dimensions", "normalize", "use_activation"}),
}


@dataclass(frozen=True)
class PoolingModelInfo:
    """What `verify` needs to know about the model (the model class declares it)."""

    name: str
    supported_tasks: tuple[str, ...]
    hidden_size: int
    matryoshka_dimensions: tuple[int, ...] | None = None   # None: the model was not trained for truncation
    is_matryoshka: bool = False


@dataclass(frozen=True)
class PoolingParams:
    task: str | None = None
    """One of POOLING_TASKS; None: set by the API called (embed() -> "embed", ...)."""
    dimensions: int | None = None
    """embed: keep the first `dimensions` values (matryoshka models only), then normalise."""
    normalize: bool | None = None
    """embed: L2-normalise the vector (default True)."""
    use_activation: bool | None = None
    """classify / score: apply softmax (sigmoid for one label) to the logits (default True)."""
    truncate_prompt_tokens: int | None = None
    """Keep only the last k prompt tokens; -1: as many as max_model_len allows. None: a longer
    prompt is an error (vLLM's rule), never silently cut."""
    extra_kwargs: dict[str, Any] = field(default_factory=dict)
    """Free-form options an IO processor plugin's model reads."""

    def __post_init__(self) -> None:
        if self.task is not None and self.task not in POOLING_TASKS:
            raise PoolingParamsError("task", f"must be one of {', '.join(POOLING_TASKS)}, got {self.task!r}")
        if self.dimensions is not None and (not _is_int(self.dimensions) or self.dimensions < 1):
            raise PoolingParamsError("dimensions", f"must be an integer >= 1, got {self.dimensions!r}")
        for name in ("normalize", "use_activation"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, bool):
                raise PoolingParamsError(name, f"must be true or false, got {value!r}")
        t = self.truncate_prompt_tokens
        if t is not None and (not _is_int(t) or (t < 1 and t != -1)):
            raise PoolingParamsError("truncate_prompt_tokens", f"must be -1 or an integer >= 1, got {t!r}")
        if not isinstance(self.extra_kwargs, dict):
            raise PoolingParamsError("extra_kwargs", f"must be an object, got {type(self.extra_kwargs).__name__}")

    def replace(self, **changes: Any) -> "PoolingParams":
        return dataclasses.replace(self, **changes)

    def verify(self, task: str, model: PoolingModelInfo) -> "PoolingParams":
        """This request's params for `task` on `model`, defaults filled; an error names what does not fit."""
        if self.task is not None and self.task != task:
            raise PoolingParamsError("task", f"the params say {self.task!r} but the request is for {task!r}")
        if task not in model.supported_tasks:
            raise PoolingParamsError("task", f"{model.name} does not support {task!r}; it supports "
                                     f"{', '.join(model.supported_tasks) or 'no pooling task'}")
        allowed = _TASK_FIELDS[task]
        for name in ("dimensions", "normalize", "use_activation"):
            if getattr(self, name) is not None and name not in allowed:
                raise PoolingParamsError(name, f"is not a parameter of task {task!r} (it takes "
                                         f"{', '.join(sorted(allowed)) or 'none'})")
        if self.dimensions is not None:
            if not model.is_matryoshka:
                raise PoolingParamsError("dimensions", f"{model.name} does not support matryoshka representation; "
                                         "changing the output dimensions would give poor embeddings")
            if model.matryoshka_dimensions and self.dimensions not in model.matryoshka_dimensions:
                raise PoolingParamsError("dimensions", f"must be one of {list(model.matryoshka_dimensions)} "
                                         f"for {model.name}, got {self.dimensions}")
            if self.dimensions > model.hidden_size:
                raise PoolingParamsError("dimensions", f"must be <= the model's {model.hidden_size}, got {self.dimensions}")
        filled: dict[str, Any] = {"task": task}
        if task in ("embed", "token_embed") and self.normalize is None:
            filled["normalize"] = True
        if task in ("classify", "score", "token_classify") and self.use_activation is None:
            filled["use_activation"] = True
        return dataclasses.replace(self, **filled)

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if getattr(self, f.name) not in (None, {})}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "PoolingParams":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise PoolingParamsError(unknown[0], f"is not a PoolingParams field (fields: {', '.join(sorted(names))})")
        return cls(**data)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
