"""Loading a model's tokenizer and rendering chat conversations through its template.

Called by the engine (LLM.chat, prompt preparation) and the batch readers. Tokenizers are
read from local files only and never run remote code. The chat template is Jinja from the
tokenizer config (or the GGUF metadata, which model conversion copies there); the caller
may pass its own template as a string or a file path (vLLM's `chat_template=`).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from .errors import ConfigError, InputError, ModelLoadError

# A template that loops over a message's content expects OpenAI content parts; any other
# template concatenates content as a string, so text-only parts are joined for it (as vLLM's
# "auto" content format does).
_LOOPS_OVER_CONTENT = re.compile(r"for\s+\w+\s+in\s+\w+(\[['\"]content['\"]\]|\.content)")


def load_tokenizer(path: str | Path):
    """AutoTokenizer from a local folder (no hub, no remote code); ModelLoadError on failure."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # noqa: BLE001  missing files, bad json, unknown class: all "cannot load"
        raise ModelLoadError(f"cannot load a tokenizer from {path}: {type(e).__name__}: {e}",
                             hint="the folder needs tokenizer.json or tokenizer_config.json "
                                  "(pass --tokenizer to use another folder)") from None


def _template_text(tokenizer, chat_template: str | None) -> str:
    if chat_template:
        if "{" not in chat_template and len(chat_template) < 4096:
            path = Path(chat_template).expanduser()
            if not path.is_file():
                raise ConfigError("chat_template", f"{chat_template!r} is neither a Jinja template nor a file",
                                  hint="pass the template text or the path of a .jinja file")
            return path.read_text()
        return chat_template
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: "default" is the chat one
        template = template.get("default") or next(iter(template.values()), None)
    if not template:
        raise ConfigError("chat_template", "the model's tokenizer has no chat template",
                          hint="pass chat_template= (Jinja text or a .jinja file), or use generate() "
                               "with plain prompts")
    return template


MEDIA_PART_TYPES = ("image_url", "input_image", "image", "input_audio", "audio_url", "video_url", "file")


def non_text_part_message(part_type: str, model: str) -> str:
    """Why a chat content part that is not text is refused (every model vbatch serves reads text only;
    the multimodal models will say which parts they take). Also used by batch validation."""
    what = "a media" if part_type in MEDIA_PART_TYPES else "an unknown"
    return (f"is {what} content part ({part_type!r}); {model} reads text only, so a chat message may hold "
            "only 'text' parts")


def _flatten_text_parts(conversation: list[dict]) -> list[dict]:
    flat = []
    for message in conversation:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            message = dict(message, content="\n".join(str(p.get("text", "")) for p in content))
        flat.append(message)
    return flat


def apply_chat_template(tokenizer, conversation: list[dict], *, chat_template: str | None,
                        add_generation_prompt: bool, continue_final_message: bool,
                        tools: list[dict[str, Any]] | None = None) -> str:
    """The conversation rendered as one prompt string (not tokenized)."""
    if add_generation_prompt and continue_final_message:
        raise ConfigError("continue_final_message",
                          "cannot be used together with add_generation_prompt=True",
                          hint="set add_generation_prompt=False to continue the final message")
    if not isinstance(conversation, list) or not all(isinstance(m, dict) for m in conversation):
        raise InputError("a conversation must be a list of {'role': ..., 'content': ...} messages")
    for i, message in enumerate(conversation):
        content = message.get("content") if isinstance(message, dict) else None
        for j, part in enumerate(content if isinstance(content, list) else []):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                model = getattr(tokenizer, "name_or_path", None) or "this model"
                raise InputError(non_text_part_message(str(kind), model), field=f"messages[{i}].content[{j}]")
    template = _template_text(tokenizer, chat_template)
    if not _LOOPS_OVER_CONTENT.search(template):
        conversation = _flatten_text_parts(conversation)
    import jinja2

    try:
        return tokenizer.apply_chat_template(
            conversation, chat_template=template, tools=tools, tokenize=False,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message)
    except jinja2.TemplateSyntaxError as e:
        raise ConfigError("chat_template", f"is not valid Jinja: {e}") from None
    except (jinja2.TemplateError, ValueError, TypeError, KeyError) as e:
        # raise_exception() in a template ("roles must alternate") and bad messages land here.
        raise InputError(f"the chat template rejected the conversation: {e}") from None
