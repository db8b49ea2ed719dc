"""Reference KV-cache write: scatter the step's new keys/values into their paged-cache slots.

Plain PyTorch: the specification, the CPU path and the oracle for any fast version. Called by
the model's attention layer (through `kernels.ops`) before `paged_attention`, so the new tokens
are visible to attention in the same step.
"""
from __future__ import annotations

import torch

# 8-bit caches (kv_cache_dtype fp8 / fp8_e5m2): saturated to the format's largest finite value, as
# vLLM stores them (torch's own .to() overflows E5M2 to inf), NaN kept
FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def write_kv_cache(
    key: torch.Tensor,           # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,         # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,     # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,   # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64: block * block_size + offset
) -> None:
    """Write token t's key/value at cache slot `slot_mapping[t]` (in place)."""
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    # A flat view aliases the cache storage, so index_copy_ writes through to it.
    flat_keys = key_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    flat_values = value_cache.view(num_blocks * block_size, num_kv_heads, head_dim)
    slots = slot_mapping.to(torch.long)
    if key_cache.dtype in FP8_KV_DTYPES:  # rounded to nearest even and saturated; copied as bytes (no fp8 index_copy_)
        limit = torch.finfo(key_cache.dtype).max
        flat_keys.view(torch.uint8).index_copy_(0, slots, key.float().clamp(-limit, limit).to(key_cache.dtype)
                                                 .view(torch.uint8))
        flat_values.view(torch.uint8).index_copy_(0, slots, value.float().clamp(-limit, limit)
                                                   .to(value_cache.dtype).view(torch.uint8))
        return
    flat_keys.index_copy_(0, slots, key.to(key_cache.dtype))
    flat_values.index_copy_(0, slots, value.to(value_cache.dtype))
