"""The plugin driver: many inputs through one IO processor plugin and one engine run, bounded and streaming.

    for result in run_plugin(llm, plugin, inputs):      # PluginInput(key, data) in, PluginResult out
        ...                                              # as each input's last request finishes

Each input is parsed and pre-processed only when the engine has room (its prompts may come from a
lazy iterator, so a 10,000-tile folder or a huge scene is never held in memory at once); the
prompts of all inputs share the engine's batches; an input is post-processed the moment its last
request finishes, and its result is yielded then (finishing order, not input order). The unit of
error reporting is the input: a failure in parse_data, pre_process, any of its requests or
post_process becomes that input's error (with what failed) and the others go on. Consumed by
`LLM.encode` with a plugin and by `vbatch encode`; per-request state lives in a PluginContext per
input (io_plugins/interface.py), never on the plugin.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..engine.errors import VBatchError
from ..engine.output_stream import EngineRequest, StreamResult
from ..engine.pooling_params import PoolingParams
from .interface import IOProcessor, PluginContext


@dataclass(frozen=True)
class PluginInput:
    key: str                      # names the input in results and errors (a file path, a record id)
    data: Any                     # what the plugin's parse_data receives


@dataclass(frozen=True)
class PluginResult:
    key: str
    output: Any = None            # what post_process returned
    error: str | None = None      # "<stage>: <message>" when the input failed
    num_requests: int = 0         # engine requests its prompts became

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclass
class _Open:
    """An input whose requests are in flight: its outputs so far, and whether all were issued."""

    key: str
    context: PluginContext
    outputs: dict[int, Any] = field(default_factory=dict)
    num_issued: int = 0
    all_issued: bool = False
    error: str | None = None


def _describe(e: BaseException) -> str:
    """A VBatchError's own message (it names the field); anything else with its type."""
    return str(e) if isinstance(e, VBatchError) else f"{type(e).__name__}: {e}"


def run_plugin(llm: Any, plugin: IOProcessor, inputs: Iterable[PluginInput], *,
               pooling_params: PoolingParams | None = None, max_in_flight: int = 64, max_open_inputs: int = 16,
               should_stop: Callable[[], bool] | None = None) -> Iterator[PluginResult]:
    """`llm`: anything with the engine's `stream` (vbatch.LLM). `max_open_inputs` bounds how many
    inputs are pre-processed but not yet post-processed (their outputs are held until then)."""
    open_inputs: dict[int, _Open] = {}
    params = plugin.merge_pooling_params(pooling_params)
    task = params.task or "plugin"

    def requests() -> Iterator[EngineRequest]:
        for n, item in enumerate(inputs):
            rid = f"in{n}"
            state = open_inputs[n] = _Open(item.key, PluginContext(rid))
            try:
                parsed = plugin.parse_data(item.data)
            except Exception as e:  # noqa: BLE001  any plugin failure is this input's error
                state.error = f"parse_data: {_describe(e)}"
            if state.error is None:
                try:
                    prompts = plugin.pre_process(parsed, rid, context=state.context)
                    if isinstance(prompts, (str, dict)) or not isinstance(prompts, Iterable):
                        prompts = [prompts]
                    for k, prompt in enumerate(prompts):
                        state.num_issued = k + 1
                        yield EngineRequest(f"{rid}.{k}", prompt, params, pooling_task=task, context=(n, k))
                except Exception as e:  # noqa: BLE001
                    state.error = f"pre_process: {_describe(e)}"
            state.all_issued = True
            yield EngineRequest(f"{rid}.end", None, None, context=(n, None), passthrough=True)

    def finish(n: int) -> PluginResult | None:
        state = open_inputs[n]
        if not state.all_issued or len(state.outputs) < state.num_issued:
            return None
        del open_inputs[n]
        try:
            return _post_process(plugin, state)
        finally:
            _close(state)

    def admit() -> bool:
        # An input still issuing its prompts always may go on; a new one waits for room.
        issuing = bool(open_inputs) and not open_inputs[max(open_inputs)].all_issued
        return issuing or len(open_inputs) < max_open_inputs

    stream = llm.stream(requests(), max_in_flight=max_in_flight, should_stop=should_stop, admit=admit)
    try:
        with contextlib.closing(stream):
            for item in stream:
                n, k = item.request.context
                state = open_inputs[n]
                if k is not None:
                    _record(state, k, item)
                done = finish(n)
                if done is not None:
                    yield done
    finally:                       # stopped early or failed: the inputs still open release what they hold
        for state in list(open_inputs.values()):
            _close(state)
        open_inputs.clear()


def _post_process(plugin: IOProcessor, state: _Open) -> PluginResult:
    if state.error is None and state.num_issued == 0:
        state.error = "pre_process: gave no prompts"
    if state.error is not None:
        return PluginResult(state.key, error=state.error, num_requests=state.num_issued)
    outs = [state.outputs[k] for k in range(state.num_issued)]
    try:
        output = plugin.post_process(outs, state.context.request_id, context=state.context)
    except Exception as e:  # noqa: BLE001
        return PluginResult(state.key, error=f"post_process: {_describe(e)}", num_requests=state.num_issued)
    return PluginResult(state.key, output=output, num_requests=state.num_issued)


def _close(state: _Open) -> None:
    try:
        state.context.close()
    except Exception:  # noqa: BLE001  a failing closer must not hide the input's result
        pass


def _record(state: _Open, k: int, item: StreamResult) -> None:
    if item.error is not None or (item.output is not None and item.output.error is not None):
        if state.error is None:
            why = item.error if item.error is not None else item.output.error
            state.error = f"request {k}: {_describe(why) if isinstance(why, BaseException) else why}"
    state.outputs[k] = item.output
