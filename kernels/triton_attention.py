"""Triton paged attention over block tables: the GPU version of `attention_ref.paged_attention`.

Bound for CUDA by `kernels.ops.get_ops`; called by every attention layer after the KV write.
One kernel serves decode, prefill, prefill on a cached prefix and chunked prefill (any mix),
with grouped-query attention. A program owns one kv head and a block of BLOCK_Q consecutive
query tokens of one request; its rows are those tokens times the q heads that share the kv
head (row m: token m // QPK_PAD, head m % QPK_PAD of the group), so each K/V tile read from
the cache serves the whole group. K/V tiles of TILE_N positions are gathered through the block
table and folded in with an online softmax (fp32 running max, sum and accumulator).

Program -> (request, query block): request r's query blocks are numbered from
`query_start_loc[r] // BLOCK_Q + r`, so `num_tokens // BLOCK_Q + num_reqs` programs cover every
block and a binary search over query_start_loc (a constexpr number of steps) finds a program's
request; programs past their request's last block return at once. A decode-only step
(every query length 1) skips the search: program r is request r. That path reads only device
tensors (no Python lists), so it can be captured in a CUDA graph.

NOTE: masked loads replace out-of-range K/V with 0 and masked scores with -inf, so blocks the
request never wrote (NaN bit patterns, other requests' data) are never read.
NOTE: on a GPU with bf16/fp16 caches both matmuls run in the cache dtype with fp32
accumulation (the probabilities are rounded to that dtype for P @ V, as flash attention does);
fp32 caches, and the interpreter (whose bf16 dot is wrong), use exact fp32 dots.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention_metadata import AttentionMetadata
from .triton_common import INTERPRET, STATIC_LOOPS, next_pow2, round_to_bf16

TILE_N = 64          # K/V positions per inner step
PREFILL_ROWS = 64    # target rows (query tokens x group heads) per prefill program


@triton.jit
def _attend_tile(
    j, q, m_i, l_i, acc, req, kv_head, kv_len, row_pos,
    key_cache_ptr, value_cache_ptr, block_tables_ptr,
    stride_k_block, stride_k_slot, stride_k_head, stride_v_block, stride_v_slot, stride_v_head,
    stride_table, head_dim, block_size, scale,
    BLOCK_D: tl.constexpr, TILE_N: tl.constexpr, LOW_PRECISION_DOT: tl.constexpr,
):
    key_pos = j * TILE_N + tl.arange(0, TILE_N)                       # [TILE_N]
    key_valid = key_pos < kv_len
    block = tl.load(block_tables_ptr + req.to(tl.int64) * stride_table + key_pos // block_size,
                    mask=key_valid, other=0).to(tl.int64)
    slot = (key_pos % block_size).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    kv_mask = key_valid[:, None] & (dims < head_dim)[None, :]
    k = tl.load(key_cache_ptr + block[:, None] * stride_k_block + slot[:, None] * stride_k_slot
                + kv_head * stride_k_head + dims[None, :], mask=kv_mask, other=0.0)  # [TILE_N, BLOCK_D]
    v = tl.load(value_cache_ptr + block[:, None] * stride_v_block + slot[:, None] * stride_v_slot
                + kv_head * stride_v_head + dims[None, :], mask=kv_mask, other=0.0)
    if LOW_PRECISION_DOT:
        scores = tl.dot(q, tl.trans(k))
    else:
        scores = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    scores = scores * scale                                              # [BLOCK_M, TILE_N]
    visible = key_valid[None, :] & (key_pos[None, :] <= row_pos[:, None])
    scores = tl.where(visible, scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    # Rows that have seen nothing yet keep -inf; subtracting a finite stand-in avoids inf - inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if LOW_PRECISION_DOT:
        pv = tl.dot(p.to(v.dtype), v)
    else:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    acc = acc * alpha[:, None] + pv
    return m_new, l_i, acc


@triton.jit
def _paged_attention_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, out_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_ptr,
    scale, num_reqs,
    stride_q_token, stride_q_head, stride_o_token, stride_o_head,
    stride_k_block, stride_k_slot, stride_k_head, stride_v_block, stride_v_slot, stride_v_head,
    stride_table, num_queries_per_kv, head_dim, block_size,
    IS_DECODE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, QPK_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr, TILE_N: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    STATIC_LOOPS: tl.constexpr, MAX_TILES: tl.constexpr,
    LOW_PRECISION_DOT: tl.constexpr, ROUND_OUT: tl.constexpr,
):
    pid = tl.program_id(0)
    kv_head = tl.program_id(1)
    if IS_DECODE:
        req = pid
        q_block = pid * 0
    else:
        # Largest r with first_block(r) <= pid; first_block is strictly increasing in r.
        lo = pid * 0
        hi = lo + num_reqs
        for _ in range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            go_right = tl.load(query_start_ptr + mid) // BLOCK_Q + mid <= pid
            lo = tl.where(go_right, mid, lo)
            hi = tl.where(go_right, hi, mid)
        req = lo
        q_block = pid - (tl.load(query_start_ptr + req) // BLOCK_Q + req)
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    context_len = tl.load(seq_lens_ptr + req) - q_len
    q_first = q_block * BLOCK_Q
    if q_first >= q_len:
        return

    rows = tl.arange(0, BLOCK_M)
    row_q = q_first + rows // QPK_PAD                     # query index inside the request
    row_head = rows % QPK_PAD
    row_valid = (rows // QPK_PAD < BLOCK_Q) & (row_q < q_len) & (row_head < num_queries_per_kv)
    head = (kv_head * num_queries_per_kv + row_head).to(tl.int64)
    token = (q_start + row_q).to(tl.int64)
    row_pos = context_len + row_q                         # absolute position of each row's query
    dims = tl.arange(0, BLOCK_D)
    q_mask = row_valid[:, None] & (dims < head_dim)[None, :]
    q = tl.load(query_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
                mask=q_mask, other=0.0)                   # [BLOCK_M, BLOCK_D]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    kv_len = context_len + tl.minimum(q_first + BLOCK_Q, q_len)   # keys the last row of the block sees
    if STATIC_LOOPS:
        for j in range(MAX_TILES):   # surplus tiles are fully masked (see triton_common)
            m_i, l_i, acc = _attend_tile(
                j, q, m_i, l_i, acc, req, kv_head, kv_len, row_pos,
                key_cache_ptr, value_cache_ptr, block_tables_ptr,
                stride_k_block, stride_k_slot, stride_k_head, stride_v_block, stride_v_slot, stride_v_head,
                stride_table, head_dim, block_size, scale, BLOCK_D, TILE_N, LOW_PRECISION_DOT)
    else:
        for j in range(0, tl.cdiv(kv_len, TILE_N)):
            m_i, l_i, acc = _attend_tile(
                j, q, m_i, l_i, acc, req, kv_head, kv_len, row_pos,
                key_cache_ptr, value_cache_ptr, block_tables_ptr,
                stride_k_block, stride_k_slot, stride_k_head, stride_v_block, stride_v_slot, stride_v_head,
                stride_table, head_dim, block_size, scale, BLOCK_D, TILE_N, LOW_PRECISION_DOT)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    if ROUND_OUT:
        out = round_to_bf16(out)
    tl.store(out_ptr + token[:, None] * stride_o_token + head[:, None] * stride_o_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_attention(
    query: torch.Tensor,        # [num_tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor,    # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    attn: AttentionMetadata,
    scale: float,
) -> torch.Tensor:              # [num_tokens, num_q_heads, head_dim], dtype of query
    num_tokens, num_q_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    assert num_q_heads % num_kv_heads == 0, "num_q_heads must be a multiple of num_kv_heads"
    query = query if query.stride(-1) == 1 else query.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    num_reqs = attn.num_reqs
    if num_tokens == 0 or num_reqs == 0:
        return out
    queries_per_kv = num_q_heads // num_kv_heads
    qpk_pad = next_pow2(queries_per_kv)
    if attn.is_decode_only:
        block_q, num_programs = 1, num_reqs
    else:
        block_q = max(1, PREFILL_ROWS // qpk_pad)
        num_programs = num_tokens // block_q + num_reqs
    # tl.dot needs every dimension >= 16.
    block_m = max(16, block_q * qpk_pad)
    low_precision = (not INTERPRET) and key_cache.dtype in (torch.bfloat16, torch.float16) \
        and query.dtype == key_cache.dtype
    max_tiles = next_pow2(-(-attn.max_seq_len // TILE_N)) if STATIC_LOOPS else 1
    _paged_attention_kernel[(num_programs, num_kv_heads)](
        query, key_cache, value_cache, out,
        attn.block_tables, attn.seq_lens, attn.query_start_loc,
        scale, num_reqs,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        attn.block_tables.stride(0), queries_per_kv, head_dim, block_size,
        IS_DECODE=attn.is_decode_only, BLOCK_Q=block_q, BLOCK_M=block_m, QPK_PAD=qpk_pad,
        BLOCK_D=max(16, next_pow2(head_dim)), TILE_N=TILE_N,
        SEARCH_STEPS=1 if attn.is_decode_only else num_reqs.bit_length(),
        STATIC_LOOPS=STATIC_LOOPS, MAX_TILES=max_tiles,
        LOW_PRECISION_DOT=low_precision, ROUND_OUT=query.dtype == torch.bfloat16,
    )
    return out
