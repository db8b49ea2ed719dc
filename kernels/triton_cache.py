"""Triton KV-cache write: the GPU version of `cache_ref.write_kv_cache` (same signature).

Bound for CUDA by `kernels.ops.get_ops`; called by every attention layer before paged
attention. One program per token copies that token's keys and values (all kv heads) into
cache slot `slot_mapping[t]`. The values are copied, not computed, so the result equals the
reference bit for bit whenever the cache dtype equals the activation dtype (as in the engine;
a narrowing copy rounds to nearest on a GPU but truncates under the interpreter).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import next_pow2


@triton.jit
def _write_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr,
    stride_key_t, stride_key_h, stride_value_t, stride_value_h,
    num_kv_heads, head_dim,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < num_kv_heads) & (dims < head_dim)
    # The cache is contiguous [num_blocks * block_size, num_kv_heads, head_dim] seen flat.
    cache_offsets = slot * num_kv_heads * head_dim + heads * head_dim + dims
    key = tl.load(key_ptr + token * stride_key_t + heads * stride_key_h + dims, mask=mask)
    value = tl.load(value_ptr + token * stride_value_t + heads * stride_value_h + dims, mask=mask)
    tl.store(key_cache_ptr + cache_offsets, key.to(key_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(value_cache_ptr + cache_offsets, value.to(value_cache_ptr.dtype.element_ty), mask=mask)


def write_kv_cache(
    key: torch.Tensor,           # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,         # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,     # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,   # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64: block * block_size + offset
) -> None:
    """Write token t's key/value at cache slot `slot_mapping[t]` (in place)."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    assert key_cache.is_contiguous() and value_cache.is_contiguous()
    # The kernel steps the last dim with stride 1; a model's q/k/v views already have it.
    key = key if key.stride(-1) == 1 else key.contiguous()
    value = value if value.stride(-1) == 1 else value.contiguous()
    _write_kv_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        num_kv_heads, head_dim,
        BLOCK_H=next_pow2(num_kv_heads), BLOCK_D=next_pow2(head_dim),
    )
