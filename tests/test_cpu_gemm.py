"""vbatch's own fp32 GEMM (kernels/csrc/cpu_gemm.c, the `native` GEMM backend of kernels/gemm_libraries.py)
against torch's F.linear in float64, on every native build of this CPU that has it (AVX2 + FMA).

The shapes cover each edge of its blocking: rows not a multiple of its 6-row tile (1-5 left over) or
of its 96-row block, outputs not a multiple of its 16-output panel (a masked last panel), K above its
k block sized to the L2 (vb_blocking.h: 576 on a 512 KiB L2, 1,152 on 1 MiB, 2,304 on 2 MiB; 2,401 and
4,700 go in 2-9 near-equal blocks on each), rows apart in memory (a view), and teams of 1-3 threads
whose panel shares may be empty.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vbatch.kernels import cpu_features, cpu_linear, gemm_libraries

SHAPES = [  # (rows, outputs, K)
    (1, 1, 1), (5, 17, 3), (7, 33, 300), (13, 16, 257), (6, 15, 513), (97, 49, 1536), (256, 576, 576),
    (11, 8, 64), (191, 40, 777), (9, 20, 2401), (5, 33, 4700), (0, 16, 8)]


def _gemm(native):
    if not native.has_gemm:
        pytest.skip(f"the {native.tier.name} build has no fp32 GEMM (cpu_gemm.c needs AVX2 and FMA)")
    return native.gemm


def test_pack_panels_is_the_documented_layout():
    n, k = 37, 5                                      # two whole panels and a tail of 5 outputs
    w = torch.arange(n * k, dtype=torch.float32).view(n, k)
    flat = gemm_libraries.pack_panels(w).reshape(-1)
    for p in range(2):
        for kk in range(k):
            for j in range(16):
                assert flat[p * 16 * k + kk * 16 + j] == w[16 * p + j, kk]
    for kk in range(k):
        for j in range(5):
            assert flat[32 * k + kk * 5 + j] == w[32 + j, kk]


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("weights", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
def test_native_gemm_matches_linear(native, shape, weights, threads):
    # fp16 panels: each panel's k block widened in the kernel, exactly, so the oracle is the fp64
    # product of the fp16 values themselves.
    gemm = _gemm(native)
    m, n, k = shape
    g = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    w, bias = torch.randn(n, k, generator=g).to(weights), torch.randn(n, generator=g)
    wide = torch.randn(m, k + 3, generator=g)
    x = wide[:, 1:k + 1]                              # rows k + 3 floats apart
    packed = gemm_libraries.pack_panels(w)
    assert packed.dtype == weights
    for b in (None, bias):
        got = gemm(x, packed, b, threads)
        want = F.linear(x.double(), w.double(), None if b is None else b.double())
        assert got.shape == (m, n) and got.dtype == torch.float32
        # fp32 sums of k products of N(0, 1) values: rounding grows with k
        if m:
            assert (got.double() - want).abs().max().item() <= 2e-6 * k + 1e-6


def test_pack_gated_panels_is_the_documented_layout():
    inter, k = 37, 3                                  # two whole pairs of panels and a tail pair of 5
    gate = torch.arange(inter * k, dtype=torch.float32).view(inter, k)
    up = -gate - 1
    flat = gemm_libraries.pack_gated_panels(gate, up).reshape(-1)
    assert flat.numel() == 2 * inter * k
    for p in range(3):
        nc = min(16, inter - 16 * p)
        pair = flat[p * 2 * 16 * k:][:2 * nc * k]
        for which, w in ((0, gate), (1, up)):
            for kk in range(k):
                for j in range(nc):
                    assert pair[which * nc * k + kk * nc + j] == w[16 * p + j, kk]


GATED_SHAPES = [  # (rows, inter, K): rows past the 6-row tile and the row block, a masked last panel
    (1, 1, 1), (5, 17, 3), (7, 33, 300), (13, 16, 257), (97, 49, 576), (256, 80, 96), (191, 40, 1536),
    (9, 20, 2401), (0, 16, 8)]


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("weights", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", GATED_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in GATED_SHAPES])
def test_native_gated_gemm_matches_linear_and_silu_and_mul(native, shape, weights, threads):
    # The gated GEMM (gate and up panels in pairs): unfused, it is [gate | up] as F.linear gives it
    # (oracle: the fp64 product of the stored values); fused, it equals its own unfused result put
    # through the native SiLU-and-mul op bit for bit (the same formula, lane for lane), and the fp64
    # silu(gate) * up within fp32 rounding.
    _gemm(native)
    m, inter, k = shape
    g = torch.Generator().manual_seed(m * 7919 + inter * 31 + k)
    gate, up = torch.randn(inter, k, generator=g).to(weights), torch.randn(inter, k, generator=g).to(weights)
    bias = torch.randn(2 * inter, generator=g)
    wide = torch.randn(m, k + 3, generator=g)
    x = wide[:, 1:k + 1]                              # rows k + 3 floats apart
    packed = gemm_libraries.pack_gated_panels(gate, up)
    assert packed.dtype == weights and packed.shape == (2 * inter, k)
    for b in (None, bias):
        both = native.gemm_gated(x, packed, b, False, threads)
        want = F.linear(x.double(), torch.cat([gate, up]).double(), None if b is None else b.double())
        assert both.shape == (m, 2 * inter) and both.dtype == torch.float32
        if m:
            assert (both.double() - want).abs().max().item() <= 2e-6 * k + 1e-6
        fused = native.gemm_gated(x, packed, b, True, threads)
        assert fused.shape == (m, inter)
        assert torch.equal(fused, native.silu_and_mul(both, threads))
        if m:
            exact = want[:, :inter] * torch.sigmoid(want[:, :inter]) * want[:, inter:]
            assert (fused.double() - exact).abs().max().item() <= (2e-6 * k + 1e-6) * (exact.abs().amax().item() + 1)


def test_native_backend_through_packed_linear(native, monkeypatch):
    """The backend as the model uses it: PackedLinear with VBATCH_GEMM=native, fp16-stored weights
    packed as they are (no fp32 copy: cpu_gemm.c widens them), 5+ rows (fewer go through the
    small-rows kernel)."""
    _gemm(native)
    monkeypatch.setattr(gemm_libraries, "_native", lambda: gemm_libraries.native_backend(native))
    backend = gemm_libraries.backend_named("native")
    lin = torch.nn.Linear(300, 70)
    packed = cpu_linear.PackedLinear(lin, backend=backend, weight_dtype=torch.float16)
    x = torch.randn(2, 9, 300)
    want = F.linear(x.double(), lin.weight.detach().half().double(), lin.bias.detach().double())
    got = packed(x)
    assert got.shape == (2, 9, 70) and (got.double() - want).abs().max().item() <= 1e-3
    assert "gemm=native" in repr(packed)
    assert packed.packed_weight.dtype == torch.float16 and packed.compute_weight is None
    fp32 = cpu_linear.PackedLinear(lin, backend=backend)                      # fp32 weights: fp32 panels
    assert fp32.packed_weight.dtype == torch.float32
    assert (fp32(x).double() - F.linear(x.double(), lin.weight.double(), lin.bias.double())).abs().max() <= 1e-4


def test_vbatch_gemm_native_serves_fp32_only(monkeypatch):
    monkeypatch.setenv("VBATCH_GEMM", "native")
    gemm_libraries.gemm_backend.cache_clear()
    try:
        bf16 = gemm_libraries.gemm_backend(torch.bfloat16)
        assert bf16.name != "native"                     # it has no bf16 GEMM: the default serves
        fp32 = gemm_libraries.gemm_backend(torch.float32)
        native = gemm_libraries.backend_named("native")
        assert fp32.name == ("native" if native is not None else gemm_libraries.default_backend(
            torch.float32, cpu_features.detect(), cpu_features.selected_tier()).name)
    finally:
        gemm_libraries.gemm_backend.cache_clear()
