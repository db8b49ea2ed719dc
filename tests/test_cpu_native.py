"""The native paged attention (kernels/csrc/cpu_paged_attention.c via kernels/cpu_native.py) of every
CPU tier this machine runs.

Each test runs once per tier the CPU can execute (kernels/cpu_features.py; conftest.native_test_tiers:
an AVX-512 bf16 machine builds and tests all four tiers, an AVX2 machine avx2, portable and the
16-lane shape of the AVX-512 code in plain C) and per (activation, KV cache) variant. The other
kernels' tests: test_cpu_native_build.py (the build, its probes, get_ops), test_cpu_native_linear.py
(the small-rows linear), test_cpu_native_elementwise.py (norms, SiLU, rotary, KV write),
test_cpu_native_layer.py (the fused decoder layer).

Oracle: attention_ref. Tolerances: bf16 2e-2 (outputs O(1), rounded to bf16 once; q.k sums bf16
products in fp32, the softmax is online, rescaled per block); fp32 2e-5 of the fp32 SDPA reference
(summation order).
"""
from __future__ import annotations

import pytest
import torch

from native_params import CASES, random_step
from vbatch.kernels import attention_ref, cpu_native
from vbatch.kernels.cpu_native_ops import NativeOps

ATTN_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
# (head_dim, query heads per kv head): the specialised copies (64/128 x 1-8), the generic one
# (96, 12 > 8) and odd numbers of 16-lane vectors (48, 16; the bf16 AVX-512 build then uses fp32 q.k).
SHAPES = [(64, 3), (64, 7), (128, 2), (32, 1), (96, 12), (48, 3), (16, 2)]


def _attention_error(native, case, variant, head_dim=64, group=3, threads=2, kv_heads=2):
    dtype = variant[0]
    query, key_cache, value_cache, attn, _ = random_step(case, variant, num_kv_heads=kv_heads, group=group,
                                                         head_dim=head_dim)
    scale = head_dim ** -0.5
    want = attention_ref.paged_attention(query, key_cache, value_cache, attn, scale)
    got = native.paged_attention(query, key_cache, value_cache, attn, scale, threads)
    assert got.dtype == dtype and got.shape == want.shape
    return (got.float() - want.float()).abs().max().item()


@pytest.mark.parametrize("case", list(CASES))
def test_native_attention_matches_reference(native, any_variant, case):
    assert _attention_error(native, case, any_variant) < ATTN_TOL[any_variant[0]]


@pytest.mark.parametrize("head_dim,group", SHAPES)
def test_native_attention_every_specialisation(native, any_variant, head_dim, group):
    for case in ("decode_ragged", "mixed_prefill_and_decode", "long_prefill_on_prefix", "prefill_block_32_on_prefix"):
        assert _attention_error(native, case, any_variant, head_dim, group) < ATTN_TOL[any_variant[0]], case


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_native_attention_same_rows_whatever_the_thread_count(native, variant, threads):
    # The work split changes with the thread count (per kv head when there are few requests);
    # every row is computed by one thread in a fixed order, so the results are bit-identical.
    query, key_cache, value_cache, attn, scale = random_step(([5, 40, 0], [1, 1, 9], 16), variant, num_kv_heads=3,
                                                       group=3, head_dim=64)
    one = native.paged_attention(query, key_cache, value_cache, attn, scale, 1)
    many = native.paged_attention(query, key_cache, value_cache, attn, scale, threads)
    assert torch.equal(one, many)


def _poison_unowned_slots(key_cache, value_cache, attn, block_size):
    """NaN keys and inf values in the slots past each request's length (the tail of its last block)
    and NaN in the blocks no request owns: a kernel that reads them shows it in its output."""
    for r, n in enumerate(attn.seq_lens_list):
        last = int(attn.block_tables[r][(n - 1) // block_size])
        key_cache[last, (n - 1) % block_size + 1:] = float("nan")
        value_cache[last, (n - 1) % block_size + 1:] = float("inf")
    owned = {int(b) for r, n in enumerate(attn.seq_lens_list) for b in attn.block_tables[r, :-(-n // block_size)]}
    for b in set(range(key_cache.shape[0])) - owned:
        key_cache[b], value_cache[b] = float("nan"), float("nan")


# Decode rows of a call with few query rows (under 4 on 16 lanes, under 2 on narrower registers) are
# split along their positions into a power of two of equal parts of at least 192 positions, rounded
# up to whole blocks, each part (every kv head) leaving its softmax state for the last of the row's
# parts to finish, which merges them (SPLIT_* in vb_attention.h). (context lengths, query lengths,
# block size, kv heads): 384 positions in two parts, 385 in 208 + 177, 383 whole, four parts of 256
# beside two rows left whole (16 lanes), a part of 256 and one of 144 at block size 128, a 2-row
# prefill beside the split row (16 lanes), 3,101 positions in 15 parts (at most 16, of 208).
SPLIT_STEPS = [([383], [1], 16, 3), ([384], [1], 16, 3), ([382], [1], 16, 3), ([999, 6, 200], [1, 1, 1], 8, 1),
               ([399], [1], 128, 3), ([400, 40], [1, 2], 32, 1), ([3100], [1], 16, 3)]


@pytest.mark.parametrize("step", SPLIT_STEPS, ids=lambda s: "-".join(map(str, s[0])) + f"-b{s[2]}-kv{s[3]}")
def test_native_attention_split_decode_rows_match_reference(native, any_variant, step):
    # Keys growing along the positions (x1 to x4) with large logits: the later parts' maxima lie tens
    # above the earlier ones', so a merge that did not rescale each part by e^(m_k - M) would be off
    # by orders of magnitude; NaN/inf past each request's length and in unowned blocks must stay unread.
    dtype, kv_dtype = any_variant
    query, key_cache, value_cache, attn, _ = random_step(step[:3], any_variant, num_kv_heads=step[3], group=3,
                                                         head_dim=64)
    query = (query.float() * 3).to(dtype)
    bs = step[2]
    keys = key_cache.float()
    for r, n in enumerate(attn.seq_lens_list):   # x1 at a request's first position, x4 at its last
        for pos, factor in enumerate(torch.linspace(1.0, 4.0, n).tolist()):
            keys[int(attn.block_tables[r][pos // bs]), pos % bs] *= factor
    key_cache = keys.to(kv_dtype)
    want = attention_ref.paged_attention(query, key_cache, value_cache, attn, 1.0)
    _poison_unowned_slots(key_cache, value_cache, attn, bs)
    got = {t: native.paged_attention(query, key_cache, value_cache, attn, 1.0, t) for t in (1, 2, 3)}
    assert torch.isfinite(got[2].float()).all()
    assert (got[2].float() - want.float()).abs().max().item() < 10 * ATTN_TOL[dtype]
    # the split reads only the call's shape: the same bits on any number of threads
    assert torch.equal(got[1], got[2]) and torch.equal(got[1], got[3])


@pytest.mark.parametrize("block_size", [8, 16])  # 16: prefill rows take the tiled path
def test_native_attention_never_reads_unowned_slots(native, any_variant, block_size):
    # Slots past each request's length and blocks no request owns may hold anything (the cache is
    # allocated with torch.empty): NaN there must not reach the output.
    query, key_cache, value_cache, attn, scale = random_step(([2, 13, 30], [1, 1, 7], block_size), any_variant,
                                                             head_dim=64)
    want = attention_ref.paged_attention(query, key_cache, value_cache, attn, scale)
    _poison_unowned_slots(key_cache, value_cache, attn, block_size)
    got = native.paged_attention(query, key_cache, value_cache, attn, scale, 2)
    assert torch.isfinite(got.float()).all()
    assert (got.float() - want.float()).abs().max().item() < ATTN_TOL[any_variant[0]]


def test_native_attention_long_context_softmax_is_stable(native, any_variant):
    # Large logits (scores ~ +-60) over 2,000 positions: the online softmax must rescale exactly.
    dtype = any_variant[0]
    query, key_cache, value_cache, attn, _ = random_step(([1999], [1], 16), any_variant, head_dim=64)
    query = (query.float() * 8).to(dtype)
    want = attention_ref.paged_attention(query, key_cache, value_cache, attn, 1.0)
    got = native.paged_attention(query, key_cache, value_cache, attn, 1.0, 2)
    assert (got.float() - want.float()).abs().max().item() < 10 * ATTN_TOL[dtype]


def test_native_attention_tiled_path_rescales_when_the_max_moves(native, any_variant):
    # The many-row path keeps its running max until a score exceeds it by more than LAZY_MAX (8):
    # keys growing along the sequence make the max jump by tens at later chunks, and rows
    # that see only the early chunks never rescale. Large logits (+-100) on a prefix and a prefill.
    torch.manual_seed(3)
    dtype, kv_dtype = any_variant
    query, key_cache, value_cache, attn, _ = random_step(([30, 0], [50, 70], 16), any_variant, head_dim=64)
    query = (query.float() * 4).to(dtype)
    ramp = torch.linspace(0.2, 3.0, key_cache.shape[0] * key_cache.shape[1]).view(key_cache.shape[0], -1, 1, 1)
    key_cache = (key_cache.float() * ramp).to(kv_dtype)
    want = attention_ref.paged_attention(query, key_cache, value_cache, attn, 1.0)
    got = native.paged_attention(query, key_cache, value_cache, attn, 1.0, 2)
    assert (got.float() - want.float()).abs().max().item() < 10 * ATTN_TOL[dtype]


def test_unsupported_shape_is_a_typed_error_and_the_op_falls_back(native, variant):
    dtype = variant[0]
    query, key_cache, value_cache, attn, scale = random_step(([3, 9], [1, 1], 8), variant, head_dim=72)  # 72 % 16 != 0
    with pytest.raises(cpu_native.NativeKernelError, match="head_dim"):
        native.paged_attention(query, key_cache, value_cache, attn, scale, 1)
    want = attention_ref.paged_attention(query, key_cache, value_cache, attn, scale)
    got = NativeOps(native).paged_attention(query, key_cache, value_cache, attn, scale)  # the bound op
    assert (got.float() - want.float()).abs().max().item() < ATTN_TOL[dtype]


def test_native_attention_reads_query_rows_in_place_from_a_qkv_view(native, variant):
    dtype = variant[0]
    query, key_cache, value_cache, attn, scale = random_step(([5, 0, 30], [1, 7, 1], 16), variant, head_dim=64)
    qkv = torch.cat([query.flatten(1), torch.randn(query.shape[0], 2 * 2 * 64).to(dtype)], dim=1)
    view = qkv[:, :query.shape[1] * 64].view(query.shape)      # rows (15 * 64) elements apart
    assert not view.is_contiguous()
    want = native.paged_attention(query, key_cache, value_cache, attn, scale, 2)
    assert torch.equal(native.paged_attention(view, key_cache, value_cache, attn, scale, 2), want)
