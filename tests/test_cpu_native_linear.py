"""The small-rows linear (kernels/csrc/cpu_linear_small.c) of every CPU tier this machine runs.

Oracle: the exact fp64 product of the very tensors it multiplies (half-precision weights widened
exactly); within 2^-8 (bf16 rows) or 1e-5 (fp32 rows) of the row's largest output. A kernel a
build lacks (the bf16 small-rows linear needs avx512_bf16) skips with that reason.
"""
from __future__ import annotations

import pytest
import torch

from vbatch.kernels import q8_0

WEIGHTS = {torch.float32: [torch.float32, torch.float16, torch.bfloat16], torch.bfloat16: [torch.bfloat16]}


@pytest.mark.parametrize("in_features", [576, 80, 1000, 36])     # whole chunks, vector tails, scalar tails
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 13, 16, 31, 32])   # passes of up to 4 rows over the weight
def test_small_linear_matches_exact_product(native, dtype, rows, in_features):
    # Oracle: the fp64 product of the same tensors (half-precision weights widened exactly); the
    # kernel sums in fp32 and rounds once to the rows' dtype.
    torch.manual_seed(rows * 7 + in_features)
    out_features = 200 if in_features != 576 else 960      # 200: a partial last tile of 16 outputs
    x = torch.randn(rows, in_features).to(dtype)
    bias = torch.randn(out_features).to(dtype)
    tol_rel = 2 ** -8 if dtype == torch.bfloat16 else 1e-5
    for weight_dtype in WEIGHTS[dtype]:
        if not native.has_small_linear(dtype, weight_dtype):
            assert native.tier.name != "avx512-bf16" and dtype == torch.bfloat16
            pytest.skip(f"the {native.tier.name} tier has no bf16 small-rows kernel (it needs avx512_bf16)")
        weight = torch.randn(out_features, in_features).to(weight_dtype)
        for b in (None, bias):
            got = native.linear_small(x, weight, b, 2)
            exact = x.double() @ weight.double().t() + (0 if b is None else b.double())
            tol = exact.abs().amax(-1, keepdim=True) * tol_rel
            assert got.shape == (rows, out_features) and got.dtype == dtype
            assert ((got.double() - exact).abs() <= tol).all(), weight_dtype


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_small_linear_any_output_count_and_team(native, dtype, threads):
    # Each thread reads its share of the output rows as several streams side by side: output counts
    # that leave streams of unequal length (or empty ones), and teams of 1-3 threads, against the
    # exact product.
    tol_rel = 2 ** -8 if dtype == torch.bfloat16 else 1e-5
    weight_dtype = torch.float16 if dtype == torch.float32 else torch.bfloat16
    if not native.has_small_linear(dtype, weight_dtype):
        pytest.skip(f"the {native.tier.name} tier has no bf16 small-rows kernel (it needs avx512_bf16)")
    for out_features in (1, 3, 7, 17, 203, 1029):
        for rows in (1, 2, 3, 4, 6):
            torch.manual_seed(out_features * 11 + rows)
            x = torch.randn(rows, 72).to(dtype)
            weight = torch.randn(out_features, 72).to(weight_dtype)
            bias = torch.randn(out_features).to(dtype)
            got = native.linear_small(x, weight, bias, threads)
            exact = x.double() @ weight.double().t() + bias.double()
            tol = exact.abs().amax(-1, keepdim=True) * tol_rel
            assert ((got.double() - exact).abs() <= tol).all(), (out_features, rows)


def test_small_linear_result_depends_on_neither_team_nor_neighbour_rows(native, dtype):
    # The thread count decides which outputs are read as side-by-side streams and which one at a
    # time, and a row of x may share its pass with others: every output must still be summed the
    # same way, so the same request gives the same bits whatever the threads and the batch.
    weight_dtype = torch.float16 if dtype == torch.float32 else torch.bfloat16
    if not native.has_small_linear(dtype, weight_dtype):
        pytest.skip(f"the {native.tier.name} tier has no bf16 small-rows kernel (it needs avx512_bf16)")
    torch.manual_seed(5)
    for out_features, in_features in ((1029, 72), (960, 576), (203, 1536)):
        x = torch.randn(4, in_features)
        x[:, [0, 32, 64]] = 1.0
        weight = torch.randn(out_features, in_features)
        # Every 5th output: 2^15 - 2^15 + 0.001 along the row, which fp32 sums to 0.001 or to 0 by
        # order (2^15 + 0.001 rounds to 2^15); every term exact in fp16 and bf16.
        weight[::5] = 0.0
        weight[::5, 0], weight[::5, 32], weight[::5, 64] = 2.0 ** 15, -(2.0 ** 15), 0.001
        x, weight = x.to(dtype), weight.to(weight_dtype)
        bias = torch.randn(out_features).to(dtype)
        want = native.linear_small(x, weight, bias, 1)
        for threads in (2, 3):
            assert torch.equal(native.linear_small(x, weight, bias, threads), want), (out_features, threads)
        for row in range(4):
            assert torch.equal(native.linear_small(x[row:row + 1], weight, bias, 2)[0], want[row]), (out_features, row)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_small_linear_q8_0_weights_match_their_dequantized_product(native, threads):
    # Q8_0 rows (kernels/q8_0.py): the kernel widens each int8 vector and multiplies it by its block's
    # fp16 scale, so it computes with exactly q8_0.dequantize's weights; oracle: the fp64 product of
    # those. Widths of 1-48 blocks, 1-32 rows of x (a pass per 4), output counts that leave
    # uneven or empty streams, teams of 1-3 threads, every tier the fixture builds.
    assert native.has_small_linear(torch.float32, torch.int8)
    for in_features, out_features in ((32, 1), (576, 1029), (1536, 203), (96, 17), (64, 7)):
        torch.manual_seed(in_features + out_features)
        weight = torch.randn(out_features, in_features) * 0.05
        weight[0, :32] = 0.0                                   # an all-zero block: scale 0
        if out_features > 1:
            weight[1] *= 1e-3                                  # fp16-subnormal scales (each tier's widening)
        packed = q8_0.quantize(weight)
        dequantized = q8_0.dequantize(packed, in_features).double()
        bias = torch.randn(out_features)
        for rows in (1, 2, 3, 4, 5, 8, 16, 32):
            x = torch.randn(rows, in_features)
            for b in (None, bias):
                got = native.linear_small(x, packed, b, threads)
                exact = x.double() @ dequantized.t() + (0 if b is None else b.double())
                tol = exact.abs().amax(-1, keepdim=True) * 1e-5
                assert got.shape == (rows, out_features) and got.dtype == torch.float32
                assert ((got.double() - exact).abs() <= tol).all(), (in_features, out_features, rows)


def test_small_linear_q8_0_refuses_bf16_rows(native):
    # Q8_0 is an fp32-arithmetic format: bf16 rows have no Q8_0 kernel (the caller keeps its GEMM).
    packed = q8_0.quantize(torch.randn(16, 64))
    assert not native.has_small_linear(torch.bfloat16, torch.int8)
    assert native.linear_small(torch.zeros(1, 64, dtype=torch.bfloat16), packed, None, 1) is None


def test_small_linear_refuses_more_rows_than_any_tier_asks(native, dtype):
    # cpu_linear_small.c's MAX_ROWS (32, the fused layers' too) bounds every tier's small_rows_wider
    # (bench/small_rows_limit.py races limits up to it); past it the caller keeps its GEMM.
    from vbatch.kernels import cpu_features, cpu_native_ops
    assert max(tier.small_rows_wider for tier in cpu_features.TIERS) <= cpu_native_ops.FUSED_LAYER_MAX_ROWS == 32
    most = cpu_native_ops.FUSED_LAYER_MAX_ROWS
    weight = torch.zeros(16, 64, dtype=dtype)
    assert native.linear_small(torch.zeros(most + 1, 64, dtype=dtype), weight, None, 1) is None
    if native.has_small_linear(dtype, dtype):
        assert native.linear_small(torch.zeros(most, 64, dtype=dtype), weight, None, 1) is not None


def test_fp16_weights_widen_exactly_including_subnormals_and_specials(native):
    # Every fp16 bit pattern but NaNs, one per weight: F16C's vcvtph2ps (avx2) and the plain-C bit
    # arithmetic (portable) must both give the exact fp32 value; x = one-hot rows read them back.
    bits = torch.arange(0, 1 << 16, dtype=torch.int32)
    halves = bits.to(torch.int16).view(torch.float16)
    halves = halves[~torch.isnan(halves) & torch.isfinite(halves)]         # inf * 0 would be NaN
    weight = halves[: (halves.numel() // 64) * 64].view(-1, 64).contiguous()  # [rows, 64]
    for j in (0, 17, 63):
        x = torch.zeros(1, 64)
        x[0, j] = 1.0
        got = native.linear_small(x, weight, None, 2)
        assert torch.equal(got[0], weight[:, j].float())
