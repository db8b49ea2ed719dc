"""`vbatch embed` output records: plain `{id, embedding, num_tokens, error}`, Parquet, OpenAI Batch lines.

A result's output is the list of EmbeddingRequestOutputs of its inputs (one for a plain record;
one per `body.input` item for an OpenAI line). Parquet: `embedding` is a fixed-size list column
of float32 when every row has the same width (a list column otherwise). OpenAI: a `list` body of
`embedding` objects (base64 of little-endian float32 when the line asked for it) with `usage`, as
the OpenAI and vLLM servers answer `/v1/embeddings`. Called by batch/writers.py.
"""
from __future__ import annotations

import base64
import json
import struct
import time
from typing import Any

from .result import BatchResult

PLAIN_FIELDS = ("id", "embedding", "num_tokens", "error")


def _outputs(result: BatchResult) -> list[Any]:
    out = result.output
    return [] if out is None else (out if isinstance(out, list) else [out])


def _vector(out: Any) -> list[float]:
    """The embedding of one engine output (a PoolingRequestOutput, or its EmbeddingRequestOutput view)."""
    data = getattr(out.outputs, "data", None)
    return data.float().tolist() if data is not None else list(out.outputs.embedding)


def embed_record(result: BatchResult) -> dict[str, Any]:
    outs = _outputs(result)
    if result.error_message is not None or not outs:
        return {"id": result.id, "embedding": None, "num_tokens": None, "error": result.error_message}
    (out,) = outs                 # plain records carry one input
    return {"id": result.id, "embedding": _vector(out), "num_tokens": len(out.prompt_token_ids),
            "error": None}


def parquet_embed_schema(width: int | None) -> Any:
    """`width`: every row's embedding length, or None when rows differ (then a variable list)."""
    import pyarrow as pa

    column = pa.list_(pa.float32(), width) if width else pa.list_(pa.float32())
    return pa.schema([("id", pa.string()), ("embedding", column), ("num_tokens", pa.int64()),
                      ("error", pa.string())])


def embedding_width(partial: str) -> int | None:
    """One pass over the JSON-line records: their common embedding length, or None if they differ."""
    widths: set[int] = set()
    with open(partial, "rb") as f:
        for raw in f:
            emb = json.loads(raw).get("embedding")
            if emb is not None:
                widths.add(len(emb))
    return widths.pop() if len(widths) == 1 else None


def to_embed_row(record: dict[str, Any]) -> dict[str, Any]:
    return {k: record.get(k) for k in PLAIN_FIELDS}


def _encode(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def embeddings_body(result: BatchResult, default_model: str) -> dict[str, Any]:
    meta = result.record.openai if result.record is not None else None
    encoding = (meta.encoding_format if meta is not None else None) or "float"
    outs = _outputs(result)
    data = [{"object": "embedding", "index": i, "embedding": _encode(_vector(o), encoding)}
            for i, o in enumerate(outs)]
    tokens = sum(len(o.prompt_token_ids) for o in outs)
    return {"id": f"embd-{time.time_ns():x}", "object": "list", "created": int(time.time()),
            "model": (meta.model if meta is not None else None) or default_model, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


# ---------------------------------------------------------------------------- vbatch encode
ENCODE_FIELDS = ("id", "data", "num_tokens", "error")


def encode_record(result: BatchResult) -> dict[str, Any]:
    """`vbatch encode` (no plugin): the pooler's tensor as nested lists (a vector, per-token rows, a
    segmentation's [classes, H, W] logits), `num_tokens` the request's cost (tokens, or a tile's patches)."""
    outs = _outputs(result)
    if result.error_message is not None or not outs:
        return {"id": result.id, "data": None, "num_tokens": None, "error": result.error_message}
    (out,) = outs
    data = out.outputs.data
    return {"id": result.id, "data": data.float().tolist() if hasattr(data, "float") else data,
            "num_tokens": result.prompt_tokens, "error": None}


def parquet_encode_schema() -> Any:
    """Parquet rows: the tensor flattened (row-major float32) with its shape beside it."""
    import pyarrow as pa

    return pa.schema([("id", pa.string()), ("data", pa.list_(pa.float32())), ("shape", pa.list_(pa.int64())),
                      ("num_tokens", pa.int64()), ("error", pa.string())])


def to_encode_row(record: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    row = {k: record.get(k) for k in ENCODE_FIELDS}
    if row["data"] is not None:
        array = np.asarray(row["data"], dtype=np.float32)
        row["data"], row["shape"] = array.reshape(-1).tolist(), list(array.shape)
    else:
        row["shape"] = None
    return row
