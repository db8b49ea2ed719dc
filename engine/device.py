"""Device and dtype choice, made once at engine start (REFERENCE section 8)."""
from __future__ import annotations

import torch

from .errors import ConfigError

_NAMED = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("device", f"{name} asked for, but CUDA is not available", hint="use --device cpu")
    return torch.device(name)


def cpu_has_fast_bf16() -> bool:
    """avx512_bf16 or AMX: oneDNN runs bf16 GEMMs about 2x faster than fp32 (REFERENCE 8)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 where the device computes it fast (CUDA with bf16, CPUs with avx512_bf16), else fp32."""
    if name != "auto":
        dtype = _NAMED[name]
        if device.type == "cpu" and dtype == torch.float16:
            raise ConfigError("dtype", "float16 is not supported on CPU", hint="use bfloat16 or float32")
        return dtype
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32
