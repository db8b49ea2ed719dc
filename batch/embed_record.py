"""Parse one `vbatch embed` input record into a BatchRecord or a RecordError.

Plain records (JSONL objects, Parquet rows): `id` (optional, as `vbatch run`), exactly one of
`text` | `prompt` | `input` (a string; `input` may also be an array of token ids, as in OpenAI)
| `prompt_token_ids`, optional `pooling_params` ({dimensions, normalize, truncate_prompt_tokens}).
Other keys are ignored.

OpenAI Batch lines: url `/v1/embeddings`, `body.input` a string, an array of token ids, or an
array of either (several inputs: one line, several embeddings in its `data`, in order),
`body.dimensions`, `body.encoding_format` ("float" or "base64"), `body.model` (echoed), `body.user`
(ignored). Called by `vbatch.batch.readers` for `vbatch embed`.
"""
from __future__ import annotations

from typing import Any

from ..engine.errors import PoolingParamsError
from ..engine.pooling_params import PoolingParams
from .fields import check_prompt, check_token_ids, record_id, type_name
from .openai_input import SUPPORTED_URLS, is_openai_line, openai_envelope
from .record import BatchRecord, OpenAIMeta, RecordError

EMBEDDINGS_URL = "/v1/embeddings"
TEXT_FIELDS = ("text", "prompt", "input", "prompt_token_ids")
_RECORD_POOLING_FIELDS = ("dimensions", "normalize", "truncate_prompt_tokens")
_ENCODINGS = ("float", "base64")


def _check_input(value: Any, name: str) -> tuple[tuple[str, str] | None, str, Any]:
    """(problem, kind, value) of one input: a string or an array of token ids."""
    if isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return check_token_ids(value, name), "token_ids", list(value)
    return check_prompt(value, name), "prompt", value


def _check_pooling(overrides: Any, name: str) -> tuple[str, str] | None:
    if not isinstance(overrides, dict):
        return name, f"must be an object of {', '.join(_RECORD_POOLING_FIELDS)}, got {type_name(overrides)}"
    unknown = sorted(set(overrides) - set(_RECORD_POOLING_FIELDS))
    if unknown:
        return f"{name}.{unknown[0]}", f"is not a per-record pooling field ({', '.join(_RECORD_POOLING_FIELDS)})"
    try:
        PoolingParams(**overrides)
    except PoolingParamsError as e:
        return f"{name}.{e.field}", str(e)[len(e.field) + 2:]
    return None


def parse_encode_plain(obj: Any, line: int, *, file: str, default_id: str) -> BatchRecord | RecordError:
    """`vbatch encode` records: an embed record, or `multi_modal_data` (named tensors, nested lists)
    for a model that takes tensors; the engine checks the tensors' names and shapes."""
    if isinstance(obj, dict) and obj.get("multi_modal_data") is not None:
        rid, problem = record_id(obj, default_id)
        if problem is not None:
            return RecordError(id=None, line=line, field=problem[0], message=problem[1], file=file)
        present = [k for k in TEXT_FIELDS if obj.get(k) is not None]
        data = obj["multi_modal_data"]
        if present or not isinstance(data, dict) or not data:
            why = (f"and {present[0]} cannot both be given" if present else
                   f"must be an object of named tensors, got {type_name(data)}")
            return RecordError(id=rid, line=line, field="multi_modal_data", message=why, file=file)
        if obj.get("pooling_params") is not None:
            return RecordError(id=rid, line=line, field="pooling_params", file=file,
                               message="per-record pooling fields apply to text records only")
        return BatchRecord(id=rid, line=line, kind="tensors", multi_modal_data=dict(data))
    return parse_embed_plain(obj, line, file=file, default_id=default_id)


def parse_embed_plain(obj: Any, line: int, *, file: str, default_id: str) -> BatchRecord | RecordError:
    def error(field: str, message: str, rid: str | None = None) -> RecordError:
        return RecordError(id=rid, line=line, field=field, message=message, file=file)

    if not isinstance(obj, dict):
        return error("record", f"must be a JSON object, got {type_name(obj)}")
    if is_openai_line(obj):
        return error("record", "an OpenAI Batch line in a plain JSONL file (the first line decides the format)")
    rid, problem = record_id(obj, default_id)
    if problem is not None:
        return error(*problem)
    present = [k for k in TEXT_FIELDS if obj.get(k) is not None]
    if not present:
        hint = " (chat messages cannot be embedded; give their text)" if obj.get("messages") is not None else ""
        return error("text", f"missing: a record needs one of {', '.join(TEXT_FIELDS)}{hint}", rid)
    if len(present) > 1:
        return error(present[1], f"only one of {', '.join(TEXT_FIELDS)} may be given (got {', '.join(present)})", rid)
    key = present[0]
    if key == "prompt_token_ids":
        problem, kind, value = check_token_ids(obj[key]), "token_ids", obj[key]
    elif key == "input":
        problem, kind, value = _check_input(obj[key], key)
    else:
        problem, kind, value = check_prompt(obj[key], key), "prompt", obj[key]
    if problem is None and obj.get("pooling_params") is not None:
        problem = _check_pooling(obj["pooling_params"], "pooling_params")
    if problem is not None:
        return error(*problem, rid)
    return BatchRecord(id=rid, line=line, kind=kind, prompt=value if kind == "prompt" else None,
                       prompt_token_ids=list(value) if kind == "token_ids" else None,
                       pooling_overrides=dict(obj.get("pooling_params") or {}))


def parse_embed_openai(obj: Any, line: int, *, file: str) -> BatchRecord | RecordError:
    envelope = openai_envelope(obj, line, file=file, urls=(EMBEDDINGS_URL,), command="vbatch embed",
                               elsewhere={url: "vbatch run" for url in SUPPORTED_URLS})
    if isinstance(envelope, RecordError):
        return envelope
    cid, body, model, error = envelope
    encoding = body.get("encoding_format", "float")
    if encoding not in _ENCODINGS:
        return error("body.encoding_format", f"must be one of {', '.join(_ENCODINGS)}, got {encoding!r}")
    raw = body.get("input")
    many = isinstance(raw, list) and bool(raw) and all(isinstance(x, (str, list)) for x in raw)
    items = list(raw) if many else [raw]
    inputs: list[Any] = []
    for i, item in enumerate(items):
        problem, kind, value = _check_input(item, f"body.input[{i}]" if many else "body.input")
        if problem is not None:
            return error(*problem)
        inputs.append(value)
    pooling: dict[str, Any] = {}
    if body.get("dimensions") is not None:
        pooling["dimensions"] = body["dimensions"]
        problem = _check_pooling(pooling, "body")
        if problem is not None:
            return error(*problem)
    meta = OpenAIMeta(custom_id=cid, url=EMBEDDINGS_URL, model=model, encoding_format=encoding)
    first = inputs[0]
    return BatchRecord(id=cid, line=line, kind="token_ids" if isinstance(first, list) else "prompt",
                       prompt=first if isinstance(first, str) else None,
                       prompt_token_ids=first if isinstance(first, list) else None,
                       pooling_overrides=pooling, openai=meta,
                       inputs=tuple(inputs) if many else None)
