"""OpenAI Batch output lines: `{id, custom_id, response: {status_code, request_id, body}, error}`.

Bodies are `chat.completion` (for /v1/chat/completions) or `text_completion` (for
/v1/completions) objects with `choices` (text, finish_reason, logprobs in OpenAI's shape when
asked) and `usage`. A failed record gets status 400, no body, and the message in `error`,
as vLLM's run-batch writes it. Called by `vbatch.batch.writers.OpenAIBatchWriter`.
"""
from __future__ import annotations

import time
import uuid
from typing import Any

from .openai_input import CHAT_URL
from .result import BatchResult


def _token_text(token_id: int, lp: Any) -> str:
    text = getattr(lp, "decoded_token", None) if lp is not None else None
    return text if text is not None else f"token_id:{token_id}"  # vLLM's name for an undecoded token


def _top(position: dict[int, Any], k: int) -> list[tuple[int, Any]]:
    ranked = sorted(position.items(), key=lambda item: -item[1].logprob)
    return ranked[:k]


def chat_logprobs(completion: Any, k: int) -> dict[str, Any]:
    content = []
    for token_id, position in zip(completion.token_ids, completion.logprobs or []):
        chosen = position.get(token_id)
        text = _token_text(token_id, chosen)
        content.append({
            "token": text,
            "logprob": chosen.logprob if chosen is not None else None,
            "bytes": list(text.encode("utf-8")),
            "top_logprobs": [{"token": (t := _token_text(tid, lp)), "logprob": lp.logprob,
                              "bytes": list(t.encode("utf-8"))} for tid, lp in _top(position, k)],
        })
    return {"content": content}


def completion_logprobs(completion: Any, k: int) -> dict[str, Any]:
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    offset = 0
    for token_id, position in zip(completion.token_ids, completion.logprobs or []):
        chosen = position.get(token_id)
        text = _token_text(token_id, chosen)
        tokens.append(text)
        token_logprobs.append(chosen.logprob if chosen is not None else None)
        top_logprobs.append({_token_text(tid, lp): lp.logprob for tid, lp in _top(position, k)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def response_body(result: BatchResult, default_model: str) -> dict[str, Any]:
    assert result.record is not None and result.record.openai is not None and result.output is not None
    meta = result.record.openai
    out = result.output
    is_chat = meta.url == CHAT_URL
    k = meta.top_logprobs
    choices = []
    for c in out.outputs:
        choice: dict[str, Any] = {"index": c.index}
        if is_chat:
            choice["message"] = {"role": "assistant", "content": c.text}
        else:
            choice["text"] = c.text
        wants_logprobs = k is not None and c.logprobs is not None
        choice["logprobs"] = ((chat_logprobs(c, k) if is_chat else completion_logprobs(c, k))
                              if wants_logprobs else None)
        choice["finish_reason"] = c.finish_reason
        choice["stop_reason"] = c.stop_reason  # vLLM's extension: which stop string/token fired
        choices.append(choice)
    prompt_tokens = len(out.prompt_token_ids or [])
    completion_tokens = sum(len(c.token_ids) for c in out.outputs)
    return {
        "id": f"{'chatcmpl' if is_chat else 'cmpl'}-{uuid.uuid4().hex}",
        "object": "chat.completion" if is_chat else "text_completion",
        "created": int(time.time()),
        "model": meta.model or default_model,
        "choices": choices,
        "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                  "total_tokens": prompt_tokens + completion_tokens},
    }


def batch_output_line(result: BatchResult, default_model: str, body=None) -> dict[str, Any]:
    """One output line; `body(result, model)` builds a success body (default: the completion bodies)."""
    request_id = f"vbatch-batch-{uuid.uuid4().hex}"
    error = result.error_message
    if error is None:
        response = {"status_code": 200, "request_id": request_id,
                    "body": (body or response_body)(result, default_model)}
    else:
        response = {"status_code": 400, "request_id": request_id, "body": None}
    return {"id": f"vbatch-{uuid.uuid4().hex}", "custom_id": result.custom_id, "response": response,
            "error": error}
