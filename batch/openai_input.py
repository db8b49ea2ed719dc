"""Parse one OpenAI Batch line (`custom_id`, `method`, `url`, `body`) into a BatchRecord or RecordError.

Served urls: `/v1/chat/completions` (body.messages) and `/v1/completions` (body.prompt).
Body fields map onto SamplingParams (OpenAI names -> vLLM names); vLLM's extra sampling
fields (top_k, min_p, repetition_penalty, ...) are accepted in the body as vLLM's server does.
Called by `vbatch.batch.readers`; the response side is `vbatch.batch.openai_output`.
"""
from __future__ import annotations

from typing import Any

from .fields import check_messages, check_prompt, check_sampling, check_token_ids, type_name
from .record import BatchRecord, OpenAIMeta, RecordError

CHAT_URL = "/v1/chat/completions"
COMPLETIONS_URL = "/v1/completions"
SUPPORTED_URLS = (CHAT_URL, COMPLETIONS_URL)

# OpenAI body field -> SamplingParams field, same meaning on both urls.
_DIRECT = {
    "temperature": "temperature", "top_p": "top_p", "n": "n", "stop": "stop", "seed": "seed",
    "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty",
    "logit_bias": "logit_bias",
    # vLLM extensions its OpenAI server accepts in the body.
    "top_k": "top_k", "min_p": "min_p", "repetition_penalty": "repetition_penalty",
    "min_tokens": "min_tokens", "ignore_eos": "ignore_eos", "stop_token_ids": "stop_token_ids",
    "skip_special_tokens": "skip_special_tokens", "bad_words": "bad_words",
    "include_stop_str_in_output": "include_stop_str_in_output",
}
# Body fields whose meaning vbatch cannot honour: refusing beats silently ignoring them.
_UNSUPPORTED = ("tools", "functions", "tool_choice", "response_format", "suffix", "echo", "best_of",
                "audio", "modalities", "prediction")


def is_openai_line(obj: Any) -> bool:
    """Content sniffing: does this object look like an OpenAI Batch line?"""
    return isinstance(obj, dict) and ("custom_id" in obj or ("url" in obj and "body" in obj))


def body_to_sampling(body: dict[str, Any], url: str) -> tuple[dict[str, Any], dict[str, str], int | None]:
    """(SamplingParams overrides, SamplingParams field -> body field, top_logprobs to report)."""
    params: dict[str, Any] = {}
    source: dict[str, str] = {}
    for key, name in _DIRECT.items():
        if body.get(key) is not None:
            params[name], source[name] = body[key], key
    # max_completion_tokens is the current chat name; it wins over the deprecated max_tokens.
    for key in ("max_tokens", "max_completion_tokens"):
        if body.get(key) is not None:
            params["max_tokens"], source["max_tokens"] = body[key], key
    top: int | None = None
    if url == CHAT_URL:
        if body.get("logprobs") is True:
            top = body.get("top_logprobs") if body.get("top_logprobs") is not None else 0
            params["logprobs"], source["logprobs"] = top, "top_logprobs"
        elif body.get("logprobs") not in (None, False):
            params["logprobs"], source["logprobs"] = body["logprobs"], "logprobs"  # type error below
    elif body.get("logprobs") is not None:
        top = body["logprobs"]
        params["logprobs"], source["logprobs"] = top, "logprobs"
    return params, source, top if isinstance(top, int) else None


def openai_envelope(obj: Any, line: int, *, file: str, urls: tuple[str, ...], command: str = "vbatch",
                    elsewhere: dict[str, str] | None = None) -> tuple[str, dict[str, Any], str | None, Any] | RecordError:
    """The checks every OpenAI Batch line passes (custom_id, method, url among `urls`, body, body.model):
    (custom_id, body, model, error) where error(field, message) makes this line's RecordError.
    `elsewhere`: url -> which other command serves it (added to the url error)."""
    custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
    cid = custom_id if isinstance(custom_id, str) and custom_id else None

    def error(field: str, message: str) -> RecordError:
        return RecordError(id=cid, line=line, field=field, message=message, file=file, custom_id=cid)

    if not isinstance(obj, dict):
        return error("record", f"must be a JSON object, got {type_name(obj)}")
    if cid is None:
        return error("custom_id", f"must be a non-empty string, got {custom_id!r}")
    if obj.get("method", "POST") != "POST":
        return error("method", f"must be POST, got {obj.get('method')!r}")
    url = obj.get("url")
    if url not in urls:
        where = (elsewhere or {}).get(url) if isinstance(url, str) else None
        return error("url", f"unsupported url {url!r}; {command} serves {', '.join(urls)}"
                            + (f" ({where} serves {url})" if where else ""))
    body = obj.get("body")
    if not isinstance(body, dict):
        return error("body", f"must be an object, got {type_name(body)}")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        return error("body.model", f"must be a string, got {type_name(model)}")
    return cid, body, model, error


def parse_openai(obj: Any, line: int, *, file: str,
                 sampling_defaults: dict[str, Any] | None = None) -> BatchRecord | RecordError:
    envelope = openai_envelope(obj, line, file=file, urls=SUPPORTED_URLS,
                               elsewhere={"/v1/embeddings": "vbatch embed"})
    if isinstance(envelope, RecordError):
        return envelope
    cid, body, model, error = envelope
    url = obj["url"]
    for key in _UNSUPPORTED:
        if body.get(key) is not None:
            return error(f"body.{key}", "is not supported by vbatch")
    if body.get("stream"):
        return error("body.stream", "must be false in a batch file")

    kind, prompt, messages, token_ids = "prompt", None, None, None
    if url == CHAT_URL:
        problem = check_messages(body.get("messages"), "body.messages")
        kind, messages = "messages", body.get("messages")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a one-element prompt list is still one request
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            problem = check_token_ids(prompt, "body.prompt")
            kind, token_ids, prompt = "token_ids", prompt, None
        elif isinstance(prompt, list):
            problem = ("body.prompt", "must be one string or one array of token ids; put each prompt on its own line")
        else:
            problem = check_prompt(prompt, "body.prompt")
    if problem is not None:
        return error(*problem)

    params, source, top = body_to_sampling(body, url)
    problem = check_sampling(params, sampling_defaults, "body")
    if problem is not None:
        field, message = problem
        if field.startswith("body."):
            field = "body." + source.get(field[len("body."):], field[len("body."):])
        return error(field, message)
    meta = OpenAIMeta(custom_id=cid, url=url, model=model, top_logprobs=top)
    return BatchRecord(id=cid, line=line, kind=kind, prompt=prompt,
                       messages=list(messages) if messages is not None else None,
                       prompt_token_ids=list(token_ids) if token_ids is not None else None,
                       sampling_overrides=params, openai=meta)
