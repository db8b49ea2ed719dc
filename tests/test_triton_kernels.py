"""Triton kernels against their PyTorch references, on CPU under the Triton interpreter.

The kernels are defined at import, so TRITON_INTERPRET=1 is set just for the import below and
again, by an autouse fixture, only while these tests run (triton imports parts of itself
lazily at the first launch); other test modules never see it and must not import triton at
collection (zentorch, the CPU GEMM extra, imports triton: tests/test_cpu_kernels.py loads it
inside its tests, after this module has been collected).
Oracles: the references in `vbatch.kernels.*_ref` (themselves tested against naive
implementations and transformers in test_kernels_reference.py) and `sampling_ref`, whose
Philox is checked against the published Random123 known-answer vectors. Shapes are tiny: the
interpreter costs about 0.4 ms per program instance.
Tolerances: fp32 within 1e-5 (attention, norms: reduction order), bf16 within one bf16 ulp at
the outputs' magnitude (2e-2) with most elements bit-identical; KV writes, rotary and sampler
masks/tokens exactly.
"""
from __future__ import annotations

import inspect
import os
import random

import numpy as np
import pytest
import torch

_previous = os.environ.get("TRITON_INTERPRET")
os.environ["TRITON_INTERPRET"] = "1"
try:
    pytest.importorskip("triton")
    from vbatch.kernels import (attention_ref, cache_ref, norm_ref, rotary_ref, sampling_ref,
                                triton_attention, triton_cache, triton_common, triton_norm,
                                triton_rotary, triton_sampler)
finally:
    if _previous is None:
        del os.environ["TRITON_INTERPRET"]
    else:
        os.environ["TRITON_INTERPRET"] = _previous

from test_kernels_reference import make_metadata  # noqa: E402  (same random block-table builder)

torch.set_num_threads(1)

if not triton_common.INTERPRET:
    pytest.skip("triton was imported before TRITON_INTERPRET was set", allow_module_level=True)


@pytest.fixture(autouse=True)
def _interpret(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item() if a.numel() else 0.0


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, what
    diff = max_diff(actual, expected)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert diff <= tol, f"{what}: max abs diff {diff:.3g} > {tol}"
    if dtype == torch.bfloat16:
        same = (actual == expected).float().mean().item()
        assert same >= 0.99, f"{what}: only {same:.1%} bit-identical (max abs diff {diff:.3g})"


# ---------------------------------------------------------------------------- signatures
@pytest.mark.parametrize("ref, fast", [
    (cache_ref.write_kv_cache, triton_cache.write_kv_cache),
    (attention_ref.paged_attention, triton_attention.paged_attention),
    (norm_ref.rms_norm, triton_norm.rms_norm),
    (norm_ref.fused_add_rms_norm, triton_norm.fused_add_rms_norm),
    (rotary_ref.apply_rotary, triton_rotary.apply_rotary),
    (sampling_ref.apply_sampling_masks, triton_sampler.apply_sampling_masks),
    (sampling_ref.sample_tokens, triton_sampler.sample_tokens),
])
def test_same_signature_as_reference(ref, fast):
    assert list(inspect.signature(ref).parameters) == list(inspect.signature(fast).parameters)


def test_get_ops_binds_triton_for_cuda():
    from vbatch.kernels.ops import REFERENCE_OPS, get_ops
    ops = get_ops(torch.device("cuda"))
    assert ops.name == "triton"
    assert ops.paged_attention is triton_attention.paged_attention
    assert ops.silu_and_mul is REFERENCE_OPS.silu_and_mul
    assert get_ops("cpu").paged_attention is not triton_attention.paged_attention


# ---------------------------------------------------------------------------- KV write
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_cache_matches_reference(dtype):
    gen = torch.Generator().manual_seed(0)
    num_tokens, num_kv_heads, head_dim, num_blocks, block_size = 7, 3, 8, 5, 4
    # k/v as strided views of one fused projection, as the model hands them over.
    qkv = torch.randn(num_tokens, (3 + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    key = qkv[:, 3 * head_dim:(3 + num_kv_heads) * head_dim].view(num_tokens, num_kv_heads, head_dim)
    value = qkv[:, (3 + num_kv_heads) * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    caches = [torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
              for _ in range(2)]
    fast = [c.clone() for c in caches]
    cache_ref.write_kv_cache(key, value, caches[0], caches[1], slots)
    triton_cache.write_kv_cache(key, value, fast[0], fast[1], slots)
    for name, a, b in zip(("key", "value"), fast, caches):
        assert torch.equal(a, b), f"{name} cache: max abs diff {max_diff(a, b):.3g}"


# ---------------------------------------------------------------------------- paged attention
ATTENTION_CASES = {
    # name: (context_lens, query_lens, num_q_heads, num_kv_heads, head_dim)
    "decode-varying-lengths": ([5, 40, 17, 0, 63], [1, 1, 1, 1, 1], 6, 2, 16),
    "decode-smollm-groups": ([30, 2, 77], [1, 1, 1], 9, 3, 32),        # group of 3 padded to 4
    "prefill-no-context": ([0, 0], [13, 40], 4, 4, 16),                # plain MHA
    "chunked-prefill-with-context": ([32, 7], [40, 21], 6, 2, 16),     # cached prefix + chunk
    "mixed-decode-and-chunks": ([20, 0, 45, 3], [1, 9, 30, 1], 8, 2, 16),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_paged_attention_matches_reference(case, dtype):
    context_lens, query_lens, num_q_heads, num_kv_heads, head_dim = ATTENTION_CASES[case]
    block_size, num_blocks = 16, 24
    rng = random.Random(case)
    gen = torch.Generator().manual_seed(len(case))
    attn = make_metadata(context_lens, query_lens, block_size, num_blocks, rng)
    query = torch.randn(attn.num_tokens, num_q_heads, head_dim, generator=gen).to(dtype)
    key_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    value_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    # Slots no request owns hold NaN: a kernel that reads past a request's length would show it.
    used = set(attn.block_tables.flatten().tolist())
    for block in set(range(num_blocks)) - used:
        key_cache[block] = float("nan")
        value_cache[block] = float("nan")
    scale = head_dim ** -0.5
    expected = attention_ref.paged_attention(query, key_cache, value_cache, attn, scale)
    actual = triton_attention.paged_attention(query, key_cache, value_cache, attn, scale)
    assert not actual.isnan().any(), "NaN leaked from an unused block"
    assert_close(actual, expected, dtype, f"paged attention {case}")


def test_paged_attention_static_loops_match(monkeypatch):
    """The constexpr-bound loop used under the Triton 3.6 interpreter gives the same answer."""
    context_lens, query_lens, num_q_heads, num_kv_heads, head_dim = ATTENTION_CASES["mixed-decode-and-chunks"]
    attn = make_metadata(context_lens, query_lens, 16, 24, random.Random(1))
    gen = torch.Generator().manual_seed(1)
    query = torch.randn(attn.num_tokens, num_q_heads, head_dim, generator=gen)
    key_cache, value_cache = (torch.randn(24, 16, num_kv_heads, head_dim, generator=gen) for _ in range(2))
    expected = attention_ref.paged_attention(query, key_cache, value_cache, attn, 0.25)
    monkeypatch.setattr(triton_attention, "STATIC_LOOPS", True)
    actual = triton_attention.paged_attention(query, key_cache, value_cache, attn, 0.25)
    assert_close(actual, expected, torch.float32, "paged attention, static loops")


# ---------------------------------------------------------------------------- norms
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_match_reference(dtype):
    gen = torch.Generator().manual_seed(2)
    hidden = 40                                       # not a power of two: masked tail
    x = (torch.randn(2, 3, hidden, generator=gen) * 3).to(dtype)
    residual = torch.randn(2, 3, hidden, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    x_before, residual_before = x.clone(), residual.clone()
    assert_close(triton_norm.rms_norm(x, weight, 1e-5), norm_ref.rms_norm(x, weight, 1e-5), dtype, "rms_norm")
    normed, summed = triton_norm.fused_add_rms_norm(x, residual, weight, 1e-6)
    expected_normed, expected_sum = norm_ref.fused_add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(summed, expected_sum), f"residual sum: max abs diff {max_diff(summed, expected_sum):.3g}"
    assert_close(normed, expected_normed, dtype, "fused_add_rms_norm")
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before), "inputs must not change"


# ---------------------------------------------------------------------------- rotary
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_matches_reference(dtype):
    gen = torch.Generator().manual_seed(3)
    num_tokens, num_q_heads, num_kv_heads, head_dim = 6, 9, 3, 16
    rope_cache = rotary_ref.build_rope_cache(head_dim, 128, 10000.0, None)
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, generator=gen).to(dtype)
    query = qkv[:, :num_q_heads * head_dim].view(num_tokens, num_q_heads, head_dim)
    key = qkv[:, num_q_heads * head_dim:(num_q_heads + num_kv_heads) * head_dim].view(
        num_tokens, num_kv_heads, head_dim)
    positions = torch.tensor([0, 1, 5, 64, 127, 3])
    actual = triton_rotary.apply_rotary(positions, query, key, rope_cache)
    expected = rotary_ref.apply_rotary(positions, query, key, rope_cache)
    for name, a, b in zip(("query", "key"), actual, expected):
        assert a.dtype == b.dtype and torch.equal(a, b), f"rotary {name}: max abs diff {max_diff(a, b):.3g}"


# ---------------------------------------------------------------------------- sampler
def test_reference_philox_matches_random123_known_answers():
    zero = np.zeros(1, dtype=np.uint64)
    ones = np.full(1, 0xFFFFFFFF, dtype=np.uint64)
    got = [int(w[0]) for w in sampling_ref.philox4x32((zero,) * 4, (zero,) * 2)]
    assert got == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    got = [int(w[0]) for w in sampling_ref.philox4x32((ones,) * 4, (ones,) * 2)]
    assert got == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]


def _sampling_batch(vocab: int = 64):
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(6, vocab, generator=gen) * 2
    logits[5, :4] = logits[5].max() + 1.0      # a 4-way tie at the top: top_k=2 keeps all four
    params = dict(
        temperature=torch.tensor([0.0, 1.0, 0.7, 1.3, 0.9, 1.0]),
        top_k=torch.tensor([0, 0, 5, 20, 0, 2]),
        top_p=torch.tensor([1.0, 1.0, 1.0, 0.8, 0.5, 1.0]),
        min_p=torch.tensor([0.0, 0.0, 0.1, 0.0, 0.05, 0.0]),
    )
    seeds = torch.tensor([1, 2, 3, -4, 2 ** 40 + 7, 9])
    offsets = torch.tensor([0, 1, 2, 3, 2 ** 33, 5])
    return logits, params, seeds, offsets


def test_sampling_masks_equal_reference_exactly():
    logits, params, _, _ = _sampling_batch()
    actual = triton_sampler.apply_sampling_masks(logits, **params)
    expected = sampling_ref.apply_sampling_masks(logits, **params)
    kept, expected_kept = actual > float("-inf"), expected > float("-inf")
    assert torch.equal(kept, expected_kept), \
        f"kept per row {kept.sum(1).tolist()} vs reference {expected_kept.sum(1).tolist()}"
    assert torch.equal(actual[kept], expected[kept]), f"max abs diff {max_diff(actual[kept], expected[kept]):.3g}"
    # Hand-checked facts about the batch: greedy and plain rows keep all, top_k=5 keeps at most 5
    # (min_p may drop more), the tie row keeps its four tied best tokens.
    assert kept[0].all() and kept[1].all()
    assert 1 <= kept[2].sum() <= 5
    assert kept[5].sum() == 4 and kept[5, :4].all()


def test_sample_tokens_equal_reference_and_are_batch_invariant():
    logits, params, seeds, offsets = _sampling_batch()
    tokens = triton_sampler.sample_tokens(logits, **params, seeds=seeds, offsets=offsets)
    expected = sampling_ref.sample_tokens(logits, **params, seeds=seeds, offsets=offsets)
    assert torch.equal(tokens, expected), f"{tokens.tolist()} vs reference {expected.tolist()}"
    assert tokens[0] == logits[0].argmax()             # greedy row: the raw argmax
    masked = sampling_ref.apply_sampling_masks(logits, **params)
    assert (masked.gather(1, tokens[:, None]) > float("-inf")).all(), "a dropped token was sampled"
    # Same seeds and offsets in another order and another batch: the same token per row.
    order = torch.tensor([4, 2, 5, 1])
    again = triton_sampler.sample_tokens(logits[order], **{k: v[order] for k, v in params.items()},
                                         seeds=seeds[order], offsets=offsets[order])
    assert torch.equal(again, tokens[order]), f"{again.tolist()} vs {tokens[order].tolist()}"


def test_sample_tokens_follow_the_distribution():
    """Many offsets of one row: token frequencies follow softmax(logits) (a loose chi-square)."""
    vocab, draws = 8, 64
    logits = torch.log(torch.tensor([0.4, 0.2, 0.1, 0.1, 0.1, 0.05, 0.03, 0.02]))
    rows = logits.expand(draws, vocab).contiguous()
    ones = torch.ones(draws)
    tokens = triton_sampler.sample_tokens(rows, ones, torch.zeros(draws, dtype=torch.int64), ones,
                                          torch.zeros(draws), torch.full((draws,), 11), torch.arange(draws))
    counts = torch.bincount(tokens, minlength=vocab).float()
    expected = logits.exp() * draws
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 30.0, f"chi-square {chi2:.1f} over {vocab - 1} degrees of freedom; counts {counts.tolist()}"
