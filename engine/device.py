"""Device and dtype choice, made once at engine start (REFERENCE section 8)."""
from __future__ import annotations

import torch

from .errors import ConfigError

_NAMED = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# the KV cache's 8-bit formats (vLLM's names; fp8 is E4M3)
FP8_KV = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("device", f"{name} asked for, but CUDA is not available", hint="use --device cpu")
    return torch.device(name)


def cpu_has_fast_bf16() -> bool:
    """avx512_bf16 or AMX in the selected CPU tier, and oneDNN's bf16 GEMMs on it: about 2x faster
    than fp32 (REFERENCE 8). Without it (AVX2: bf16 GEMMs at about 19 GFLOP/s against 160 for
    fp32) bf16 is never the compute dtype of choice."""
    from ..kernels.cpu_features import selected_tier
    if not selected_tier().bf16_compute:
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def resolve_dtype(name: str, device: torch.device, *, exact_on_cpu: bool = False,
                  quantization: str | None = None) -> torch.dtype:
    """auto: bf16 where the device computes it fast (CUDA with bf16, CPUs with avx512_bf16), else fp32.
    `exact_on_cpu`: a model family whose outputs are compared with fp32 references (embeddings) keeps
    fp32 on every CPU under auto; `--dtype bfloat16` still asks for bf16. A `quantization` (q8_0)
    computes in fp32 on the CPU: auto is then fp32, any other dtype or device a ConfigError."""
    if quantization is not None:
        if device.type != "cpu":
            raise ConfigError("quantization", f"{quantization} weights run on the CPU only, not {device}",
                              hint="use --device cpu, or leave --quantization unset")
        if name not in ("auto", "float32"):
            raise ConfigError("quantization", f"{quantization} weights are computed in fp32, not {name}",
                              hint="use --dtype auto or float32 with --quantization")
        return torch.float32
    if name != "auto":
        dtype = _NAMED[name]
        if device.type == "cpu" and dtype == torch.float16:
            raise ConfigError("dtype", "float16 is not supported on CPU", hint="use bfloat16 or float32")
        return dtype
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.bfloat16 if cpu_has_fast_bf16() and not exact_on_cpu else torch.float32


def resolve_weight_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype | None:
    """How the linear weights are stored: None for auto (the CPU ops decide: the model's dtype, or
    for an fp32 model whose dtype was auto the CPU tier's half-precision format); else the named
    dtype, which must be the model's, or fp16 / bf16 under an fp32 model on CPU (widened in
    registers by the native kernels)."""
    return _storage_dtype("weight_dtype", name, dtype, device)


def resolve_kv_cache_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype | None:
    """How the KV cache is stored: the same rule as resolve_weight_dtype, and the fp8 formats (fp8,
    fp8_e4m3, fp8_e5m2) under an fp32 or bf16 model on the CPU (the native kernels widen them in
    registers; the references read them with .float())."""
    if name in FP8_KV:
        if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            raise ConfigError("kv_cache_dtype", f"{name} is stored and read by the CPU kernels only, under an fp32 "
                              f"or bf16 model (here: {device.type}, {str(dtype).removeprefix('torch.')})",
                              hint="use kv_cache_dtype auto on this device")
        return FP8_KV[name]
    return _storage_dtype("kv_cache_dtype", name, dtype, device)


def _storage_dtype(field: str, name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype | None:
    if name == "auto":
        return None
    if name not in _NAMED:
        raise ConfigError(field, f"{name} is not a storage dtype here", hint=f"use auto or one of {', '.join(_NAMED)}")
    stored = _NAMED[name]
    if stored == dtype or (device.type == "cpu" and dtype == torch.float32 and stored != torch.float32):
        return stored
    raise ConfigError(field, f"{name} storage under a {str(dtype).removeprefix('torch.')} model is not supported",
                      hint=f"use {field} auto, the model's dtype, or float16/bfloat16 with dtype float32 on CPU")
