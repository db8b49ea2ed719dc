"""Reference paged attention (plain PyTorch): the specification, CPU path and test oracle.

Called by every attention layer through `kernels.ops`, after `write_kv_cache` has put this
step's keys/values into the cache. One routine serves decode, prefill, prefill on a cached
prefix and chunked prefill: request r's query token i sits at absolute position
context_lens[r] + i and attends causally to cache positions 0..that position, read through
its block table.

NOTE: q, k and v are upcast to fp32 before SDPA and the result cast back: softmax in fp32 is
the accuracy contract, and on this CPU bf16 SDPA is 6-12x slower than fp32 anyway.
NOTE: decode requests (query length 1) of any lengths go through one padded SDPA call. Padding
positions gather the request's own last token rather than whatever the padded block-table
entries point at: never-written cache blocks may hold NaN bit patterns, and 0 * NaN would leak
through the masked softmax (zeroing with masked_fill instead costs more than the attention). Requests with longer queries loop in Python
(one SDPA each); a later issue may batch them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention_metadata import AttentionMetadata


def _gather_request_kv(
    cache: torch.Tensor,        # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_num_blocks] int32
    seq_len: int,
) -> torch.Tensor:              # [seq_len, num_kv_heads, head_dim] fp32
    _, block_size, num_kv_heads, head_dim = cache.shape
    num_blocks = -(-seq_len // block_size)
    blocks = cache.index_select(0, block_table[:num_blocks].to(torch.long))
    return blocks.reshape(num_blocks * block_size, num_kv_heads, head_dim)[:seq_len].float()


def _attend_one_request(
    query: torch.Tensor,  # [query_len, num_q_heads, head_dim]
    key: torch.Tensor,    # [seq_len, num_kv_heads, head_dim] fp32
    value: torch.Tensor,  # [seq_len, num_kv_heads, head_dim] fp32
    scale: float,
) -> torch.Tensor:        # [query_len, num_q_heads, head_dim] fp32
    query_len, seq_len = query.shape[0], key.shape[0]
    context_len = seq_len - query_len
    # Query i may see keys 0..context_len + i (the causal diagonal shifted by the cached prefix).
    query_positions = torch.arange(query_len, device=query.device) + context_len
    mask = torch.arange(seq_len, device=query.device)[None, :] <= query_positions[:, None]
    out = F.scaled_dot_product_attention(
        query.float().transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1),
        attn_mask=mask, scale=scale, enable_gqa=True)  # [num_q_heads, query_len, head_dim]
    return out.transpose(0, 1)


def _attend_decode_batch(
    query: torch.Tensor,         # [num_decodes, num_q_heads, head_dim]
    key_cache: torch.Tensor,     # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,   # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_decodes, max_num_blocks] int32
    seq_lens: list[int],
    scale: float,
) -> torch.Tensor:               # [num_decodes, num_q_heads, head_dim] fp32
    num_decodes, max_len = len(seq_lens), max(seq_lens)
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    lens = torch.tensor(seq_lens, device=query.device)
    positions = torch.arange(max_len, device=query.device)
    # Padding positions re-read the request's last real token: finite data the mask then hides.
    clamped = torch.minimum(positions[None, :], lens[:, None] - 1)  # [B, S]
    slots = (block_tables.to(torch.long).gather(1, clamped // block_size) * block_size
             + clamped % block_size).flatten()

    def gather(cache: torch.Tensor) -> torch.Tensor:  # -> [B, num_kv_heads, S, head_dim] fp32
        flat = cache.view(num_blocks * block_size, num_kv_heads, head_dim)
        rows = flat.index_select(0, slots).view(num_decodes, max_len, num_kv_heads, head_dim)
        return rows.float().transpose(1, 2)

    # Equal lengths need no mask, which lets SDPA take its fastest path.
    mask = None
    if min(seq_lens) != max_len:
        mask = (positions[None, :] < lens[:, None])[:, None, None, :]  # [B, 1, 1, S]
    out = F.scaled_dot_product_attention(
        query.float().unsqueeze(2), gather(key_cache), gather(value_cache),
        attn_mask=mask, scale=scale, enable_gqa=True)  # [B, Hq, 1, D]
    return out.squeeze(2)


def paged_attention(
    query: torch.Tensor,        # [num_tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor,    # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    attn: AttentionMetadata,
    scale: float,
) -> torch.Tensor:              # [num_tokens, num_q_heads, head_dim], dtype of query
    assert query.shape[1] % key_cache.shape[2] == 0, "num_q_heads must be a multiple of num_kv_heads"
    out = torch.empty_like(query)
    parts = split_requests(attn)
    attend_prefills(query, key_cache, value_cache, attn, parts, scale, _attend_one_request, out)
    if parts.decode_reqs:
        req_index = torch.tensor(parts.decode_reqs, device=query.device)
        token_index = torch.tensor(parts.decode_tokens, device=query.device)
        rows = _attend_decode_batch(
            query.index_select(0, token_index), key_cache, value_cache,
            attn.block_tables.index_select(0, req_index),
            [attn.seq_lens_list[r] for r in parts.decode_reqs], scale)
        out.index_copy_(0, token_index, rows.to(out.dtype))
    return out


@dataclass(frozen=True)
class RequestParts:
    """A mixed batch split for attention: prefill/chunk pieces one by one, decodes together."""

    prefills: tuple[tuple[int, int, int, int], ...]   # (request, first token row, query_len, seq_len)
    decode_reqs: tuple[int, ...]                      # requests with query length 1
    decode_tokens: tuple[int, ...]                    # their token rows


def attend_prefills(query, key_cache, value_cache, attn: AttentionMetadata, parts: RequestParts, scale: float,
                    attend, out: torch.Tensor) -> None:
    """Prefill/chunk pieces one request at a time: gather its KV, `attend(q, k, v, scale)`, write rows."""
    for req, start, query_len, seq_len in parts.prefills:
        key = _gather_request_kv(key_cache, attn.block_tables[req], seq_len)
        value = _gather_request_kv(value_cache, attn.block_tables[req], seq_len)
        rows = attend(query[start:start + query_len], key, value, scale)
        out[start:start + query_len] = rows.to(out.dtype)


def split_requests(attn: AttentionMetadata) -> RequestParts:
    """Shared by every CPU attention path (reference and fast) so both split a batch alike."""
    prefills, decode_reqs, decode_tokens = [], [], []
    start = 0
    for req, (query_len, seq_len) in enumerate(zip(attn.query_lens_list, attn.seq_lens_list)):
        if query_len == 1:
            decode_reqs.append(req)
            decode_tokens.append(start)
        elif query_len > 1:
            prefills.append((req, start, query_len, seq_len))
        start += query_len
    return RequestParts(tuple(prefills), tuple(decode_reqs), tuple(decode_tokens))
