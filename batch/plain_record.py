"""Parse one plain record (a JSONL object or a Parquet row) into a BatchRecord or a RecordError.

Format: `id` (optional; default the 1-based line / 0-based row as a string), exactly one of
`prompt` (string) | `messages` (OpenAI chat messages) | `prompt_token_ids` (array of ints),
optional `sampling_params` (SamplingParams fields). Other keys are ignored, so users can keep
their own metadata in the file. Called by `vbatch.batch.readers`.
"""
from __future__ import annotations

from typing import Any

from .fields import check_messages, check_prompt, check_sampling, check_token_ids, record_id, type_name
from .record import BatchRecord, RecordError

PROMPT_FIELDS = ("prompt", "messages", "prompt_token_ids")
_KIND = {"prompt": "prompt", "messages": "messages", "prompt_token_ids": "token_ids"}


def parse_plain(obj: Any, line: int, *, file: str, default_id: str,
                sampling_defaults: dict[str, Any] | None = None) -> BatchRecord | RecordError:
    def error(field: str, message: str, rid: str | None = None) -> RecordError:
        return RecordError(id=rid, line=line, field=field, message=message, file=file)

    if not isinstance(obj, dict):
        return error("record", f"must be a JSON object, got {type_name(obj)}")
    rid, problem = record_id(obj, default_id)
    if problem is not None:
        return error(*problem)

    present = [k for k in PROMPT_FIELDS if obj.get(k) is not None]
    if not present:
        return error("prompt", "missing: a record needs one of prompt, messages, prompt_token_ids", rid)
    if len(present) > 1:
        return error(present[1], f"only one of prompt, messages, prompt_token_ids may be given "
                                 f"(got {', '.join(present)})", rid)
    key = present[0]
    value = obj[key]
    check = {"prompt": check_prompt, "messages": check_messages, "prompt_token_ids": check_token_ids}[key]
    problem = check(value)
    if problem is None and obj.get("sampling_params") is not None:
        problem = check_sampling(obj["sampling_params"], sampling_defaults)
    if problem is not None:
        return error(*problem, rid)

    overrides = dict(obj.get("sampling_params") or {})
    return BatchRecord(
        id=rid, line=line, kind=_KIND[key],
        prompt=value if key == "prompt" else None,
        messages=list(value) if key == "messages" else None,
        prompt_token_ids=list(value) if key == "prompt_token_ids" else None,
        sampling_overrides=overrides,
    )
