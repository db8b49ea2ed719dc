"""The fused per-token ops (kernels/csrc/cpu_elementwise.c: RMSNorm and its fused add, SiLU-and-mul,
rotary, the KV write) of every CPU tier this machine runs, against their references (norm_ref,
activation_ref, cpu_rotary / rotary_ref, cache_ref).

Tolerances: bf16 within one bf16 step of the reference on <= 1% of elements (same roundings, sums
in another order); fp32 within 1e-6 relative (FMA contraction, exp polynomial 1e-7); the KV write
bit for bit.
"""
from __future__ import annotations

import pytest
import torch

from native_params import DTYPES
from vbatch.kernels import cpu_rotary
from vbatch.kernels.cpu_native_ops import NativeOps

def _close(got: torch.Tensor, want: torch.Tensor, max_mismatch: float = 0.01) -> None:
    # bf16: same roundings at the same places as the reference; only sums taken in another order
    # may move a result by one bf16 step, on a small share of elements. fp32: 1e-6 relative.
    assert got.dtype == want.dtype and got.shape == want.shape
    diff = (got.float() - want.float()).abs()
    if want.dtype == torch.float32:
        assert (diff <= want.abs() * 1e-6 + 1e-6).all(), diff.max().item()
        return
    one_step = want.float().abs().clamp_min(1e-30) * 2 ** -7
    assert (diff <= one_step).all()
    assert (diff > 0).float().mean().item() <= max_mismatch


@pytest.mark.parametrize("hidden", [576, 100])  # 100: a tail of 4 after whole vectors
@pytest.mark.parametrize("rows", [1, 300])      # 300 x 576: above the threading threshold
def test_native_rms_norms_match_reference(native, dtype, rows, hidden):
    from vbatch.kernels import norm_ref
    torch.manual_seed(rows + hidden)
    ops = NativeOps(native)
    x = (torch.randn(rows, hidden) * 3).to(dtype)
    residual = torch.randn(rows, hidden).to(dtype)
    weight = (torch.rand(hidden) + 0.5).to(dtype)
    _close(ops.rms_norm(x, weight, 1e-5), norm_ref.rms_norm(x, weight, 1e-5))
    got, got_res = ops.fused_add_rms_norm(x, residual, weight, 1e-5)
    want, want_res = norm_ref.fused_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(got_res, want_res)  # one rounded add: exact
    _close(got, want)


@pytest.mark.parametrize("d", [1536, 40])
def test_native_silu_and_mul_matches_reference(native, dtype, d):
    from vbatch.kernels import activation_ref
    torch.manual_seed(d)
    x = (torch.randn(64, 2 * d) * 4).to(dtype)
    _close(NativeOps(native).silu_and_mul(x), activation_ref.silu_and_mul(x))


def test_native_rotary_matches_reference_on_qkv_views(native, dtype):
    from vbatch.kernels import rotary_ref
    torch.manual_seed(0)
    cache = rotary_ref.build_rope_cache(64, 2048, 10000.0, None)
    positions = torch.randint(0, 2048, (37,))
    qkv = torch.randn(37, (9 + 3 + 3) * 64).to(dtype)
    q, k, _ = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)
    q, k = q.view(37, 9, 64), k.view(37, 3, 64)
    want_q, want_k = rotary_ref.apply_rotary(positions, q.clone(), k.clone(), cache)
    tables = cpu_rotary.prepare_rotary(positions, cache, dtype)
    got_q, got_k = NativeOps(native).apply_rotary(positions, q, k, tables)
    if dtype == torch.bfloat16:
        assert torch.equal(got_q, want_q) and torch.equal(got_k, want_k)  # same products, same roundings
    else:  # x * cos + rotated * sin: one FMA instead of two roundings
        _close(got_q, want_q)
        _close(got_k, want_k)
    assert got_q.data_ptr() == q.data_ptr()  # in place, in the qkv buffer


def test_native_kv_write_matches_reference(native, any_variant):
    # The cache may be narrower than the activations (fp16 / bf16 under fp32): rounded to nearest
    # even exactly as the reference's .to(); specials (subnormals, overflow, NaN) included.
    from vbatch.kernels import cache_ref
    dtype, kv_dtype = any_variant
    torch.manual_seed(0)
    kv = torch.randn(5, 2 * 3 * 64).to(dtype)
    kv[0, :8] = torch.tensor([1e-6, -3e-8, 6.1e-5, 65519.0, 65520.0, 1e30, float("nan"), -float("inf")]).to(dtype)
    kv[1, :64] = (torch.randn(64) * 2.0 ** -20).to(dtype)    # fp16 subnormals
    k, v = (t.view(5, 3, 64) for t in kv.split([192, 192], dim=-1))
    slots = torch.tensor([17, 3, 40, 41, 0])
    want_k, want_v = torch.zeros(4, 16, 3, 64, dtype=kv_dtype), torch.zeros(4, 16, 3, 64, dtype=kv_dtype)
    got_k, got_v = want_k.clone(), want_v.clone()
    cache_ref.write_kv_cache(k, v, want_k, want_v, slots)
    NativeOps(native).write_kv_cache(k, v, got_k, got_v, slots)
    for got, want in ((got_k, want_k), (got_v, want_v)):
        nan = torch.isnan(want)
        assert torch.equal(torch.isnan(got), nan)                     # NaN stays NaN (its payload may differ)
        assert torch.equal(got[~nan], want[~nan])                      # every other value bit for bit


def test_native_kv_write_shared_across_threads_matches_reference(native, any_variant):
    # A prompt step's write (here 1,000 rows x 192 values, above the kernels' threading threshold) is
    # split across two threads: every row lands in its slot, scattered over the blocks, bit for bit
    # as the reference's; the rows are apart (keys and values are views into a qkv product).
    from vbatch.kernels import cache_ref
    dtype, kv_dtype = any_variant
    torch.manual_seed(1)
    rows, blocks = 1000, 80
    qkv = torch.randn(rows, 576 + 2 * 192).to(dtype)
    k, v = (t.view(rows, 3, 64) for t in qkv[:, 576:].split([192, 192], dim=-1))
    slots = torch.randperm(blocks * 16)[:rows]
    want_k, want_v = torch.zeros(blocks, 16, 3, 64, dtype=kv_dtype), torch.zeros(blocks, 16, 3, 64, dtype=kv_dtype)
    got_k, got_v = want_k.clone(), want_v.clone()
    cache_ref.write_kv_cache(k, v, want_k, want_v, slots)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        NativeOps(native).write_kv_cache(k, v, got_k, got_v, slots)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))    # bit for bit (no NaN here)
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_native_fp8_kv_write_rounds_every_code_and_every_tie(native, dtype, kv_dtype):
    # Every finite fp8 value, every midpoint between neighbours (exact ties: nearest even), points a
    # quarter step either side of them, and values past the largest (saturated), with both signs:
    # the native write bit for bit against the reference's clamp().to() (random data rarely ties).
    from vbatch.kernels import cache_ref
    codes = torch.arange(256, dtype=torch.uint8).view(kv_dtype).float()
    values = codes[torch.isfinite(codes)].unique()                                 # sorted, -max .. max
    mids = (values[1:] + values[:-1]) / 2
    quarter = (values[1:] - values[:-1]) / 4
    x = torch.cat([values, mids, mids - quarter, mids + quarter, values[-1] * torch.tensor([1.03, 1.5, 1e3])])
    x = torch.cat([x, -x]).to(dtype)
    rows = -(-x.numel() // 64)
    x = torch.cat([x, torch.zeros(rows * 64 - x.numel(), dtype=dtype)]).view(rows, 1, 64)
    slots = torch.arange(rows)
    want_k = torch.zeros(rows, 1, 1, 64, dtype=kv_dtype)
    got_k, want_v, got_v = want_k.clone(), want_k.clone(), want_k.clone()
    cache_ref.write_kv_cache(x, x, want_k, want_v, slots)
    NativeOps(native).write_kv_cache(x, x, got_k, got_v, slots)
    assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8))


def test_native_ops_fall_back_for_inputs_they_do_not_take(native):
    from vbatch.kernels import activation_ref, norm_ref
    ops = NativeOps(native)
    x = torch.randn(3, 64, dtype=torch.float16)  # no fp16 activations: the references run
    w = torch.ones(64, dtype=torch.float16)
    assert torch.equal(ops.rms_norm(x, w, 1e-6), norm_ref.rms_norm(x, w, 1e-6))
    assert torch.equal(ops.silu_and_mul(x), activation_ref.silu_and_mul(x))
    y = torch.randn(4, 64)[:, ::2]  # fp32 but not contiguous
    assert torch.equal(ops.silu_and_mul(y), activation_ref.silu_and_mul(y))
