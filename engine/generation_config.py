"""A model's generation_config.json -> default sampling values and extra EOS ids (REFERENCE 1.2).

Called by the engine when it loads a model (`ModelConfig.generation_config`). vLLM rules:
- "auto": the file's sampling values become the defaults, used only when the caller passes
  no SamplingParams at all (the engine applies them; this module only reads them).
  `do_sample` is ignored, as in vLLM: a file with `temperature` sets it even if do_sample=false.
- "vllm": no sampling defaults, but EOS ids still come from the model's file.
- anything else: a folder holding generation_config.json, read for both.
EOS ids (config.json's, then generation_config's extras) always become stop tokens unless
`ignore_eos`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError, ModelLoadError

FILE_NAME = "generation_config.json"
# generation_config.json key -> SamplingParams field.
_SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass(frozen=True)
class GenerationDefaults:
    sampling_overrides: dict[str, Any] = field(default_factory=dict)
    """SamplingParams field -> value, for requests that come without SamplingParams."""
    eos_token_ids: tuple[int, ...] = ()
    """Every id that ends generation: config.json's eos first, then generation_config's extras."""


def _read_json(path: Path, field_name: str) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(field_name, f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(field_name, f"{path} must hold a JSON object")
    return data


def _ids(value: Any) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _config_eos(model_path: Path) -> list[int]:
    config_file = model_path / "config.json"
    if not config_file.is_file():
        return []
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {config_file}: {e}") from None
    eos = _ids(config.get("eos_token_id"))
    # Multimodal configs keep the language model's ids one level down.
    text_config = config.get("text_config")
    if not eos and isinstance(text_config, dict):
        eos = _ids(text_config.get("eos_token_id"))
    return eos


def _sampling_overrides(generation: dict) -> dict[str, Any]:
    overrides = {}
    for key, target in _SAMPLING_KEYS.items():
        value = generation.get(key)
        if value is None or isinstance(value, bool):
            continue
        overrides[target] = int(value) if target in ("top_k", "max_tokens") else float(value)
    return overrides


def load_generation_defaults(model_path: Path, mode: str = "auto") -> GenerationDefaults:
    """Reads the defaults that `mode` ("auto" | "vllm" | a folder path) asks for."""
    model_path = Path(model_path)
    if mode in ("auto", "vllm"):
        source = model_path / FILE_NAME
        generation = _read_json(source, "generation_config") if source.is_file() else {}
    else:
        folder = Path(mode).expanduser()
        source = folder / FILE_NAME if folder.is_dir() else folder
        if not (folder.is_dir() and source.is_file()):
            raise ConfigError("generation_config", f"{mode!r} is not 'auto', 'vllm' or a folder holding {FILE_NAME}",
                              hint="pass auto (the model's file), vllm (neutral defaults) or such a folder")
        generation = _read_json(source, "generation_config")
    overrides = {} if mode == "vllm" else _sampling_overrides(generation)
    eos: list[int] = []
    for token_id in _config_eos(model_path) + _ids(generation.get("eos_token_id")):
        if token_id not in eos:
            eos.append(token_id)
    return GenerationDefaults(sampling_overrides=overrides, eos_token_ids=tuple(eos))
