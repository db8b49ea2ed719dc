"""Triton NeoX (rotate-half) rotary embedding: the GPU version of `rotary_ref.apply_rotary`.

Bound for CUDA by `kernels.ops.get_ops`; called by every attention layer on the fresh q/k.
One program per token reads its cos/sin row once and rotates every query and key head.
Like the reference it returns new tensors. With bf16 activations it mirrors the reference's
roundings (cos/sin to bf16, each product, then the sum), so it agrees bit for bit; in fp32 a
GPU may fuse a multiply-add, a difference of an ulp.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import next_pow2, round_to_bf16


@triton.jit
def _maybe_round(x, ROUND: tl.constexpr):
    if ROUND:
        x = round_to_bf16(x)
    return x


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, token, stride_t, stride_h, num_heads, cos, sin, half,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr, ROUND: tl.constexpr):
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (heads < num_heads) & (dims < half)
    src = src_ptr + token * stride_t + heads * stride_h + dims
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)          # [BLOCK_H, BLOCK_HALF]
    x2 = tl.load(src + half, mask=mask, other=0.0).to(tl.float32)
    # rotate_half(x) = (-x2, x1): out = x * cos + rotate_half(x) * sin, each op rounded as torch does.
    out1 = _maybe_round(_maybe_round(x1 * cos, ROUND) + _maybe_round(-x2 * sin, ROUND), ROUND)
    out2 = _maybe_round(_maybe_round(x2 * cos, ROUND) + _maybe_round(x1 * sin, ROUND), ROUND)
    dst = dst_ptr + token * num_heads * 2 * half + heads * 2 * half + dims
    tl.store(dst, out1.to(dst_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + half, out2.to(dst_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    positions_ptr, query_ptr, key_ptr, cos_sin_ptr, query_out_ptr, key_out_ptr,
    stride_query_t, stride_query_h, stride_key_t, stride_key_h, stride_cos_sin,
    num_q_heads, num_kv_heads, half,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr, ROUND: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + token).to(tl.int64)
    dims = tl.arange(0, BLOCK_HALF)[None, :]
    row = cos_sin_ptr + position * stride_cos_sin + dims
    cos = _maybe_round(tl.load(row, mask=dims < half, other=0.0).to(tl.float32), ROUND)   # [1, BLOCK_HALF]
    sin = _maybe_round(tl.load(row + half, mask=dims < half, other=0.0).to(tl.float32), ROUND)
    _rotate_heads(query_ptr, query_out_ptr, token, stride_query_t, stride_query_h, num_q_heads,
                  cos, sin, half, BLOCK_HQ, BLOCK_HALF, ROUND)
    _rotate_heads(key_ptr, key_out_ptr, token, stride_key_t, stride_key_h, num_kv_heads,
                  cos, sin, half, BLOCK_HK, BLOCK_HALF, ROUND)


def apply_rotary(
    positions: torch.Tensor,      # [num_tokens] int64
    query: torch.Tensor,          # [num_tokens, num_q_heads, head_dim]
    key: torch.Tensor,            # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate query and key by their tokens' positions; returns new (query, key)."""
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    assert query.dtype == key.dtype, "one rounding mode serves both"
    query = query if query.stride(-1) == 1 else query.contiguous()
    key = key if key.stride(-1) == 1 else key.contiguous()
    cos_sin_cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    query_out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    key_out = torch.empty(key.shape, dtype=key.dtype, device=key.device)
    if num_tokens == 0:
        return query_out, key_out
    half = head_dim // 2
    _rotary_kernel[(num_tokens,)](
        positions, query, key, cos_sin_cache, query_out, key_out,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), cos_sin_cache.stride(0),
        num_q_heads, num_kv_heads, half,
        BLOCK_HQ=next_pow2(num_q_heads), BLOCK_HK=next_pow2(num_kv_heads), BLOCK_HALF=next_pow2(half),
        ROUND=query.dtype == torch.bfloat16,
    )
    return query_out, key_out
