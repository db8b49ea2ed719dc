"""Reference rotary position embedding (NeoX / rotate-half layout, as HF Llama uses).

`build_rope_cache` is called once by the model at construction; `apply_rotary` by every attention
layer through `kernels.ops`. The inverse-frequency math mirrors transformers' rope init functions
(default, linear, llama3) operation by operation in fp32, so cos/sin agree bit for bit; they are
cast to the activation dtype only at use, as transformers does.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from ..engine.errors import UnsupportedModelError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_type_of(rope_scaling: dict[str, Any] | None) -> str:
    """The rope type named by a rope_scaling / rope_parameters dict (old configs say "type")."""
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))


def _inverse_frequencies(head_dim: int, base: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (base ** exponents)  # [head_dim // 2] fp32
    rope_type = rope_type_of(rope_scaling)
    if rope_type == "default":
        return inv_freq
    assert rope_scaling is not None
    factor = float(rope_scaling["factor"])
    if rope_type == "linear":
        return inv_freq / factor
    if rope_type == "llama3":
        low_freq_factor = rope_scaling["low_freq_factor"]
        high_freq_factor = rope_scaling["high_freq_factor"]
        original_len = rope_scaling["original_max_position_embeddings"]
        low_freq_wavelen = original_len / low_freq_factor
        high_freq_wavelen = original_len / high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (original_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
        return torch.where(is_medium, blended, scaled)
    raise UnsupportedModelError(
        f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")


def build_rope_cache(
    head_dim: int,
    max_position: int,
    base: float,
    rope_scaling: dict[str, Any] | None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [max_position, head_dim]: cos in the first half, sin in the second
    inv_freq = _inverse_frequencies(head_dim, float(base), rope_scaling)
    positions = torch.arange(max_position, dtype=torch.int64).to(torch.float32)
    freqs = positions[:, None] * inv_freq[None, :]  # [max_position, head_dim // 2]
    return torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(
    positions: torch.Tensor,     # [num_tokens] int64
    query: torch.Tensor,         # [num_tokens, num_q_heads, head_dim]
    key: torch.Tensor,           # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query and key by their tokens' positions; returns new (query, key)."""
    cos_sin = cos_sin_cache.index_select(0, positions.to(torch.long))  # [num_tokens, head_dim]
    half = cos_sin.shape[-1] // 2
    cos = cos_sin[:, :half].repeat(1, 2).unsqueeze(1)  # [num_tokens, 1, head_dim]
    sin = cos_sin[:, half:].repeat(1, 2).unsqueeze(1)
    cos_q, sin_q = cos.to(query.dtype), sin.to(query.dtype)
    cos_k, sin_k = cos.to(key.dtype), sin.to(key.dtype)
    query = query * cos_q + _rotate_half(query) * sin_q
    key = key * cos_k + _rotate_half(key) * sin_k
    return query, key
