"""IOProcessor: what an IO processor plugin implements (the interface of seed 000 / vLLM's plugins).

A plugin turns a user's data (a GeoTIFF path, a base64 image, a JSON record) into engine prompts
for a pooling model, and the model's outputs for those prompts back into the user's output (a
flood-map GeoTIFF). Generic over its input and output types.

    parse_data(data) -> In                      validate the user's data (the engine validates nothing)
    merge_pooling_params(params) -> PoolingParams   the request's params merged with the plugin's (task "plugin")
    merge_sampling_params(params) -> SamplingParams
    pre_process(input, request_id, context=ctx) -> prompt | prompts (a list or any iterable, even lazy)
    post_process(outputs, request_id, context=ctx) -> Out      outputs in the order of the prompts
    pre_process_async / post_process_async      asyncio variants; post_process_async sorts by index first

NOTE (no per-request state on the plugin): one plugin object serves every input of a run, many
at once (the driver pre-processes input k+1 while input k's prompts run). Whatever post_process
needs from pre_process (a tile's georeference, its padding) goes into the `PluginContext` the driver
creates per input and hands to both calls, never onto `self`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from ..engine.pooling_outputs import PoolingRequestOutput
from ..engine.pooling_params import PoolingParams
from ..engine.sampling_params import SamplingParams

In = TypeVar("In")
Out = TypeVar("Out")


@dataclass(frozen=True)
class PluginConfig:
    """What a plugin may read about the run it serves (read-only)."""

    model: str                      # the --model value
    model_path: Any = None          # the resolved HF folder (pathlib.Path), None for tests without a model
    hf_config: Any = None           # the model's transformers config
    options: dict[str, Any] = field(default_factory=dict)   # plugin options from the command line / LLM(...)


@dataclass
class PluginContext:
    """Per-input state that travels from pre_process to post_process (the plugin's own, free-form)."""

    request_id: str
    state: dict[str, Any] = field(default_factory=dict)
    closers: list[Callable[[], None]] = field(default_factory=list)

    def add_closer(self, close: Callable[[], None]) -> None:
        """Run `close` when the input is done, whether it succeeded or failed (an open file, a temp dir)."""
        self.closers.append(close)

    def close(self) -> None:
        """Called once by the driver after post_process, or after the input failed."""
        while self.closers:
            self.closers.pop()()


class IOProcessor(ABC, Generic[In, Out]):
    name: ClassVar[str] = ""
    default_model: ClassVar[str | None] = None        # what `vbatch encode --plugin NAME` runs without --model
    input_suffixes: ClassVar[tuple[str, ...]] = ()    # the files `vbatch encode` picks from folders

    def __init__(self, config: PluginConfig) -> None:
        self.config = config

    def parse_data(self, data: object) -> In:
        """Validate `data`; raise a VBatchError (InputError) naming what is wrong."""
        raise NotImplementedError

    def merge_sampling_params(self, params: SamplingParams | None = None) -> SamplingParams:
        return params or SamplingParams()

    def merge_pooling_params(self, params: PoolingParams | None = None) -> PoolingParams:
        return params or PoolingParams(task="plugin")

    @abstractmethod
    def pre_process(self, prompt: In, request_id: str | None = None, *, context: PluginContext | None = None,
                    **kwargs: Any) -> Any | Iterable[Any]:
        """One engine prompt, or several (a list, or an iterator the driver consumes lazily)."""

    async def pre_process_async(self, prompt: In, request_id: str | None = None, *,
                                context: PluginContext | None = None, **kwargs: Any) -> Any | Iterable[Any]:
        return self.pre_process(prompt, request_id, context=context, **kwargs)

    @abstractmethod
    def post_process(self, model_output: Sequence[PoolingRequestOutput], request_id: str | None = None, *,
                     context: PluginContext | None = None, **kwargs: Any) -> Out:
        """`model_output[i]` is the output of the i-th prompt pre_process gave."""

    async def post_process_async(self, model_output: AsyncIterator[tuple[int, PoolingRequestOutput]],
                                 request_id: str | None = None, *, context: PluginContext | None = None,
                                 **kwargs: Any) -> Out:
        # Outputs arrive in finishing order: put them back in prompt order first.
        collected = sorted([(i, out) async for i, out in model_output], key=lambda item: item[0])
        return self.post_process([out for _, out in collected], request_id, context=context, **kwargs)
