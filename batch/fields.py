"""Field checks shared by the record parsers (plain JSONL/Parquet and OpenAI Batch).

Each check returns None when the value is fine, or a (field, message) pair naming the
offending field the way `vbatch validate` prints it. Pure functions: no I/O, no engine.
"""
from __future__ import annotations

from typing import Any

from ..engine.errors import SamplingParamsError
from ..engine.sampling_params import SamplingParams
from ..engine.tokenizer import non_text_part_message

Problem = tuple[str, str]
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def type_name(value: Any) -> str:
    """The JSON name of a value's type, for messages a JSON user recognises."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "array"
    if isinstance(value, dict):
        return "object"
    return type(value).__name__


def record_id(obj: dict[str, Any], default_id: str) -> tuple[str | None, Problem | None]:
    """A plain record's id: its `id` (a non-empty string, or an integer as its decimal string), else
    `default_id` (the line or row number). Returns (id, None) or (None, problem)."""
    rid: Any = obj.get("id")
    if rid is None:
        return default_id, None
    if isinstance(rid, int) and not isinstance(rid, bool):
        return str(rid), None
    if not isinstance(rid, str) or rid == "":
        return None, ("id", f"must be a non-empty string or an integer, got {rid!r}")
    return rid, None


def check_prompt(value: Any, name: str = "prompt") -> Problem | None:
    if not isinstance(value, str):
        return name, f"must be a string, got {type_name(value)}"
    if value == "":
        return name, "must not be empty"
    return None


def check_token_ids(value: Any, name: str = "prompt_token_ids") -> Problem | None:
    if not isinstance(value, (list, tuple)):
        return name, f"must be an array of token ids, got {type_name(value)}"
    if len(value) == 0:
        return name, "must not be empty"
    for i, t in enumerate(value):
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            return f"{name}[{i}]", f"must be a non-negative integer, got {t!r}"
    return None


def check_messages(value: Any, name: str = "messages") -> Problem | None:
    """OpenAI chat messages: a non-empty array of {role, content} objects."""
    if not isinstance(value, (list, tuple)):
        return name, f"must be an array of chat messages, got {type_name(value)}"
    if len(value) == 0:
        return name, "must not be empty"
    for i, msg in enumerate(value):
        where = f"{name}[{i}]"
        if not isinstance(msg, dict):
            return where, f"must be an object with role and content, got {type_name(msg)}"
        role = msg.get("role")
        if role not in CHAT_ROLES:
            return f"{where}.role", f"must be one of {', '.join(CHAT_ROLES)}, got {role!r}"
        content = msg.get("content")
        if content is None and role == "assistant" and msg.get("tool_calls"):
            continue  # an assistant turn that only calls tools has no content
        if isinstance(content, str):
            continue
        if isinstance(content, (list, tuple)) and content:
            for j, part in enumerate(content):
                if not isinstance(part, dict) or not isinstance(part.get("type"), str):
                    return f"{where}.content[{j}]", "must be an object with a string 'type'"
                if part["type"] == "text" and not isinstance(part.get("text"), str):
                    return f"{where}.content[{j}].text", "must be a string"
                if part["type"] != "text":
                    return f"{where}.content[{j}]", non_text_part_message(part["type"], "the model")
            continue
        return f"{where}.content", f"must be a string or a non-empty array of content parts, got {type_name(content)}"
    return None


def check_sampling(overrides: Any, defaults: dict[str, Any] | None,
                   name: str = "sampling_params") -> Problem | None:
    """Validate a record's sampling fields on top of the command-line defaults.

    NOTE: the record is checked merged with the defaults because some rules span fields
    (min_tokens <= max_tokens, n == 1 when greedy); a record is only wrong if the combination
    the run would use is wrong.
    """
    if not isinstance(overrides, dict):
        return name, f"must be an object of SamplingParams fields, got {type_name(overrides)}"
    merged = {**(defaults or {}), **overrides}
    try:
        SamplingParams.from_dict(merged)
    except SamplingParamsError as e:
        prefix = f"{e.field}: "
        message = str(e)[len(prefix):] if str(e).startswith(prefix) else str(e)
        return f"{name}.{e.field}", message
    except (TypeError, ValueError) as e:
        return name, f"invalid value ({e})"
    return None
