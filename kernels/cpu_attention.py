"""CPU paged attention: decode rows read the paged KV cache in place through one fused kernel.

Bound as `Ops.paged_attention` for bf16 on CPU (kernels/ops.py); same signature and contract as
`attention_ref.paged_attention`, which is its test oracle (tests/test_cpu_kernels.py).

    prepare_attention(attn) -> attn (once per step: adds the decode slot table)
    paged_attention(query, key_cache, value_cache, attn, scale)
      decode rows (query length 1)  -> decode_attention: one compiled kernel for the whole batch
      longer rows (prefill, chunks) -> per-request fp32 SDPA on its flash path (_attend_prefill)

NOTE: why a compiled kernel. The reference gathers every decode request's keys and values into a
padded copy, upcasts the copy to fp32 and runs SDPA: three passes over the KV bytes plus a write
of twice their size. `decode_attention` is written so inductor fuses the block-table lookup into
the two reductions (q.k over head_dim, p.v over positions): the cache is read once, in place, in
bf16, upcast in registers, softmax in fp32. Measured here (batch 64, lengths 128-640, bf16,
2 threads): 16-53 ms per layer for the reference vs 5 ms compiled (bf16 batched matmuls after a
block gather: 7 ms). The softmax runs over the last dim of [B, Hk, G, S] and only the batch,
block-table and cache sizes are dynamic (head counts, head_dim and block size are compiled in as
constants): 4.2-4.6 ms instead of 7 ms at batch 64, lengths 130-640. Inductor compiles it
when first called with new sizes ("automatic dynamic": the second shape makes the changed dims
symbolic, batch 1 is one more graph); the model runner's warm-up calls it with those shapes
before the first request and reports the time (about 10 s cold, less from inductor's on-disk
cache). If compilation fails, or VBATCH_CPU_COMPILE=0, the same function runs eagerly (slower,
same numbers).
NOTE: the slot table ([B, S] cache slot per position) is computed once per step by
`prepare_attention` (bound as `Ops.prepare_attention`, called by the model's forward) and shared
by all layers: inside the compiled kernel inductor redid the block-table gather per element
(batch 64 x 450: 7.4 -> 4.5 ms per layer, same process, interleaved).
NOTE: padding positions (past a request's length, up to the batch's longest) re-read the
request's last real token, as in the reference: finite data that the -inf mask then hides.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .attention_metadata import AttentionMetadata
from .attention_ref import attend_prefills, split_requests

logger = logging.getLogger("vbatch.kernels")


def decode_slots(
    block_tables: torch.Tensor,  # [B, max_num_blocks] int32/int64
    seq_lens: torch.Tensor,      # [B] int
    block_size: int,
) -> torch.Tensor:               # [B, S] int64, S = max(2, max_num_blocks) * block_size
    """Cache slot of every (request, position) a decode step reads; positions past a request's
    length repeat its last token (finite data that the kernel's -inf mask then hides).

    NOTE: computed once per step (`prepare_attention`), not inside the compiled kernel: there
    inductor redid the gather/div/mod per score and per p.v element (measured 1.6x slower at batch
    64 x 450 tokens). One-column tables get a zero column: a table width of 1 would be a static
    specialisation of its own; the clamp means the extra column is never read."""
    if block_tables.shape[1] < 2:
        block_tables = F.pad(block_tables, (0, 2 - block_tables.shape[1]))
    max_len = block_tables.shape[1] * block_size
    positions = torch.arange(max_len, device=block_tables.device)                     # [S]
    clamped = torch.minimum(positions[None, :], seq_lens[:, None].to(torch.int64) - 1)  # [B, S]
    blocks = block_tables.to(torch.int64).gather(1, torch.div(clamped, block_size, rounding_mode="floor"))
    return blocks * block_size + clamped % block_size


def decode_attention(
    query: torch.Tensor,         # [B, num_q_heads, head_dim]
    key_cache: torch.Tensor,     # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,   # [num_blocks, block_size, num_kv_heads, head_dim]
    slots: torch.Tensor,         # [B, S] int64 from decode_slots
    seq_lens: torch.Tensor,      # [B] int: tokens in the cache per request (including this step's)
    scale: float,
) -> torch.Tensor:               # [B, num_q_heads, head_dim], dtype of query
    num_reqs, max_len = slots.shape
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    group = query.shape[1] // num_kv_heads
    positions = torch.arange(max_len, device=query.device)                            # [S]
    keys = key_cache.view(num_blocks * block_size, num_kv_heads, head_dim)[slots]      # [B, S, Hk, D]
    values = value_cache.view(num_blocks * block_size, num_kv_heads, head_dim)[slots]  # [B, S, Hk, D]
    # Elementwise products summed (not matmul): inductor keeps the gather inside the reductions.
    q = query.view(num_reqs, 1, num_kv_heads, group, head_dim).float()
    scores = (q * keys.view(num_reqs, max_len, num_kv_heads, 1, head_dim).float()).sum(-1) * scale  # [B, S, Hk, G]
    # Softmax over the last dim ([B, Hk, G, S]): inductor's row reductions are contiguous there
    # (measured 1.7x faster than reducing over dim 1 of [B, S, Hk, G]).
    scores = scores.permute(0, 2, 3, 1)                                                 # [B, Hk, G, S]
    valid = positions[None, :] < seq_lens[:, None]                                      # [B, S]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).permute(0, 3, 1, 2)                          # [B, S, Hk, G] fp32
    out = (probs[..., None] * values.view(num_reqs, max_len, num_kv_heads, 1, head_dim).float()).sum(1)
    return out.reshape(num_reqs, num_kv_heads * group, head_dim).to(query.dtype)       # [B, Hq, D]


@dataclass(frozen=True)
class CpuAttentionMetadata(AttentionMetadata):
    """AttentionMetadata plus what every layer's decode attention shares within one step."""

    decode_slots: torch.Tensor | None = None  # [B, S] int64 (decode-only steps), from decode_slots


def prepare_attention(attn: AttentionMetadata) -> AttentionMetadata:
    """Once per forward (`Ops.prepare_attention`): the slot table all layers of a decode step read."""
    if not attn.is_decode_only or isinstance(attn, CpuAttentionMetadata):
        return attn
    fields = {f.name: getattr(attn, f.name) for f in dataclasses.fields(AttentionMetadata)}
    return CpuAttentionMetadata(**fields, decode_slots=decode_slots(attn.block_tables, attn.seq_lens,
                                                                    attn.block_size))


_compiled = None


def _inductor_options() -> dict:
    """The vector width inductor generates for, named in its options: they are part of its on-disk
    cache key, and the width it picks by itself is not.

    NOTE: inductor's FX graph cache keys an entry without the CPU instruction set it was generated
    for, so a process held to AVX2 (ATEN_CPU_CAPABILITY=avx2: the Zen 3 emulation, bench/peers.py's
    instruction-set hold) and a later one on the AVX-512 default shared an entry: its C++ was written
    for 8-lane vectors and then built for 16, and the kernel wrote past its buffers (garbage outputs,
    then glibc's "double free or corruption" and an abort; the CI run of session 15 hung in that
    abort). Measured on the Intel Xeon: with the width named, each instruction set gets its own entry
    (tests/test_cpu_kernels.py::test_compiled_decode_attention_survives_a_cache_from_another_isa)."""
    try:
        from torch._inductor.cpu_vec_isa import pick_vec_isa
        width = pick_vec_isa().bit_width()
    except Exception as e:  # noqa: BLE001 - a private inductor API: without it, inductor's defaults
        logger.debug("inductor's vector ISA not known (%s)", e)
        return {}
    return {"cpp.simdlen": width} if width else {}


def _decode_kernel():
    """decode_attention compiled by inductor once per process (eager when disabled or on failure)."""
    global _compiled
    if _compiled is None:
        if os.environ.get("VBATCH_CPU_COMPILE", "1") == "0":
            _compiled = decode_attention
        else:
            try:
                _compiled = torch.compile(decode_attention, dynamic=None, fullgraph=True, options=_inductor_options())
            except Exception as e:  # noqa: BLE001 - any compiler problem degrades to eager, loudly
                logger.warning("torch.compile unavailable for CPU decode attention (%s); running eagerly", e)
                _compiled = decode_attention
    return _compiled


def _run_decode(query, key_cache, value_cache, slots, seq_lens, scale) -> torch.Tensor:
    global _compiled
    args = (query, key_cache, value_cache, slots, seq_lens, scale)
    kernel = _decode_kernel()
    if kernel is decode_attention:
        return kernel(*args)
    try:
        return kernel(*args)
    except Exception as e:  # noqa: BLE001 - a compiler failure at first call (no gcc, ...) falls back
        logger.warning("compiled CPU decode attention failed (%s: %s); running eagerly", type(e).__name__, e)
        _compiled = decode_attention
        return decode_attention(*args)


def _attend_prefill(
    query: torch.Tensor,  # [query_len, num_q_heads, head_dim]
    key: torch.Tensor,    # [seq_len, num_kv_heads, head_dim] fp32
    value: torch.Tensor,  # [seq_len, num_kv_heads, head_dim] fp32
    scale: float,
) -> torch.Tensor:        # [query_len, num_q_heads, head_dim] fp32
    """`attention_ref._attend_one_request` through SDPA's 4-D (flash) CPU path.

    NOTE: 3-D inputs send SDPA to its math path; with a leading batch dim of 1 it takes the
    flash kernel, and a prompt with no cached prefix needs no mask at all (is_causal). Measured
    here (2 threads, 9/3 heads, head_dim 64, fp32): 400 tokens 7.7 -> 3.0 ms, 128: 0.68 -> 0.39."""
    query_len, seq_len = query.shape[0], key.shape[0]
    q = query.float().transpose(0, 1).unsqueeze(0)  # [1, Hq, Q, D]
    k, v = key.transpose(0, 1).unsqueeze(0), value.transpose(0, 1).unsqueeze(0)  # [1, Hk, S, D]
    if query_len == seq_len:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        # Query i sits at absolute position seq_len - query_len + i: the causal diagonal shifted.
        query_positions = torch.arange(query_len, device=query.device) + (seq_len - query_len)
        mask = torch.arange(seq_len, device=query.device)[None, :] <= query_positions[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def paged_attention(
    query: torch.Tensor,        # [num_tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor,    # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    attn: AttentionMetadata,
    scale: float,
) -> torch.Tensor:              # [num_tokens, num_q_heads, head_dim], dtype of query
    assert query.shape[1] % key_cache.shape[2] == 0, "num_q_heads must be a multiple of num_kv_heads"
    if attn.is_decode_only:     # the common step: no per-request Python at all
        slots = getattr(attn, "decode_slots", None)
        if slots is None:  # called without prepare_attention (tests, other callers)
            slots = decode_slots(attn.block_tables, attn.seq_lens, key_cache.shape[1])
        return _run_decode(query, key_cache, value_cache, slots, attn.seq_lens, scale)
    out = torch.empty_like(query)
    parts = split_requests(attn)
    attend_prefills(query, key_cache, value_cache, attn, parts, scale, _attend_prefill, out)
    if parts.decode_reqs:
        req_index = torch.tensor(parts.decode_reqs, device=query.device)
        token_index = torch.tensor(parts.decode_tokens, device=query.device)
        seq_lens = attn.seq_lens.index_select(0, req_index)
        slots = decode_slots(attn.block_tables.index_select(0, req_index), seq_lens, key_cache.shape[1])
        rows = _run_decode(query.index_select(0, token_index), key_cache, value_cache, slots, seq_lens, scale)
        out.index_copy_(0, token_index, rows)
    return out
