"""A small third-party IO processor plugin: {"a": text, "b": text} -> {"cosine": float}.

Two engine prompts per input (both texts, embedded by the model), one result: their cosine.
The texts travel in the PluginContext, never on the plugin object.
"""
from __future__ import annotations

from vbatch.engine.errors import InputError
from vbatch.engine.pooling_params import PoolingParams
from vbatch.io_plugins.interface import IOProcessor


def register() -> str:
    return "vbatch_pair_plugin:PairSimilarity"


class PairSimilarity(IOProcessor):
    name = "pair"

    def parse_data(self, data):
        if not isinstance(data, dict) or not all(isinstance(data.get(k), str) and data[k] for k in ("a", "b")):
            raise InputError("needs {'a': text, 'b': text}", field="data")
        return (data["a"], data["b"])

    def merge_pooling_params(self, params=None):
        return params or PoolingParams(task="embed")

    def pre_process(self, prompt, request_id=None, *, context=None, **kwargs):
        context.state["pair"] = prompt
        return list(prompt)

    def post_process(self, model_output, request_id=None, *, context=None, **kwargs):
        import torch
        a, b = (o.outputs.data for o in model_output)
        return {"a": context.state["pair"][0], "b": context.state["pair"][1], "cosine": float(torch.dot(a, b))}
