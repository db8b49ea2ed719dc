"""Reading a model folder's config.json into a transformers config, for every family we serve.

Called by the engine at start-up. A Hugging Face folder's config names its `model_type` and goes
through `AutoConfig` (no remote code). A terratorch / vLLM geospatial folder (`architectures:
["Terratorch"]`) has no `model_type`, which AutoConfig refuses: it is read as a plain
`PretrainedConfig` whose keys (`pretrained_cfg`, `io_processor_plugin`, ...) stay attributes.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..errors import ModelLoadError


def load_hf_config(folder: Path) -> Any:
    from transformers import AutoConfig, PretrainedConfig

    file = Path(folder) / "config.json"
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read the model config {file}: {e}") from None
    if not isinstance(raw, dict):
        raise ModelLoadError(f"{file} does not hold a JSON object")
    if "model_type" not in raw and raw.get("architectures"):
        return PretrainedConfig.from_dict(raw)
    try:
        return AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot read the model config in {folder}: {e}") from None
