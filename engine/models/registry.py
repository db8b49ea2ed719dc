"""Architecture registry: which vbatch model class serves a Hugging Face config.

Called by the engine and the model runners at start-up (`get_model_class(hf_config)`). Keyed by the
config's `architectures[0]`; configs without `architectures` (built in code) fall back to `model_type`.
Each class says what it is: `needs_kv_cache = False` marks an encoder-only pooling model (run by
engine/pooling_runner.py); every other class generates on the paged KV cache (engine/model_runner.py).
`input_kind = "tensors"` marks a model that takes named tensors instead of tokens (no tokenizer).
"""
from __future__ import annotations

from typing import Any

from ..errors import UnsupportedModelError
from .bert import BertForSequenceClassification, BertModel
from .llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from .terratorch import TerratorchSegmentation

SUPPORTED_ARCHITECTURES: dict[str, type] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "BertModel": BertModel,
    "BertForMaskedLM": BertModel,           # the encoder of a pre-training export, for embeddings
    "BertForSequenceClassification": BertForSequenceClassification,
    "Terratorch": TerratorchSegmentation,   # terratorch / vLLM geospatial folders (Prithvi segmentation)
}

_BY_MODEL_TYPE: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "bert": "BertModel",
}


def get_model_class(config: Any) -> type:
    """The class for `config`, or UnsupportedModelError naming what was found and what is supported."""
    architectures = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    name = architectures[0] if architectures else _BY_MODEL_TYPE.get(str(model_type))
    if name in SUPPORTED_ARCHITECTURES:
        return SUPPORTED_ARCHITECTURES[name]
    found = f"architectures={architectures}" if architectures else f"model_type={model_type!r}"
    raise UnsupportedModelError(
        f"unsupported model ({found}); supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}",
        hint="use a Llama, Qwen2 or Mistral checkpoint to generate, a BERT one to embed or classify, "
             "a terratorch Prithvi folder to segment tiles")


def is_pooling_model(config: Any) -> bool:
    """True for encoder-only pooling models (no KV cache, no generation)."""
    return not getattr(get_model_class(config), "needs_kv_cache", True)
