"""The integer Q8_0 GEMM (kernels/csrc/cpu_gemm_q8.c, kernels/cpu_q8_0_linear.py) on every native build
of this CPU that has it (AVX2 + FMA), with and without AVX-VNNI where the CPU has avx_vnni.

Oracles: the same arithmetic written in torch (rows rounded to int16 with one scale each, int64 block
sums of 32 products, block scales and the row scale in float64), exact integers where every value is
exactly representable, and F.linear on the dequantized weights within the rows' rounding. The shapes
cover each edge of the blocking: rows not a multiple of the 6-row tile (1-5 left over) or of the
96-row block, outputs not a multiple of the 16-output panel (a padded last panel), K above the
k block sized to the L2 cache (1,152 on a 512 KiB L2, 2,336 on 1 MiB, 4,672 on 2 MiB: near-equal
blocks of whole 32s; 1,888, 2,400 and 4,704 go in two unequal ones on the first, second and third,
9,440 in three on the third), rows apart in memory (a view), 1-3 threads.
"""
from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
import torch.nn.functional as F

from vbatch.kernels import cpu_features, cpu_linear, cpu_q8_0_linear, q8_0
from vbatch.kernels.native_build import NativeKernelError

SHAPES = [  # (rows, outputs, K)
    (1, 1, 32), (5, 17, 64), (6, 16, 32), (7, 33, 96), (13, 200, 576), (97, 49, 1536), (100, 960, 576),
    (191, 40, 800), (12, 15, 832), (9, 20, 1888), (7, 17, 2400), (3, 20, 4704), (11, 33, 9440),
    (0, 16, 32)]
VNNI = [False, True] if cpu_features.detect().has("avx_vnni") else [False]


def _gemm(native, vnni: bool = False):
    if not native.has_gemm_q8_0:
        pytest.skip(f"the {native.tier.name} build has no integer Q8_0 GEMM (cpu_gemm_q8.c needs AVX2 and FMA)")
    if vnni and not native.has_gemm_q8_0_vnni:
        pytest.skip(f"the {native.tier.name} build has no AVX-VNNI path (its assembler predates binutils 2.36)")
    return native.gemm_q8_0


def reference(x: torch.Tensor, stored: torch.Tensor, k: int, bias: torch.Tensor | None) -> torch.Tensor:
    """cpu_gemm_q8.c's arithmetic in torch: float64 [M, N]."""
    amax = x.abs().amax(dim=1, keepdim=True)                                 # [M, 1] fp32
    safe = torch.where(amax > 0, amax, torch.ones_like(amax))
    inv = torch.tensor(32767.0, dtype=torch.float32) / safe                  # fp32, as the kernel
    xq = torch.where(amax > 0, torch.round(x * inv), torch.zeros_like(x)).clamp(-32767, 32767).to(torch.int64)
    s = torch.where(amax > 0, amax / 32767.0, torch.zeros_like(amax)).double()
    q, d = q8_0.split(stored, k)
    m, n, blocks = x.shape[0], q.shape[0], k // q8_0.BLOCK
    sums = (xq.view(m, 1, blocks, q8_0.BLOCK) * q.to(torch.int64).view(1, n, blocks, q8_0.BLOCK)).sum(-1)
    y = s * (sums.double() * d.double().view(1, n, blocks)).sum(-1)
    return y if bias is None else y + bias.double()


def test_pack_panels_is_the_documented_layout():
    n, k = 37, 64                                     # two whole panels and a padded third
    w = torch.randn(n, k)
    stored = q8_0.quantize(w)
    q, d = q8_0.split(stored, k)
    packed = cpu_q8_0_linear.pack_panels(stored, k)
    assert packed.dtype == torch.int16 and packed.shape == (3 * 17, k)
    flat = packed.reshape(-1)
    for p in range(3):
        for pair in range(k // 2):
            for j in range(16):
                for t in range(2):
                    want = q[16 * p + j, 2 * pair + t] if 16 * p + j < n else 0
                    assert flat[p * 16 * k + pair * 32 + j * 2 + t] == want
    scales = flat[3 * 16 * k:].view(torch.float32)
    for p in range(3):
        for b in range(k // 32):
            for j in range(16):
                want = d[16 * p + j, b].float() if 16 * p + j < n else 0.0
                assert scales[(p * (k // 32) + b) * 16 + j] == want


@pytest.mark.parametrize("vnni", VNNI, ids=["avx2", "vnni"][:len(VNNI)])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in SHAPES])
def test_q8_0_gemm_matches_its_integer_arithmetic(native, shape, threads, vnni):
    gemm = _gemm(native, vnni)
    m, n, k = shape
    g = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    stored = q8_0.quantize(torch.randn(n, k, generator=g) * 0.05)
    bias = torch.randn(n, generator=g)
    wide = torch.randn(m, k + 3, generator=g)
    x = wide[:, 1:k + 1]                              # rows k + 3 floats apart
    packed = cpu_q8_0_linear.pack_panels(stored, k)
    for b in (None, bias):
        got = gemm(x, packed, b, n, vnni, threads)
        assert got.shape == (m, n) and got.dtype == torch.float32
        if m:
            want = reference(x, stored, k, b)
            # fp32 accumulation of k / 32 block terms, each converted from an exact int32
            weights = q8_0.dequantize(stored, k).double()
            scale = (x.abs().double() @ weights.abs().t()).max().item()
            assert (got.double() - want).abs().max().item() <= 1e-6 * scale + 1e-6
            # and the product it stands for, within the rows' rounding to int16
            exact = F.linear(x.double(), weights, None if b is None else b.double())
            bound = (x.abs().amax(dim=1, keepdim=True).double() / 65534) * weights.abs().sum(1)
            assert ((got.double() - exact).abs() <= bound + 1e-5 * scale + 1e-6).all()


@pytest.mark.parametrize("vnni", VNNI, ids=["avx2", "vnni"][:len(VNNI)])
def test_q8_0_gemm_is_exact_on_exact_integers(native, vnni):
    """Weights of whole numbers with block scale 1 (each block's largest |q| 127) and rows whose
    largest magnitude is 32,767: every value, product and sum is an exact integer in fp32, so any
    slip of the layout (a panel, a pair, a block, a tail row) shows as a wrong integer."""
    gemm = _gemm(native, vnni)
    m, n, k = 13, 37, 832
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-127, 128, (n, k), generator=g).float()
    q.view(n, k // 32, 32)[:, :, 0] = 127.0                                 # d = 127 / 127 = 1 per block
    stored = q8_0.quantize(q)
    assert torch.equal(q8_0.dequantize(stored, k), q)
    x = torch.randint(-3, 4, (m, k), generator=g).float()
    x[:, 0] = 32767.0                                                         # s = 1: rows kept as they are
    got = gemm(x, cpu_q8_0_linear.pack_panels(stored, k), None, n, vnni, 2)
    assert torch.equal(got.double(), (x.double() @ q.double().t()))


def test_q8_0_gemm_rows_of_zeros_and_errors(native):
    gemm = _gemm(native)
    stored = q8_0.quantize(torch.randn(20, 64))
    packed = cpu_q8_0_linear.pack_panels(stored, 64)
    bias = torch.randn(20)
    x = torch.zeros(7, 64)
    x[3] = torch.randn(64)
    got = gemm(x, packed, bias, 20, False, 2)
    assert torch.equal(got[0], bias) and torch.equal(got[6], bias)          # a row of zeros: the bias alone
    assert torch.allclose(got[3].double(), reference(x, stored, 64, bias)[3], atol=1e-5)
    x[1, 5], x[2, 63], x[4, 0] = float("nan"), float("inf"), -float("inf")   # not finite: NaN rows, as fp32's
    got = gemm(x, packed, bias, 20, False, 2)
    assert got[[1, 2, 4]].isnan().all() and torch.equal(got[0], bias)
    assert torch.allclose(got[3].double(), reference(x, stored, 64, bias)[3], atol=1e-5)
    with pytest.raises(NativeKernelError, match="multiple of 32"):       # the layout's contract, checked in C
        gemm(torch.zeros(7, 48), torch.zeros(34, 48, dtype=torch.int16), None, 20, False, 1)
    # AVX-VNNI only where /proc/cpuinfo lists avx_vnni (vbatch's one view of the CPU; a simulated CPU
    # kind swaps it, tools/simulated_cpu.py) and the kernel's own CPUID check passes too.
    try:
        kernel_runs_vnni = gemm(x, packed, None, 20, True, 1) is not None
    except NativeKernelError as e:
        assert "avx_vnni" in str(e)
        kernel_runs_vnni = False
    assert native.has_gemm_q8_0_vnni == (kernel_runs_vnni and cpu_features.detect().has("avx_vnni"))
    if not cpu_features.detect().has("avx_vnni"):
        assert cpu_q8_0_linear.gemm_choice(native) != "integer-vnni"


def test_packed_q8_0_linear_takes_the_small_rows_kernel_then_the_integer_gemm(native):
    """The layer as the model runs it: 1-4 rows exactly PackedLinear's Q8_0 small-rows result, 5+
    rows the integer GEMM (the rows' rounding apart, the same function)."""
    _gemm(native)
    if not native.has_small_linear(torch.float32, torch.int8):
        pytest.skip(f"the {native.tier.name} build has no Q8_0 small-rows kernel")
    lin = torch.nn.Linear(320, 70)
    plain = cpu_linear.PackedLinear(lin, native=native, quantization="q8_0")
    layer = cpu_q8_0_linear.PackedQ8_0Linear(lin, native=native, vnni=False)
    small = torch.randn(4, 320)
    assert torch.equal(layer(small), plain(small))
    x = torch.randn(2, 9, 320)
    stored = q8_0.quantize(lin.weight)
    want = reference(x.reshape(-1, 320), stored, 320, lin.bias.detach()).view(2, 9, 70)
    assert (layer(x).double() - want).abs().max().item() <= 1e-5
    assert (layer(x) - plain(x)).abs().max().item() <= 1e-3                 # the fp32 GEMM on q * d
    assert "vbatch integer Q8_0" in repr(layer) and layer.gemm_name.startswith("vbatch integer Q8_0")


GATED_SHAPES = [  # (rows, inter, K): rows past the 6-row tile and the 96-row block, K in 2-3 k blocks
    (1, 16, 32), (5, 16, 64), (7, 48, 96), (13, 32, 576), (97, 80, 576), (191, 16, 800), (9, 32, 2400),
    (3, 16, 4704), (11, 16, 9440), (0, 16, 32)]


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("shape", GATED_SHAPES, ids=[f"{m}x{n}x{k}" for m, n, k in GATED_SHAPES])
def test_q8_0_gated_gemm_equals_the_gemm_then_silu_and_mul(native, shape, threads):
    """The gated GEMM over a merged [gate; up] Q8_0 weight: its own plain GEMM put through the native
    SiLU-and-mul op, bit for bit (the same tiles and k blocks, the op's formula lane for lane), and
    silu(gate) * up from the integer arithmetic in float64 within fp32 rounding. 3 threads over one
    gate panel leave two threads without one."""
    gemm = _gemm(native)
    m, inter, k = shape
    g = torch.Generator().manual_seed(m * 7919 + inter * 31 + k)
    stored = q8_0.quantize(torch.randn(2 * inter, k, generator=g) * 0.05)
    bias = torch.randn(2 * inter, generator=g)
    x = torch.randn(m, k + 3, generator=g)[:, 1:k + 1]        # rows k + 3 floats apart
    packed = cpu_q8_0_linear.pack_panels(stored, k)
    for b in (None, bias):
        fused = gemm(x, packed, b, 2 * inter, False, threads, gated=True)
        assert fused.shape == (m, inter) and fused.dtype == torch.float32
        both = gemm(x, packed, b, 2 * inter, False, threads)
        assert torch.equal(fused, native.silu_and_mul(both, threads))
        if m:
            want = reference(x, stored, k, b)
            exact = want[:, :inter] * torch.sigmoid(want[:, :inter]) * want[:, inter:]
            weights = q8_0.dequantize(stored, k).double()
            scale = (x.abs().double() @ weights.abs().t()).max().item() + 1
            assert (fused.double() - exact).abs().max().item() <= 1e-5 * scale * (exact.abs().amax().item() + 1)


def test_packed_q8_0_gate_up_fuses_silu_and_mul(native, monkeypatch):
    """pack_gate_up on Q8_0 weights with the integer GEMM: silu_and_mul(x) == the op on self(x), 1-4
    rows through the small-rows kernel, 5+ in one gated GEMM; halves that are not whole panels keep
    the plain layer (the model then applies the op)."""
    _gemm(native)
    if not native.has_small_linear(torch.float32, torch.int8):
        pytest.skip(f"the {native.tier.name} build has no Q8_0 small-rows kernel")
    monkeypatch.setenv(cpu_q8_0_linear.GEMM_ENV, "integer-avx2")
    lin = torch.nn.Linear(320, 2 * 48)
    layer = cpu_linear.pack_gate_up(lin, native=native, quantization="q8_0")
    assert type(layer) is cpu_q8_0_linear.PackedQ8_0GateUp
    gated_calls = []
    gemm = native.gemm_q8_0
    monkeypatch.setattr(layer, "native", dataclasses.replace(native))   # its own copy to spy on
    object.__setattr__(layer.native, "gemm_q8_0", lambda *a, **k: (gated_calls.append(k.get("gated", False)),
                                                                  gemm(*a, **k))[1])
    for shape in ((3, 320), (4, 320), (2, 9, 320), (70, 320)):
        x = torch.randn(*shape)
        gated_calls.clear()
        fused = layer.silu_and_mul(x)
        assert gated_calls == ([] if x.numel() // 320 <= 4 else [True])   # 5+ rows: the one gated GEMM
        assert fused.shape == (*shape[:-1], 48)
        assert torch.equal(fused, native.silu_and_mul(layer(x).reshape(-1, 96), 2).view(*shape[:-1], 48))
    odd = torch.nn.Linear(320, 2 * 40)                      # 40 outputs a half: not whole 16-output panels
    assert type(cpu_linear.pack_gate_up(odd, native=native, quantization="q8_0")) is cpu_q8_0_linear.PackedQ8_0Linear


def test_gemm_choice_follows_the_tier_and_the_override(native, monkeypatch):
    _gemm(native)
    vnni = native.has_gemm_q8_0_vnni
    monkeypatch.delenv(cpu_q8_0_linear.GEMM_ENV, raising=False)
    default = cpu_q8_0_linear.gemm_choice(native)
    if native.tier.q8_0_integer_gemm or cpu_features.detect().q8_0_integer_gemm_beats_avx512:
        assert default == ("integer-vnni" if vnni else "integer")
    else:
        assert default == "float"
    for value, want in (("float", "float"), ("integer-avx2", "integer"),
                        ("integer", "integer-vnni" if vnni else "integer"), ("bogus", default)):
        monkeypatch.setenv(cpu_q8_0_linear.GEMM_ENV, value)
        assert cpu_q8_0_linear.gemm_choice(native) == want
    assert cpu_q8_0_linear.gemm_choice(None) == "float"
    monkeypatch.setenv(cpu_q8_0_linear.GEMM_ENV, "integer")
    lin = torch.nn.Linear(64, 24)
    assert isinstance(cpu_linear.pack_linear(lin, native=native, quantization="q8_0"), cpu_q8_0_linear.PackedQ8_0Linear)
    odd = torch.nn.Linear(48, 24)                     # not whole 32-blocks: keeps its fp32 weights
    assert type(cpu_linear.pack_linear(odd, native=native, quantization="q8_0")) is cpu_linear.PackedLinear
    monkeypatch.setenv(cpu_q8_0_linear.GEMM_ENV, "float")
    assert type(cpu_linear.pack_linear(lin, native=native, quantization="q8_0")) is cpu_linear.PackedLinear


@pytest.mark.parametrize("vendor, want", [("AuthenticAMD", "integer"), ("GenuineIntel", "float")])
def test_gemm_choice_on_the_avx512_tier_follows_the_vendor(native, monkeypatch, vendor, want):
    """On the avx512-bf16 tier the integer GEMM is the default on AMD only (Zen 4's 512-bit FMAs are
    two 256-bit halves; Intel's are full width): cpu_features.CpuFeatures.q8_0_integer_gemm_beats_avx512."""
    _gemm(native)
    if native.tier.q8_0_integer_gemm:
        pytest.skip(f"the {native.tier.name} tier takes the integer GEMM on every CPU")
    monkeypatch.delenv(cpu_q8_0_linear.GEMM_ENV, raising=False)
    real = cpu_features.detect()
    monkeypatch.setattr(cpu_features, "detect", lambda: dataclasses.replace(real, vendor=vendor))
    vnni = native.has_gemm_q8_0_vnni
    assert cpu_q8_0_linear.gemm_choice(native) == ("integer-vnni" if vnni and want == "integer" else want)


def test_a_build_whose_assembler_lacks_avx_vnni_keeps_the_avx2_path(monkeypatch, tmp_path):
    """binutils before 2.36 cannot assemble `{vex} vpdpwssd`: native_build then defines
    VB_NO_AVXVNNI_ASM and the library still builds, with the integer GEMM but no VNNI path."""
    from vbatch.kernels import cpu_native, native_build
    tier = cpu_features.AVX2
    if not tier.runs_on(cpu_features.detect()):
        pytest.skip("this CPU cannot run the avx2 tier")
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        pytest.skip("no C compiler")
    monkeypatch.setenv("VBATCH_CACHE", str(tmp_path))
    monkeypatch.setattr(native_build, "_AVXVNNI_PROBE", "void f(void) { __asm__ volatile(\"vbq8_no_such_op\"); }\n")
    native_build.toolchain_defines.cache_clear()
    try:
        assert native_build.toolchain_defines(cc, tier) == ("-DVB_NO_AVXVNNI_ASM",)
        kernels = cpu_native.NativeKernels(tier, compiler=cc)
        kernels.prepare([native_build.BASE_VARIANT])
        assert kernels.loads_since(0.0)[0].compiled
        assert kernels.has_gemm_q8_0 and not kernels.has_gemm_q8_0_vnni
        stored = q8_0.quantize(torch.randn(20, 64))
        x = torch.randn(9, 64)
        got = kernels.gemm_q8_0(x, cpu_q8_0_linear.pack_panels(stored, 64), None, 20, False, 2)
        assert torch.allclose(got.double(), reference(x, stored, 64, None), atol=1e-5)
    finally:
        native_build.toolchain_defines.cache_clear()
