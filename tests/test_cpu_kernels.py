"""The CPU fast paths (kernels/cpu_linear.py, kernels/cpu_attention.py) against their oracles.

Oracles: `F.linear` and an fp64 matmul on the same bf16 tensors for the prepacked oneDNN linear;
the reference `attention_ref.paged_attention` (itself tested against a naive fp64 softmax in
test_kernels_reference.py) for the decode attention, eager here and compiled in the slow test.
Tolerances: packed linear within one bf16 rounding of the fp64 product (2^-8 relative to the row's
largest output) and at most that far from F.linear; attention within 2e-2 of the fp32-computing
reference on bf16 caches (outputs are O(1) and rounded to bf16 once, as in test_kernels_reference).
"""
from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from test_kernels_reference import make_metadata
from vbatch.kernels import attention_ref, cpu_attention, cpu_features, cpu_linear, gemm_libraries
from vbatch.kernels.ops import REFERENCE_OPS, get_ops

torch.set_num_threads(1)

needs_bf16 = pytest.mark.skipif(not gemm_libraries.can_pack(torch.bfloat16),
                                reason="this CPU/torch has no oneDNN bf16 (avx512_bf16) path")


def _backend(name: str) -> gemm_libraries.GemmBackend:
    """oneDNN and MKL (torch's F.linear) always; zentorch on an AMD CPU where its wheel loads (the `zen` extra).

    NOTE: resolved inside the tests, not at collection: importing zentorch imports triton, and
    tests/test_triton_kernels.py must be the first to import triton (with TRITON_INTERPRET set)."""
    if name in ("onednn", "mkl"):
        return gemm_libraries.backend_named(name)
    if name == "native":   # vbatch's own (cpu_gemm.c), of the selected tier's build
        backend = gemm_libraries.backend_named("native")
        if backend is None:
            pytest.skip("this tier's native build has no GEMM (cpu_gemm.c needs AVX2 and FMA)")
        return backend
    backend = gemm_libraries._zentorch()
    if backend is None:
        if not cpu_features.detect().is_amd:
            pytest.skip(f"zentorch is AMD's library, not loaded on this {cpu_features.detect().vendor} CPU")
        pytest.skip("zentorch is not installed (the `zen` extra) or does not fit this torch")
    return backend


# (model dtype, weight storage): bf16 where the CPU computes it; fp32 exact and with fp16 / bf16 weights
PACKED = [pytest.param(torch.bfloat16, torch.bfloat16, id="bf16", marks=needs_bf16),
          pytest.param(torch.float32, torch.float32, id="fp32"),
          pytest.param(torch.float32, torch.float16, id="fp32-fp16w"),
          pytest.param(torch.float32, torch.bfloat16, id="fp32-bf16w")]
# one rounding of the result (bf16) or fp32 summation order
TOL = {torch.bfloat16: 2 ** -8, torch.float32: 1e-5}


def _native():
    from vbatch.kernels import cpu_native
    return cpu_native.load()


@pytest.mark.parametrize("dtype,weights", PACKED)
@pytest.mark.parametrize("backend", ["onednn", "zentorch", "mkl"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 4, 7, 16, 17, 64, 130])  # up to small_rows: the small-rows kernel when built
def test_packed_linear_matches_f_linear(rows, bias, backend, dtype, weights):
    backend = _backend(backend)
    torch.manual_seed(rows)
    linear = nn.Linear(96, 200, bias=bias).to(dtype)
    x = torch.randn(rows, 96).to(dtype)
    packed = cpu_linear.PackedLinear(linear, backend=backend, native=_native(), weight_dtype=weights)
    if _native() is not None:
        assert (packed.native is not None) == _native().has_small_linear(dtype, weights)
    got = packed(x)
    assert got.dtype == dtype and got.shape == (rows, 200)
    weight = linear.weight.to(weights)                       # the stored (rounded) weights are the layer's
    exact = x.double() @ weight.double().t() + (linear.bias.double() if bias else 0)
    tol = exact.abs().amax().item() * TOL[dtype]
    assert (got.double() - exact).abs().max().item() <= tol
    assert (got.double() - F.linear(x, weight.to(dtype), linear.bias).double()).abs().max().item() <= tol


# The most rows the small-rows kernel takes where the GEMM library multiplies an fp32 copy of
# narrower stored weights, per tier, as measured end to end (PackedLinear's NOTE); lanes16 is the
# tests' 16-lane plain-C build (conftest.py), at the default.
WIDER_ROWS = {"avx512-bf16": 16, "avx512": 16, "avx2": 16, "portable": 16, "lanes16": 16}


@pytest.mark.parametrize("dtype,weights,wider", [
    pytest.param(torch.bfloat16, torch.bfloat16, False, id="bf16", marks=needs_bf16),
    pytest.param(torch.float32, torch.float32, False, id="fp32"),
    pytest.param(torch.float32, torch.float16, True, id="fp32-fp16w"),
    pytest.param(torch.float32, torch.bfloat16, True, id="fp32-bf16w"),
    pytest.param(torch.float32, "q8_0-float", True, id="fp32-q8_0w-float-gemm"),
    pytest.param(torch.float32, "q8_0-integer", False, id="fp32-q8_0w-integer-gemm")])
def test_small_rows_kernel_takes_the_rows_where_it_beats_the_gemm(dtype, weights, wider, native, monkeypatch):
    # PackedLinear's NOTE: up to WIDER_ROWS[tier] rows where the GEMM library multiplies an fp32 copy
    # of narrower stored weights (it streams twice the bytes or more), else up to 4; one row more
    # takes the GEMM. Every tier this CPU runs (conftest.py's `native`), not only the selected one.
    from vbatch.kernels import cpu_native, cpu_q8_0_linear
    stored = torch.int8 if isinstance(weights, str) else weights
    if not native.has_small_linear(dtype, stored):
        pytest.skip(f"the {native.tier.name} build has no small-rows kernel for these rows and weights")
    most = WIDER_ROWS[native.tier.name] if wider else 4
    torch.manual_seed(most)
    linear = nn.Linear(64, 48).to(dtype)
    if weights == "q8_0-integer":
        if not native.has_gemm_q8_0:
            pytest.skip(f"the {native.tier.name} tier has no integer Q8_0 GEMM")
        packed = cpu_q8_0_linear.PackedQ8_0Linear(linear, native=native, vnni=False)
    else:
        packed = cpu_linear.PackedLinear(linear, native=native, weight_dtype=None if isinstance(weights, str) else weights,
                                         quantization="q8_0" if isinstance(weights, str) else None)
    assert packed.small_rows == most
    seen = []
    real = cpu_native.NativeKernels.linear_small
    monkeypatch.setattr(cpu_native.NativeKernels, "linear_small",
                        lambda self, rows, *a: seen.append(rows.shape[0]) or real(self, rows, *a))
    for rows in (1, most, most + 1):
        x = torch.randn(rows, 64).to(dtype)
        assert (packed(x).double() - F.linear(x, linear.weight).double().add(linear.bias.double())).abs().max() < 0.05
    assert seen == [1, most]


@pytest.mark.parametrize("dtype,weights", PACKED)
@pytest.mark.parametrize("backend", ["onednn", "zentorch", "native"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 33, 64, 130])  # up to small_rows: small-rows kernel + native SiLU
def test_packed_gate_up_silu_and_mul_matches_the_reference(rows, bias, backend, dtype, weights):
    from vbatch.kernels import activation_ref
    backend = _backend(backend)
    if dtype not in backend.dtypes:
        pytest.skip(f"{backend.name} has no {dtype} GEMM")
    torch.manual_seed(rows)
    inter = 80
    linear = nn.Linear(96, 2 * inter, bias=bias).to(dtype)
    x = torch.randn(rows, 96).to(dtype)
    packed = cpu_linear.PackedGateUp(linear, backend=backend, native=_native(), weight_dtype=weights)
    assert packed.one_gemm == (backend.gated is not None)
    bound = cpu_linear.pack_gate_up(linear, native=_native(), weight_dtype=weights)
    # SiLU and the product fused into the GEMMs for bf16, and for fp32 where the tier's library has a
    # gated GEMM (vbatch's own); else fp32 takes one plain GEMM (oneDNN's post-ops ran slower)
    fused = dtype == torch.bfloat16 or gemm_libraries.gemm_backend(dtype, _native().tier).gated is not None
    assert type(bound) is (cpu_linear.PackedGateUp if fused else cpu_linear.PackedLinear)
    weight = linear.weight.to(weights).to(dtype)
    product = F.linear(x, weight, linear.bias)                            # [rows, 2 * inter]
    tol = TOL[dtype]
    assert torch.equal(packed(x), product) or (packed(x).double() - product.double()).abs().max() <= \
        product.abs().amax().item() * tol                                  # the Linear's contract
    got = packed.silu_and_mul(x)
    assert got.dtype == dtype and got.shape == (rows, inter)
    assert packed.silu_and_mul(x.view(1, rows, 96)).shape == (1, rows, inter)
    # Oracle 1: the exact fp64 result; oracle 2: the reference op on the product.
    exact = x.double() @ weight.double().t() + (linear.bias.double() if bias else 0)
    gate, up = exact[..., :inter], exact[..., inter:]
    exact_act = gate * torch.sigmoid(gate) * up
    reference = activation_ref.silu_and_mul(product)
    scale = exact_act.abs().amax().item()
    act_tol = 2 ** -6 if dtype == torch.bfloat16 else 1e-5
    assert (got.double() - exact_act).abs().max().item() <= scale * act_tol
    assert (reference.double() - exact_act).abs().max().item() <= scale * act_tol   # the same tolerance fits both
    assert (got.double() - exact_act).abs().mean() <= 1.5 * (reference.double() - exact_act).abs().mean() + 1e-6
    if rows <= packed.small_rows or packed.one_gemm:
        # the small path is the separate native ops; the gated GEMM's epilogue has their formula
        assert torch.equal(got, packed.native.silu_and_mul(packed(x), torch.get_num_threads()))


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=needs_bf16), torch.float32])
@pytest.mark.parametrize("backend", ["onednn", "zentorch", "mkl"])
def test_describe_names_the_gemm_library(backend, dtype):
    backend = _backend(backend)
    model = nn.Sequential(nn.Linear(32, 48).to(dtype))
    assert cpu_linear.describe(model) is None                              # nothing packed
    model[0] = cpu_linear.PackedLinear(model[0], backend=backend)
    assert cpu_linear.describe(model).split()[0] == backend.name


def test_zentorch_is_skipped_when_disabled(monkeypatch):
    monkeypatch.setenv("VBATCH_ZENTORCH", "0")
    assert gemm_libraries._zentorch() is None


def test_zentorch_is_not_loaded_on_a_cpu_that_is_not_amds(monkeypatch, caplog):
    # kernels/cpu_linear.py _zentorch: AMD's library, slower than oneDNN on the Intel Xeon; there not even
    # imported (asked for by name, a warning and the default)
    intel = cpu_features.CpuFeatures("x86_64", "Intel Xeon", frozenset({"avx512_bf16", "amx_bf16", "avx", "avx2", "fma",
                                                                        "f16c"}), "GenuineIntel")
    monkeypatch.setattr(cpu_features, "detect", lambda: intel)
    assert gemm_libraries._zentorch() is None
    gemm_libraries.gemm_backend.cache_clear()
    monkeypatch.setenv("VBATCH_GEMM", "zentorch")
    try:
        with caplog.at_level("WARNING"):
            assert gemm_libraries.gemm_backend(torch.bfloat16) is gemm_libraries.ONEDNN
        assert "VBATCH_GEMM=zentorch does not load on this machine" in caplog.text
    finally:
        gemm_libraries.gemm_backend.cache_clear()


def test_gemm_library_default_and_override(monkeypatch):
    # fp32: vbatch's own GEMM on the avx2 tier, oneDNN on the others (measured ahead of zentorch and
    # MKL on Zen 3); VBATCH_GEMM names another.
    from vbatch.kernels import cpu_native
    tier = cpu_features.selected_tier()
    kernels = cpu_native.load(tier)
    default = "native" if tier.native_gemm and kernels is not None and kernels.has_gemm else "onednn"
    gemm_libraries.gemm_backend.cache_clear()
    monkeypatch.delenv("VBATCH_GEMM", raising=False)
    try:
        assert gemm_libraries.gemm_backend(torch.float32).name == default
        gemm_libraries.gemm_backend.cache_clear()
        monkeypatch.setenv("VBATCH_GEMM", "mkl")
        assert gemm_libraries.gemm_backend(torch.float32) is gemm_libraries.MKL
        gemm_libraries.gemm_backend.cache_clear()
        monkeypatch.setenv("VBATCH_GEMM", "no-such-library")      # a warning, then the default
        assert gemm_libraries.gemm_backend(torch.float32).name == default
    finally:
        gemm_libraries.gemm_backend.cache_clear()


def test_gemm_library_follows_the_cpu(monkeypatch):
    # bf16: zentorch only on AMD CPUs (where it was measured faster), oneDNN elsewhere (AMX on Intel,
    # where zentorch ran at 0.10-0.24x); fp32: vbatch's own GEMM on the avx2 tier where its build has
    # one, oneDNN on the others.
    from vbatch.kernels import cpu_native
    amd = cpu_features.CpuFeatures("x86_64", "AMD EPYC", frozenset({"avx512_bf16"}), "AuthenticAMD")
    intel = cpu_features.CpuFeatures("x86_64", "Intel Xeon", frozenset({"avx512_bf16", "amx_bf16"}), "GenuineIntel")
    bf16_tier, avx2, portable = cpu_features.AVX512_BF16, cpu_features.AVX2, cpu_features.PORTABLE
    zen = gemm_libraries._zentorch()
    assert gemm_libraries.default_backend(torch.bfloat16, intel, bf16_tier) is gemm_libraries.ONEDNN
    assert gemm_libraries.default_backend(torch.float32, amd, bf16_tier) is gemm_libraries.ONEDNN
    assert gemm_libraries.default_backend(torch.float32, intel, bf16_tier) is gemm_libraries.ONEDNN
    assert gemm_libraries.default_backend(torch.bfloat16, amd, bf16_tier).name == (zen.name if zen else "onednn")
    assert gemm_libraries.default_backend(torch.float32, amd, portable) is gemm_libraries.ONEDNN
    # AVX-512 without avx512_bf16 (Intel Cascade Lake): fp32 in oneDNN's AVX-512 kernels, not the AVX2 GEMM
    cascade = cpu_features.CpuFeatures("x86_64", "Intel Xeon Gold 6248", frozenset({"avx512f", "avx512bw"}),
                                       "GenuineIntel")
    assert gemm_libraries.default_backend(torch.float32, cascade, cpu_features.AVX512) is gemm_libraries.ONEDNN
    if avx2.runs_on(cpu_features.detect()):
        kernels = cpu_native.load(avx2)
        want = "native" if kernels is not None and kernels.has_gemm else "onednn"
        assert gemm_libraries.default_backend(torch.float32, amd, avx2).name == want
        assert gemm_libraries.default_backend(torch.bfloat16, intel, avx2) is gemm_libraries.ONEDNN
    monkeypatch.setenv("VBATCH_ZENTORCH", "0")
    assert gemm_libraries.default_backend(torch.bfloat16, amd, bf16_tier) is gemm_libraries.ONEDNN


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=needs_bf16), torch.float32])
def test_packed_linear_keeps_leading_dims_and_fp16_stays_plain(dtype):
    linear = nn.Linear(32, 48).to(dtype)
    x = torch.randn(2, 3, 32).to(dtype)
    assert cpu_linear.pack_linear(linear)(x).shape == (2, 3, 48)
    plain = nn.Linear(32, 48).to(torch.float16)
    assert cpu_linear.pack_linear(plain) is plain


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=needs_bf16), torch.float32])
def test_mlp_in_row_chunks_matches_the_whole_step(dtype):
    """A large step's gated MLP runs Ops.mlp_chunk_rows rows at a time (each chunk's intermediate
    stays in cache); every row gets what the MLP gives it over all rows at once. fp32: to fp32
    rounding (bit for bit on the Intel Xeon, AVX-512 and AVX2 kernels alike; another oneDNN build may
    block the sums differently for a 13-row chunk); bf16: within a bf16 rounding of the output's
    scale, as its AMX/AVX-512 kernels change blocking with the row count."""
    import dataclasses
    import types

    from vbatch.engine.models.llama import LlamaMLP
    if dtype == torch.bfloat16 and not cpu_features.selected_tier().bf16_compute:
        pytest.skip(f"the selected {cpu_features.selected_tier().name} tier has no bf16 kernels (VBATCH_CPU_TIER)")
    ops = get_ops("cpu", dtype)
    assert ops.mlp_chunk_rows == cpu_linear.MLP_CHUNK_ROWS
    shape = types.SimpleNamespace(hidden_size=96, intermediate_size=160, mlp_bias=False)
    torch.manual_seed(0)
    mlp = LlamaMLP(shape, dataclasses.replace(ops, mlp_chunk_rows=None)).to(dtype)
    mlp.gate_up = (ops.pack_gate_up or ops.pack_linear)(mlp.gate_up)
    mlp.down_proj = ops.pack_linear(mlp.down_proj)
    x = torch.randn(333, 96).to(dtype)
    with torch.no_grad():
        whole = mlp(x)
        for chunk in (64, 100, 333, 1000):  # whole chunks, a ragged last one, one chunk, more than the rows
            mlp.ops = dataclasses.replace(ops, mlp_chunk_rows=chunk)
            got = mlp(x)
            assert got.shape == whole.shape and got.dtype == dtype
            tol = 2 ** -20 if dtype == torch.float32 else 2 ** -7   # a wrong chunk is off by O(1)
            assert (got.float() - whole.float()).abs().max() <= whole.float().abs().max() * tol, chunk
        rows = [mlp(x[i:i + 1]) for i in (0, 64, 332)]  # and against single rows (the small-rows kernel)
    for got, i in zip(rows, (0, 64, 332)):
        assert (got.float() - whole[i:i + 1].float()).abs().max() <= whole.float().abs().max() * 2 ** -6


def test_get_ops_binds_the_cpu_paths_for_fp32_and_bf16():
    from vbatch.kernels import cpu_features, cpu_native
    assert get_ops("cpu") is REFERENCE_OPS
    assert get_ops("cpu", torch.float16).paged_attention is attention_ref.paged_attention  # no fp16 CPU path
    tier = cpu_features.selected_tier()
    native = cpu_native.load(tier)
    fp32 = get_ops("cpu", torch.float32)
    assert fp32.cpu_tier is tier and fp32.native is native
    packs = gemm_libraries.can_pack(torch.float32)
    assert isinstance(fp32.pack_linear(nn.Linear(32, 48)), cpu_linear.PackedLinear) == packs
    bf16_ops = get_ops("cpu", torch.bfloat16)
    if tier.bf16_compute and gemm_libraries.can_pack(torch.bfloat16):
        want = cpu_attention.paged_attention if native is None else None
        assert want is None or bf16_ops.paged_attention is want
        assert isinstance(bf16_ops.pack_gate_up(nn.Linear(32, 48).to(torch.bfloat16)), cpu_linear.PackedGateUp)
    else:  # bf16 is not this CPU's compute dtype: torch's GEMMs stay, the native attention still runs
        assert bf16_ops.pack_linear(nn.Linear(32, 48).to(torch.bfloat16)).__class__ is nn.Linear


def _random_step(context_lens, query_lens, block_size, num_kv_heads=2, group=3, head_dim=16, seed=0):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = sum(-(-(c + q) // block_size) for c, q in zip(context_lens, query_lens)) + 3
    attn = make_metadata(context_lens, query_lens, block_size, num_blocks, rng)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.randn(shape).to(torch.bfloat16)
    value_cache = torch.randn(shape).to(torch.bfloat16)
    query = torch.randn(sum(query_lens), num_kv_heads * group, head_dim).to(torch.bfloat16)
    return query, key_cache, value_cache, attn, head_dim ** -0.5


CASES = {
    "decode_equal_lengths": ([5, 5, 5], [1, 1, 1], 4),
    "decode_ragged": ([0, 3, 17, 40, 8], [1, 1, 1, 1, 1], 4),
    "decode_one_request": ([29], [1], 8),
    "decode_big_blocks": ([100, 7, 255], [1, 1, 1], 128),
    "mixed_prefill_and_decode": ([6, 0, 11, 3], [1, 9, 1, 4], 4),
    "prefills_and_chunk": ([0, 0, 7], [12, 5, 6], 4),
    "decode_single_block": ([2, 1], [1, 1], 8),   # one-column block tables get padded to two
}


@pytest.mark.parametrize("case", list(CASES))
def test_cpu_paged_attention_eager_matches_reference(case, monkeypatch):
    monkeypatch.setattr(cpu_attention, "_compiled", cpu_attention.decode_attention)  # eager: fast CI
    context_lens, query_lens, block_size = CASES[case]
    query, key_cache, value_cache, attn, scale = _random_step(context_lens, query_lens, block_size)
    want = attention_ref.paged_attention(query, key_cache, value_cache, attn, scale)
    got = cpu_attention.paged_attention(query, key_cache, value_cache, attn, scale)
    assert got.dtype == query.dtype and got.shape == want.shape
    assert (got.float() - want.float()).abs().max().item() < 2e-2


def test_decode_attention_ignores_non_finite_padding_blocks(monkeypatch):
    # Cache slots past a request's length (and block 0, the padding block) may hold anything.
    monkeypatch.setattr(cpu_attention, "_compiled", cpu_attention.decode_attention)
    query, key_cache, value_cache, attn, scale = _random_step([2, 13], [1, 1], 4)
    want = attention_ref.paged_attention(query, key_cache, value_cache, attn, scale)
    used = set()
    for r, n in enumerate(attn.seq_lens_list):
        used.update(int(b) for b in attn.block_tables[r, :-(-n // 4)])
    for b in range(key_cache.shape[0]):
        if b not in used:
            key_cache[b] = float("nan")
            value_cache[b] = float("inf")
    got = cpu_attention.paged_attention(query, key_cache, value_cache, attn, scale)
    assert torch.isfinite(got.float()).all()
    assert (got.float() - want.float()).abs().max().item() < 2e-2


@pytest.mark.slow
def test_compiled_decode_attention_matches_reference():
    """The inductor-compiled kernel (the one the engine runs), batch > 1 and batch 1."""
    for case in ("decode_ragged", "decode_one_request", "decode_big_blocks", "mixed_prefill_and_decode",
                 "decode_single_block", "decode_equal_lengths"):
        context_lens, query_lens, block_size = CASES[case]
        query, key_cache, value_cache, attn, scale = _random_step(context_lens, query_lens, block_size)
        want = attention_ref.paged_attention(query, key_cache, value_cache, attn, scale)
        got = cpu_attention.paged_attention(query, key_cache, value_cache, attn, scale)
        assert (got.float() - want.float()).abs().max().item() < 2e-2, case


_CROSS_ISA_CHILD = """
import sys, torch
sys.path.insert(0, {tests!r})
torch.set_num_threads(1)
from test_cpu_kernels import CASES, _random_step
from vbatch.kernels import attention_ref, cpu_attention
for case in ("decode_ragged", "decode_big_blocks", "decode_single_block"):
    query, key_cache, value_cache, attn, scale = _random_step(*CASES[case])
    want = attention_ref.paged_attention(query, key_cache, value_cache, attn, scale)
    got = cpu_attention.paged_attention(query, key_cache, value_cache, attn, scale)
    err = (got.float() - want.float()).abs().max().item()
    print(case, err)
    assert err < 2e-2, case
"""


@pytest.mark.slow
def test_compiled_decode_attention_survives_a_cache_from_another_isa(tmp_path):
    """kernels/cpu_attention.py _inductor_options: a process held to a narrower instruction set fills
    inductor's on-disk cache first, then one on this CPU's own reads the same cache. Before the width
    was named in the options the second process loaded the first one's entry and wrote past its
    buffers (glibc aborted: "double free or corruption (!prev)")."""
    from torch._inductor.cpu_vec_isa import pick_vec_isa
    width = pick_vec_isa().bit_width()
    if width < 256:
        pytest.skip("inductor has no vector instruction set here to compare with a narrower one")
    narrower = "avx2" if width > 256 else "default"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    env.pop("VBATCH_CPU_COMPILE", None)
    child = [sys.executable, "-c", _CROSS_ISA_CHILD.format(tests=str(Path(__file__).parent))]
    for step_env in ({**env, "ATEN_CPU_CAPABILITY": narrower}, env):
        proc = subprocess.run(child, env=step_env, capture_output=True, text=True, timeout=600)
        held = step_env.get("ATEN_CPU_CAPABILITY", "this CPU's own")
        assert proc.returncode == 0, f"ISA {held}: rc {proc.returncode}\n{proc.stdout}{proc.stderr[-3000:]}"


@pytest.mark.parametrize("context_len,query_len", [(0, 1), (0, 13), (5, 4), (20, 1)])
def test_prefill_attention_flash_path_matches_reference_in_fp32(context_len, query_len):
    # The fp32 CPU path (4-D flash SDPA) against the reference's masked SDPA on the same fp32 inputs.
    torch.manual_seed(context_len * 31 + query_len)
    seq_len = context_len + query_len
    query = torch.randn(query_len, 6, 16)
    key, value = torch.randn(seq_len, 2, 16), torch.randn(seq_len, 2, 16)
    want = attention_ref._attend_one_request(query, key, value, 0.25)
    got = cpu_attention._attend_prefill(query, key, value, 0.25)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 5, 64])
def test_per_step_rotary_matches_reference(num_tokens, dtype):
    from vbatch.kernels import cpu_rotary, rotary_ref
    torch.manual_seed(num_tokens)
    cache = rotary_ref.build_rope_cache(64, 1024, 10000.0, None)
    positions = torch.randint(0, 1024, (num_tokens,))
    q, k = torch.randn(num_tokens, 9, 64).to(dtype), torch.randn(num_tokens, 3, 64).to(dtype)
    want_q, want_k = rotary_ref.apply_rotary(positions, q, k, cache)
    tables = cpu_rotary.prepare_rotary(positions, cache, dtype)
    got_q, got_k = cpu_rotary.apply_rotary(positions, q, k, tables)
    # Same fp32 table, same casts, same products: equal up to the order of one add (bf16: exact here).
    torch.testing.assert_close(got_q, want_q, atol=1e-6, rtol=0)
    torch.testing.assert_close(got_k, want_k, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_tables_from_the_kept_whole_table_equal_the_rows_expanded(dtype, monkeypatch):
    # The whole cache expanded once (kept on the cache) and the step's rows expanded (a cache too big
    # to keep) must give the same tables, bit for bit, for any positions.
    from vbatch.kernels import cpu_rotary, rotary_ref
    cache = rotary_ref.build_rope_cache(64, 1024, 10000.0, None)
    positions = torch.tensor([0, 1023, 7, 7, 512])
    kept = cpu_rotary.prepare_rotary(positions, cache, dtype)
    assert cache._vb_rotary_tables[dtype][0].shape == (1024, 1, 64)     # kept, the whole cache
    assert cpu_rotary.prepare_rotary(positions, cache, dtype)[0].data_ptr() != kept[0].data_ptr()  # a fresh gather
    monkeypatch.setattr(cpu_rotary, "EXPANDED_MAX_BYTES", 0)
    small = rotary_ref.build_rope_cache(64, 1024, 10000.0, None)
    rows = cpu_rotary.prepare_rotary(positions, small, dtype)
    assert small._vb_rotary_tables[dtype] is None                      # too big: nothing kept
    half = 32
    want_cos = cache[positions, :half].repeat(1, 2).to(dtype)
    want_sin = torch.cat((-cache[positions, half:], cache[positions, half:]), -1).to(dtype)
    for tables in (kept, rows):
        assert tables[0].shape == tables[1].shape == (5, 1, 64) and tables[0].dtype == dtype
        assert torch.equal(tables[0][:, 0], want_cos) and torch.equal(tables[1][:, 0], want_sin)


@pytest.mark.parametrize("case", ["decode_ragged", "decode_single_block", "mixed_prefill_and_decode"])
def test_prepared_attention_matches_reference(case, monkeypatch):
    # The per-step slot table (prepare_attention, as the model's forward calls it) gives the same rows.
    monkeypatch.setattr(cpu_attention, "_compiled", cpu_attention.decode_attention)
    context_lens, query_lens, block_size = CASES[case]
    query, key_cache, value_cache, attn, scale = _random_step(context_lens, query_lens, block_size)
    prepared = cpu_attention.prepare_attention(attn)
    assert (prepared is attn) == (not attn.is_decode_only)
    want = attention_ref.paged_attention(query, key_cache, value_cache, attn, scale)
    got = cpu_attention.paged_attention(query, key_cache, value_cache, prepared, scale)
    assert (got.float() - want.float()).abs().max().item() < 2e-2
