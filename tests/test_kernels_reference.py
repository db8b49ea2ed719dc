"""Tests of the plain PyTorch reference kernels against independent naive implementations.

Oracles: a per-request, per-head float64 softmax over K/V rebuilt from the dense tensors the test
generated (not read back through block tables), Python-loop cache writes, and transformers'
own LlamaRMSNorm / LlamaRotaryEmbedding / apply_rotary_pos_emb.
Tolerances: fp32 inputs within 1e-5 of the float64 oracle; bf16 inputs within 2e-2 of the fp32
oracle on the same (bf16-rounded) inputs, i.e. one bf16 rounding of outputs of size ~1.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from vbatch.kernels.attention_metadata import AttentionMetadata
from vbatch.kernels.ops import REFERENCE_OPS, build_rope_cache, get_ops

torch.set_num_threads(1)


def make_metadata(context_lens: list[int], query_lens: list[int], block_size: int,
                  num_blocks: int, rng: random.Random) -> AttentionMetadata:
    """Random, shuffled, non-contiguous block tables for the given per-request lengths."""
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_needed = [-(-s // block_size) for s in seq_lens]
    free = list(range(num_blocks))
    rng.shuffle(free)
    assert sum(blocks_needed) <= num_blocks
    tables = [[free.pop() for _ in range(n)] for n in blocks_needed]
    max_blocks = max(blocks_needed)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slots = []
    for r, table in enumerate(tables):
        block_tables[r, :len(table)] = torch.tensor(table, dtype=torch.int32)
        for p in range(context_lens[r], seq_lens[r]):
            slots.append(table[p // block_size] * block_size + p % block_size)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        context_lens=torch.tensor(context_lens, dtype=torch.int32),
        block_tables=block_tables, block_size=block_size,
        max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_list=tuple(query_lens), seq_lens_list=tuple(seq_lens))


def naive_attention(query, keys, values, context_lens, query_lens, scale):
    """float64, per request, per head: softmax(q k^T * scale) v with a shifted causal mask."""
    num_q_heads, num_kv_heads = query.shape[1], keys[0].shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(query.shape, dtype=torch.float64)
    start = 0
    for r, (ctx, qlen) in enumerate(zip(context_lens, query_lens)):
        for h in range(num_q_heads):
            q = query[start:start + qlen, h].double()          # [qlen, D]
            k = keys[r][:, h // group].double()                 # [seq, D]
            v = values[r][:, h // group].double()
            scores = q @ k.T * scale                            # [qlen, seq]
            for i in range(qlen):
                scores[i, ctx + i + 1:] = float("-inf")
            out[start:start + qlen, h] = torch.softmax(scores, dim=-1) @ v
        start += qlen
    return out


def run_case(context_lens, query_lens, num_q_heads, num_kv_heads, block_size, dtype, seed=0):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    head_dim = 16
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    num_blocks = sum(-(-s // block_size) for s in seq_lens) + 5
    attn = make_metadata(context_lens, query_lens, block_size, num_blocks, rng)
    keys = [torch.randn(s, num_kv_heads, head_dim).to(dtype) for s in seq_lens]
    values = [torch.randn(s, num_kv_heads, head_dim).to(dtype) for s in seq_lens]
    query = torch.randn(sum(query_lens), num_q_heads, head_dim).to(dtype)
    # Never-written slots hold NaN: attention must not read them (or let them leak).
    key_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    value_cache = key_cache.clone()
    for r in range(len(seq_lens)):
        for p in range(seq_lens[r]):
            block = int(attn.block_tables[r, p // block_size])
            key_cache[block, p % block_size] = keys[r][p]
            value_cache[block, p % block_size] = values[r][p]
    scale = 1.0 / math.sqrt(head_dim)
    got = REFERENCE_OPS.paged_attention(query, key_cache, value_cache, attn, scale)
    want = naive_attention(query, keys, values, context_lens, query_lens, scale)
    assert got.dtype == dtype and got.shape == query.shape
    return got, want


ATTENTION_CASES = {
    "prefill": ([0, 0, 0], [5, 17, 1]),
    "decode_mixed_lengths": ([3, 20, 9, 33], [1, 1, 1, 1]),
    "decode_equal_lengths": ([12, 12, 12], [1, 1, 1]),
    "chunked_prefill": ([8, 13, 0], [6, 3, 11]),
    "chunk_plus_decodes": ([16, 5, 0, 30], [7, 1, 4, 1]),
}


@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
@pytest.mark.parametrize("num_q_heads,num_kv_heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_attention_fp32(case, num_q_heads, num_kv_heads, block_size):
    got, want = run_case(*ATTENTION_CASES[case], num_q_heads, num_kv_heads, block_size, torch.float32)
    diff = (got.double() - want).abs().max().item()
    assert diff < 1e-5, f"max abs diff {diff:.3e}"


@pytest.mark.parametrize("case", sorted(ATTENTION_CASES))
def test_paged_attention_bf16(case):
    got, want = run_case(*ATTENTION_CASES[case], 8, 2, 4, torch.bfloat16, seed=1)
    diff = (got.double() - want).abs().max().item()
    assert diff < 2e-2, f"max abs diff {diff:.3e}"


def test_write_kv_cache_matches_loop():
    rng = random.Random(3)
    attn = make_metadata([4, 0, 9], [3, 6, 1], block_size=4, num_blocks=12, rng=rng)
    key = torch.randn(attn.num_tokens, 2, 8)
    value = torch.randn(attn.num_tokens, 2, 8)
    key_cache = torch.zeros(12, 4, 2, 8)
    value_cache = torch.zeros(12, 4, 2, 8)
    want_k, want_v = key_cache.clone(), value_cache.clone()
    for t, slot in enumerate(attn.slot_mapping.tolist()):
        want_k[slot // 4, slot % 4] = key[t]
        want_v[slot // 4, slot % 4] = value[t]
    REFERENCE_OPS.write_kv_cache(key, value, key_cache, value_cache, attn.slot_mapping)
    assert torch.equal(key_cache, want_k) and torch.equal(value_cache, want_v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_transformers(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    torch.manual_seed(0)
    norm = LlamaRMSNorm(32, eps=1e-6)
    norm.weight.data = torch.randn(32).to(dtype)
    x = torch.randn(7, 32).to(dtype) * 3
    residual = torch.randn(7, 32).to(dtype)
    got = REFERENCE_OPS.rms_norm(x, norm.weight.data, 1e-6)
    assert torch.equal(got, norm(x)), f"max abs diff {(got - norm(x)).abs().max()}"
    normed, new_residual = REFERENCE_OPS.fused_add_rms_norm(x, residual, norm.weight.data, 1e-6)
    assert torch.equal(new_residual, x + residual)
    assert torch.equal(normed, norm(x + residual))


def test_silu_and_mul():
    x = torch.randn(5, 3, 12)
    gate, up = x[..., :6].double(), x[..., 6:].double()
    want = gate / (1 + torch.exp(-gate)) * up
    diff = (REFERENCE_OPS.silu_and_mul(x).double() - want).abs().max().item()
    assert diff < 1e-6, f"max abs diff {diff:.3e}"


ROPE_CASES = {
    "default": None,
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
}


@pytest.mark.parametrize("rope", sorted(ROPE_CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_transformers(rope, dtype):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    head_dim, theta = 32, 50000.0
    rope_parameters = {"rope_type": "default", **(ROPE_CASES[rope] or {}), "rope_theta": theta}
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, rope_parameters=rope_parameters)
    hf_rope = LlamaRotaryEmbedding(config)
    cache = build_rope_cache(head_dim, 256, theta, ROPE_CASES[rope])
    assert cache.shape == (256, head_dim) and cache.dtype == torch.float32
    torch.manual_seed(0)
    positions = torch.tensor([0, 1, 5, 31, 32, 100, 255])
    query = torch.randn(7, 4, head_dim).to(dtype)
    key = torch.randn(7, 2, head_dim).to(dtype)
    cos, sin = hf_rope(query, positions[None])  # [1, T, D]
    want_q, want_k = apply_rotary_pos_emb(query, key, cos[0], sin[0], unsqueeze_dim=1)
    got_q, got_k = get_ops("cpu").apply_rotary(positions, query, key, cache)
    diff = max((got_q - want_q).abs().max().item(), (got_k - want_k).abs().max().item())
    # Same fp32 inverse frequencies and cos/sin; only libm-level cos/sin differences may remain.
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    assert diff <= tol, f"max abs diff {diff:.3e}"
