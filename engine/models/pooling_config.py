"""How a pooling model turns hidden states into one vector: read from the model folder.

Called by the encoder model classes at start-up. sentence-transformers folders say it in
`modules.json` (the module chain: Transformer -> Pooling -> Normalize) and the Pooling module's
`config.json` (`pooling_mode_mean_tokens`, `pooling_mode_cls_token`, `pooling_mode_lasttoken`);
`sentence_bert_config.json` gives the sequence limit the model was trained with. A folder without
them gets the family's default (BERT: CLS). A module or pooling mode we do not implement is an
error naming it, never silently skipped (the vectors would be wrong).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..errors import UnsupportedModelError

PoolingType = Literal["MEAN", "CLS", "LAST", "ALL"]

_ST_MODES = {"pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS", "pooling_mode_lasttoken": "LAST"}
_ST_UNSUPPORTED = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens", "pooling_mode_weightedmean_tokens")
_ST_KNOWN_MODULES = ("Transformer", "Pooling", "Normalize")


@dataclass(frozen=True)
class PoolerConfig:
    pooling_type: PoolingType
    """How a sequence's token vectors become one: mean over its tokens, its first (CLS) or last token."""
    normalize: bool = True
    """Whether embed L2-normalises by default (a request's PoolingParams.normalize overrides it)."""
    max_seq_length: int | None = None
    """The sequence limit the model was trained with (sentence_bert_config.json), when it says."""
    source: str = "default"
    """Where the settings came from, for logs: "sentence-transformers" or "default"."""


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UnsupportedModelError(f"cannot read {path}: {e}") from None


def read_pooler_config(folder: Path, default: PoolingType) -> PoolerConfig:
    folder = Path(folder)
    st_config = folder / "sentence_bert_config.json"
    max_seq = None
    if st_config.is_file():
        value = _read_json(st_config).get("max_seq_length")
        max_seq = int(value) if isinstance(value, int) and value > 0 else None
    modules_file = folder / "modules.json"
    if not modules_file.is_file():
        return PoolerConfig(default, normalize=True, max_seq_length=max_seq)
    modules = _read_json(modules_file)
    pooling_type: PoolingType = default
    normalize = False
    for module in modules if isinstance(modules, list) else []:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        if kind not in _ST_KNOWN_MODULES:
            raise UnsupportedModelError(
                f"{modules_file}: sentence-transformers module {module.get('type')!r} is not supported "
                f"(supported: {', '.join(_ST_KNOWN_MODULES)})")
        if kind == "Normalize":
            normalize = True
        if kind == "Pooling":
            pooling_type = _pooling_mode(folder / str(module.get("path", "")) / "config.json")
    return PoolerConfig(pooling_type, normalize=normalize, max_seq_length=max_seq, source="sentence-transformers")


def _pooling_mode(path: Path) -> PoolingType:
    config = _read_json(path) if path.is_file() else {}
    bad = [k for k in _ST_UNSUPPORTED if config.get(k)]
    if bad:
        raise UnsupportedModelError(f"{path}: {bad[0]} is not supported (supported: mean, cls, lasttoken)")
    modes = [mode for key, mode in _ST_MODES.items() if config.get(key)]
    if len(modes) != 1:
        raise UnsupportedModelError(f"{path}: exactly one pooling mode must be on, found {modes or 'none'}")
    return modes[0]  # type: ignore[return-value]
