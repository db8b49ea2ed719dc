"""The native C kernels (kernels/csrc via kernels/cpu_native.py) of every CPU tier this machine runs.

Each test runs once per tier the CPU can execute (kernels/cpu_features.py: an AVX-512 bf16 machine
builds and tests avx512-bf16, avx2 and portable; an AVX2 machine avx2, portable and the 16-lane
shape of the AVX-512 code in plain C: conftest.native_test_tiers) and, where the kernel has both,
for fp32 and bf16 activations (and the KV-cache variants). A kernel a build lacks (the bf16
small-rows linear needs avx512_bf16) skips with that reason.

Oracles: the references (attention_ref, norm_ref, activation_ref, cpu_rotary / rotary_ref,
cache_ref), the exact fp64 product for the small-rows linear, and the layer's own op-by-op
forward for the fused decoder layer. Tolerances:
  - attention: bf16 2e-2 (outputs O(1), rounded to bf16 once; q.k sums bf16 products in fp32, the
    softmax is online, rescaled per block); fp32 2e-5 of the fp32 SDPA reference (summation order).
  - elementwise: bf16 within one bf16 step of the reference on <= 1% of elements (same roundings,
    sums in another order); fp32 within 1e-6 relative (FMA contraction, exp polynomial 1e-7).
  - small-rows linear: within 2^-8 (bf16 rows) or 1e-5 (fp32 rows) of the row's largest output of
    the fp64 product of the very tensors it multiplies (half-precision weights widened exactly).
"""
from __future__ import annotations

import platform
import shutil
import subprocess

import pytest
import torch

from conftest import NATIVE_TEST_TIERS
from test_cpu_kernels import CASES, _random_step
from vbatch.kernels import attention_ref, cpu_features, cpu_native, cpu_rotary, gemm_libraries, native_build, q8_0
from vbatch.kernels.cpu_native_ops import NativeOps

TIERS = NATIVE_TEST_TIERS
DTYPES = [torch.float32, torch.bfloat16]
ATTN_TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}
# (activations, KV cache): native_build.VARIANTS; the half caches under fp32 are the dtype-auto storage
VARIANTS = [(torch.float32, torch.float32), (torch.float32, torch.float16), (torch.float32, torch.bfloat16),
            (torch.bfloat16, torch.bfloat16)]
VARIANT_IDS = ["fp32", "fp32-kvfp16", "fp32-kvbf16", "bf16"]
# the fp8 caches (kv_cache_dtype fp8 / fp8_e5m2) under either activations: the attention reads the
# same stored values as the reference (which widens them with .float()), so the same tolerances hold
FP8_VARIANTS = [(torch.float32, torch.float8_e4m3fn), (torch.float32, torch.float8_e5m2),
                (torch.bfloat16, torch.float8_e4m3fn), (torch.bfloat16, torch.float8_e5m2)]
FP8_VARIANT_IDS = ["fp32-kve4m3", "fp32-kve5m2", "bf16-kve4m3", "bf16-kve5m2"]

CASES = {**CASES,
         "long_prefill_on_prefix": ([37], [40], 16),      # several 16-row items over many blocks
         "prefills_block_16": ([0, 0, 21, 9], [37, 5, 19, 1], 16),  # the tiled many-row path, ragged tiles
         "prefill_block_32_on_prefix": ([40, 3], [20, 33], 32),
         "block_size_not_multiple_of_16": ([29, 3], [1, 20], 24),
         "many_decodes": ([int(x) for x in torch.randint(0, 90, (40,), generator=torch.Generator().manual_seed(1))],
                          [1] * 40, 16),
         # decode rows over hundreds of positions and many blocks (the longest above: 90 positions)
         "long_decodes": ([300, 530, 255, 256], [1, 1, 1, 1], 16),
         "long_decodes_block_8": ([520, 3], [1, 2], 8),
         "long_decodes_block_512": ([700, 1100], [1, 1], 512),
         # blocks of a size not a multiple of 4: the narrow decode path's quads of keys may cross them
         "decodes_block_6": ([37, 70, 2], [1, 1, 1], 6)}
# (head_dim, query heads per kv head): the specialised copies (64/128 x 1-8), the generic one
# (96, 12 > 8) and odd numbers of 16-lane vectors (48, 16; the bf16 AVX-512 build then uses fp32 q.k).
SHAPES = [(64, 3), (64, 7), (128, 2), (32, 1), (96, 12), (48, 3), (16, 2)]


@pytest.fixture(params=DTYPES, ids=["fp32", "bf16"])
def dtype(request) -> torch.dtype:
    return request.param


@pytest.fixture(params=VARIANTS, ids=VARIANT_IDS)
def variant(request) -> tuple[torch.dtype, torch.dtype]:
    return request.param


@pytest.fixture(params=VARIANTS + FP8_VARIANTS, ids=VARIANT_IDS + FP8_VARIANT_IDS)
def any_variant(request) -> tuple[torch.dtype, torch.dtype]:
    """`variant` and the fp8 caches: for the tests that cover every path of the attention and the KV write."""
    return request.param


def _step(case_or_lens, variant, **kwargs):
    """A random step (test_cpu_kernels._random_step) with the query in variant[0], the caches in variant[1]."""
    dtype, kv_dtype = variant if isinstance(variant, tuple) else (variant, variant)
    context_lens, query_lens, block_size = CASES[case_or_lens] if isinstance(case_or_lens, str) else case_or_lens
    query, key_cache, value_cache, attn, scale = _random_step(context_lens, query_lens, block_size, **kwargs)
    return query.to(dtype), key_cache.to(kv_dtype), value_cache.to(kv_dtype), attn, scale


def _attention_error(native, case, variant, head_dim=64, group=3, threads=2, kv_heads=2):
    dtype = variant[0]
    query, key_cache, value_cache, attn, _ = _step(case, variant, num_kv_heads=kv_heads, group=group, head_dim=head_dim)
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
    query, key_cache, value_cache, attn, scale = _step(([5, 40, 0], [1, 1, 9], 16), variant, num_kv_heads=3,
                                                       group=3, head_dim=64)
    one = native.paged_attention(query, key_cache, value_cache, attn, scale, 1)
    many = native.paged_attention(query, key_cache, value_cache, attn, scale, threads)
    assert torch.equal(one, many)


@pytest.mark.parametrize("block_size", [8, 16])  # 16: prefill rows take the tiled path
def test_native_attention_never_reads_unowned_slots(native, any_variant, block_size):
    # Slots past each request's length and blocks no request owns may hold anything (the cache is
    # allocated with torch.empty): NaN there must not reach the output.
    query, key_cache, value_cache, attn, scale = _step(([2, 13, 30], [1, 1, 7], block_size), any_variant, head_dim=64)
    want = attention_ref.paged_attention(query, key_cache, value_cache, attn, scale)
    for r, n in enumerate(attn.seq_lens_list):
        last = int(attn.block_tables[r][(n - 1) // block_size])
        key_cache[last, (n - 1) % block_size + 1:] = float("nan")     # tail of the last block
        value_cache[last, (n - 1) % block_size + 1:] = float("inf")
    owned = {int(b) for r, n in enumerate(attn.seq_lens_list) for b in attn.block_tables[r, :-(-n // block_size)]}
    for b in set(range(key_cache.shape[0])) - owned:
        key_cache[b], value_cache[b] = float("nan"), float("nan")
    got = native.paged_attention(query, key_cache, value_cache, attn, scale, 2)
    assert torch.isfinite(got.float()).all()
    assert (got.float() - want.float()).abs().max().item() < ATTN_TOL[any_variant[0]]


def test_native_attention_long_context_softmax_is_stable(native, any_variant):
    # Large logits (scores ~ +-60) over 2,000 positions: the online softmax must rescale exactly.
    dtype = any_variant[0]
    query, key_cache, value_cache, attn, _ = _step(([1999], [1], 16), any_variant, head_dim=64)
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
    query, key_cache, value_cache, attn, _ = _step(([30, 0], [50, 70], 16), any_variant, head_dim=64)
    query = (query.float() * 4).to(dtype)
    ramp = torch.linspace(0.2, 3.0, key_cache.shape[0] * key_cache.shape[1]).view(key_cache.shape[0], -1, 1, 1)
    key_cache = (key_cache.float() * ramp).to(kv_dtype)
    want = attention_ref.paged_attention(query, key_cache, value_cache, attn, 1.0)
    got = native.paged_attention(query, key_cache, value_cache, attn, 1.0, 2)
    assert (got.float() - want.float()).abs().max().item() < 10 * ATTN_TOL[dtype]


def test_unsupported_shape_is_a_typed_error_and_the_op_falls_back(native, variant):
    dtype = variant[0]
    query, key_cache, value_cache, attn, scale = _step(([3, 9], [1, 1], 8), variant, head_dim=72)  # 72 % 16 != 0
    with pytest.raises(cpu_native.NativeKernelError, match="head_dim"):
        native.paged_attention(query, key_cache, value_cache, attn, scale, 1)
    want = attention_ref.paged_attention(query, key_cache, value_cache, attn, scale)
    got = NativeOps(native).paged_attention(query, key_cache, value_cache, attn, scale)  # the bound op
    assert (got.float() - want.float()).abs().max().item() < ATTN_TOL[dtype]


def test_native_attention_reads_query_rows_in_place_from_a_qkv_view(native, variant):
    dtype = variant[0]
    query, key_cache, value_cache, attn, scale = _step(([5, 0, 30], [1, 7, 1], 16), variant, head_dim=64)
    qkv = torch.cat([query.flatten(1), torch.randn(query.shape[0], 2 * 2 * 64).to(dtype)], dim=1)
    view = qkv[:, :query.shape[1] * 64].view(query.shape)      # rows (15 * 64) elements apart
    assert not view.is_contiguous()
    want = native.paged_attention(query, key_cache, value_cache, attn, scale, 2)
    assert torch.equal(native.paged_attention(view, key_cache, value_cache, attn, scale, 2), want)


def test_build_is_cached_per_tier_and_a_missing_compiler_is_reported(tmp_path, monkeypatch):
    # One tier built into a fresh cache (every tier builds the same way; the others' libraries are the
    # ones the tests above loaded): compiled once, then reused; each tier has its own flags and key.
    tier = cpu_features.selected_tier()
    monkeypatch.setenv("VBATCH_CACHE", str(tmp_path))
    first, compiled_now = native_build.build(tier)
    assert compiled_now and first.is_file() and first.is_relative_to(tmp_path)
    mtime = first.stat().st_mtime_ns
    assert native_build.build(tier) == (first, False) and first.stat().st_mtime_ns == mtime  # reused, not rebuilt
    assert len({native_build.build_flags(t) for t in TIERS}) == len(TIERS)
    with pytest.raises(FileNotFoundError):
        native_build.build(tier, compiler=str(tmp_path / "no-such-cc"))


def test_every_kernel_source_is_compiled_or_hashed_into_the_build_key():
    """A file of kernels/csrc that neither SOURCES nor HEADERS names would be edited without the
    cached library being rebuilt (the key hashes only those)."""
    named = {path.name for path in (*native_build.SOURCES, *native_build.HEADERS)}
    on_disk = {path.name for path in native_build.CSRC.iterdir() if path.suffix in (".c", ".h")}
    assert on_disk == named


def test_extra_build_flags_come_from_the_environment(monkeypatch):
    # VBATCH_NATIVE_CFLAGS (an ASan build, docs/development.md) joins the flags, so the cache key too
    tier = cpu_features.PORTABLE
    plain = native_build.build_flags(tier)
    monkeypatch.setenv("VBATCH_NATIVE_CFLAGS", " -fsanitize=address  -g ")
    assert native_build.build_flags(tier) == (*plain, "-fsanitize=address", "-g")


def test_small_rows_prefetch_is_built_in_on_intel_only():
    # Measured: prefetching each weight stream ahead helps on an Intel Xeon, not on Zen 3 (fp32) or
    # Zen 4 (bf16: slower at 2-4 rows).
    tier = cpu_features.PORTABLE
    flags = {vendor: native_build.build_flags(tier, cpu_features.CpuFeatures(
        machine="x86_64", model_name="test", flags=frozenset({"avx2", "fma", "f16c"}), vendor=vendor))
        for vendor in ("GenuineIntel", "AuthenticAMD", "")}
    assert "-DVB_PREFETCH_STREAMS" in flags["GenuineIntel"]
    assert not any("PREFETCH" in f for f in flags["AuthenticAMD"] + flags[""])
    # and the source turns that flag into each kernel's distance: the preprocessor's own account of
    # cpu_linear_small.c's bf16 and fp32 variants under each vendor's flags (the bf16 kernel's block
    # needs avx512_bf16 targets, which preprocessing asks of no CPU)
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs an x86-64 C compiler (cc or gcc) to preprocess the kernel source")
    distances = {vendor: {} for vendor in flags}
    for vendor, vendor_flags in flags.items():
        for _, defines in (native_build.VARIANTS[torch.bfloat16, torch.bfloat16],
                           native_build.VARIANTS[torch.float32, torch.float32]):
            macros = subprocess.run([cc, *vendor_flags, *defines, "-mavx512f", "-mavx512bf16", "-E", "-dM",
                                     f"-I{native_build.CSRC}", str(native_build.CSRC / "cpu_linear_small.c")],
                                    capture_output=True, text=True, check=True).stdout
            distances[vendor] |= {name: int(value) for _, name, value in
                                  (line.split() for line in macros.splitlines() if line.startswith("#define ")
                                   and line.split()[1] in ("BF16_PREFETCH", "VB_F32_PREFETCH"))}
    assert distances["GenuineIntel"] == {"BF16_PREFETCH": 2048, "VB_F32_PREFETCH": 1024}
    assert distances["AuthenticAMD"] == distances[""] == {"BF16_PREFETCH": 0, "VB_F32_PREFETCH": 0}


# --- the small-rows linear (kernels/csrc/cpu_linear_small.c) --------------------------------------

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


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_read_probe_reads_every_word_once(native, threads):
    # The bandwidth ceiling's probe (cpu_read_probe.c): whatever the streams per thread, it returns
    # the wrapping sum of the buffer's 64-bit words, so it read each once (numpy's uint64 sum, the oracle).
    torch.manual_seed(threads)
    for count in (3 * 2**17, 3 * 2**17 + 5, 7):  # 3 MiB: whole lines in every stream; then words left over
        words = torch.randint(-2**62, 2**62, (count,), dtype=torch.int64)
        exact = int(words.numpy().view("uint64").sum(dtype="uint64"))
        for streams in (1, 2, 4, 8):
            assert native.read_probe(words, streams, threads) == exact, (count, streams)


def test_each_build_has_its_tiers_vector_width(native):
    # 16 fp32 lanes where the tier targets AVX-512 (with or without avx512_bf16; or the plain-C
    # 16-lane test build), 8 on AVX2, 4 on the portable tier's SSE2 / NEON baseline
    flags = native.tier.compile_flags
    want = (16 if "-mavx512f" in flags or "-DVB_LANES=16" in flags or "avx512f" in native.tier.required_flags
            else 8 if "-mavx2" in flags else 4)
    assert native.vector_lanes == want


@pytest.mark.parametrize("threads", [1, 2])
def test_fma_probe_runs_every_chain_and_lane(native, threads):
    # The multiply-add peak's probe (cpu_fma_probe.c): chain c runs a = a * x + y from 1 + c / 16 in
    # every lane of every thread. With x = 1/2 and y = 1/4 each step is exact in fp32 (halving, then
    # one rounding of a sum of dyadics), so the returned total is known exactly: it ran each chain
    # `iters` times, and all of them.
    lanes = native.vector_lanes
    chains = native.fma_width // lanes
    assert lanes in (4, 8, 16) and chains >= 8
    for iters in (0, 1, 3, 40, 1000):
        a = 1 + torch.arange(chains, dtype=torch.float32) / 16
        for _ in range(iters):
            a = a * 0.5 + 0.25                     # fp32: the product exact, the sum rounded once
        expected = threads * lanes * float(a.double().sum())
        assert native.fma_probe(iters, 0.5, 0.25, threads) == pytest.approx(expected, rel=1e-6), iters


def test_small_linear_refuses_more_rows_than_any_tier_asks(native, dtype):
    # cpu_linear_small.c's MAX_ROWS (32) is the most any tier's small_rows_wider asks; past it the
    # caller keeps its GEMM.
    from vbatch.kernels import cpu_features, cpu_native_ops
    most = max(tier.small_rows_wider for tier in cpu_features.TIERS)
    assert most == cpu_native_ops.FUSED_LAYER_MAX_ROWS == 32
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


# --- the fused per-token ops (kernels/csrc/cpu_elementwise.c) against their references -----------

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


# --- the native build chosen by get_ops, or its absence ------------------------------------------

def test_get_ops_binds_the_tiers_native_kernels(native, dtype):
    from vbatch.kernels.ops import get_ops
    ops = get_ops("cpu", dtype, cpu_tier=native.tier)
    assert ops.cpu_tier is native.tier and ops.native is native
    assert ops.decoder_layers is not None and ops.paged_attention.__self__.kernels is native
    half = get_ops("cpu", torch.float32, prefer_half=True, cpu_tier=native.tier)
    # dtype auto on an fp32 tier: weights and KV cache in the tier's half format
    assert half.weight_dtype == half.kv_cache_dtype == native.tier.half_dtype
    exact = get_ops("cpu", torch.float32, cpu_tier=native.tier)
    assert exact.weight_dtype == exact.kv_cache_dtype == torch.float32  # dtype float32: exact storage


def test_this_cpu_runs_its_own_fast_path():
    # No silent fallback: with a C compiler at hand the engine's ops for this CPU are its best tier's
    # native kernels (fp32 and, where the tier computes it, bf16), never the references.
    import shutil
    from vbatch.kernels.ops import get_ops
    if not (shutil.which("cc") or shutil.which("gcc")) or cpu_native.os.environ.get("VBATCH_CPU_NATIVE") == "0":
        pytest.skip("no C compiler here (or VBATCH_CPU_NATIVE=0): the torch paths are this machine's fast path")
    best = cpu_features.detect().tiers[0]
    if cpu_native.os.environ.get(cpu_features.TIER_ENV):
        best = cpu_features.selected_tier()
    for dtype in (torch.float32, torch.bfloat16) if best.bf16_compute else (torch.float32,):
        ops = get_ops("cpu", dtype)
        assert ops.cpu_tier is best and ops.native is not None and ops.native.tier is best, dtype
        assert ops.decoder_layers is not None and ops.paged_attention.__self__.kernels is ops.native


def test_without_the_native_build_the_ops_keep_the_torch_paths(monkeypatch):
    # No C compiler (or VBATCH_CPU_NATIVE=0): load() gives None and get_ops binds the torch paths
    # (oneDNN linears; bf16: the inductor decode attention; fp32: the reference attention).
    from vbatch.kernels import attention_ref, cpu_attention, cpu_linear
    from vbatch.kernels.ops import get_ops
    tier = cpu_features.selected_tier()
    monkeypatch.setattr(cpu_native, "_loaded", {tier.name: None})
    ops = get_ops("cpu", torch.float32)
    assert ops.native is None and ops.decoder_layers is None and ops.paged_attention is attention_ref.paged_attention
    packed = ops.pack_linear(torch.nn.Linear(64, 32))
    assert packed.native is None and packed.small_weight is None     # no second copy of the weights
    assert ops.weight_dtype == torch.float32 and get_ops("cpu", torch.float32, prefer_half=True).weight_dtype \
        == torch.float32                                             # nothing would stream half weights
    if tier.bf16_compute and gemm_libraries.can_pack(torch.bfloat16):
        bf16 = get_ops("cpu", torch.bfloat16)
        assert bf16.paged_attention is cpu_attention.paged_attention and bf16.compiles_on_first_use
    monkeypatch.undo()
    assert get_ops("cpu", torch.float32).native is not None or cpu_native.load() is None


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("VBATCH_CPU_NATIVE", "0")
    monkeypatch.setattr(cpu_native, "_loaded", {})  # forget the cached loads
    assert cpu_native.load() is None


# --- the whole decoder layer in one call (kernels/csrc/cpu_decoder_layer.c) ----------------------

# (activation dtype, weight storage, KV cache): fp32 exact, fp32 with the half formats (dtype auto:
# avx2 fp16, portable bf16), bf16, and the fp8 caches (kv_cache_dtype fp8 / fp8_e5m2)
LAYER_CASES = [(torch.float32, torch.float32, torch.float32), (torch.float32, torch.float16, torch.float16),
               (torch.float32, torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.bfloat16, torch.bfloat16),
               (torch.float32, torch.float16, torch.float8_e4m3fn), (torch.bfloat16, torch.bfloat16, torch.float8_e5m2)]


@pytest.mark.parametrize("act,weights,kv", LAYER_CASES,
                         ids=["fp32", "fp32-fp16", "fp32-bf16", "bf16", "fp32-fp16-kve4m3", "bf16-kve5m2"])
@pytest.mark.parametrize("name", ["llama_untied_biases", "qwen2"])  # every bias pointer; GQA
def test_fused_decoder_layer_equals_the_layer_op_by_op(native, name, act, weights, kv, monkeypatch):
    # Oracle: the same model running its layers' forward (the native ops one by one, each tested
    # against its reference above). The fused layer composes the same kernels, so the logits must
    # be identical, not just close, at every row count it takes: 1-4, and up to the tier's
    # small_rows_wider (16 or 32) where the linears' GEMM would multiply an fp32 copy of narrower
    # weights (cpu_linear.PackedLinear.small_rows); one row more must take the layer forward.
    from test_llama_model import CONFIGS, PagedBatch, prompts
    from transformers import AutoModelForCausalLM
    from vbatch.engine.models.registry import get_model_class
    from vbatch.kernels import cpu_native_ops
    from vbatch.kernels.ops import get_ops
    if not native.has_small_linear(act, weights):
        pytest.skip(f"the {native.tier.name} tier has no {act} small-rows kernel: the fused layer is off")
    if not gemm_libraries.can_pack(act):   # e.g. oneDNN held below avx512_bf16 (ONEDNN_MAX_CPU_ISA=AVX2)
        pytest.skip(f"this oneDNN packs no {act} linears: the layers stay unpacked and the fused layer is off")
    config = CONFIGS[name]()
    config.hidden_size, config.intermediate_size, config.head_dim = 256, 160, 64  # as the kernels take it
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for pname, p in hf.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if "norm" in pname else 0.15 * torch.randn_like(p))
    ops = get_ops("cpu", act, weight_dtype=weights, kv_cache_dtype=kv, cpu_tier=native.tier)
    model = get_model_class(config)(config, dtype=act, device="cpu", ops=ops)
    model.load_weights(hf.state_dict().items())
    model.finalize_weights()                                   # as the model runner does: packed linears
    assert ops.decoder_layers.__self__._layer_struct(model.layers[0]) is not None
    calls = []
    real = cpu_native.NativeKernels.decoder_layers
    monkeypatch.setattr(cpu_native.NativeKernels, "decoder_layers",
                        lambda self, *a: calls.append((a[5].shape[0], len(a[0]))) or real(self, *a))
    wider = act == torch.float32 and weights != torch.float32
    most = native.tier.small_rows_wider if wider else 4    # the rows a fused call takes
    assert ops.decoder_layers.__self__._stack(model.layers).max_rows == most
    fused_rows = tuple(sorted({rows for rows in (1, 2, 4, 5, 9, 16) if rows < most} | {most}))
    lens = [most + 1 + 5 * i % 7 for i in range(most + 1)]   # prompts longer than a fused call
    for rows in (*fused_rows, most + 1):
        seqs = prompts(config.vocab_size, lens[:rows], seed=rows)
        runs = {}
        for fused in (True, False):
            monkeypatch.setattr(cpu_native_ops, "FUSED_LAYER_MAX_ROWS", most if fused else 0)
            batch = PagedBatch(model, [len(s) + 3 for s in seqs])
            batch.kv_caches = [(k.to(kv), v.to(kv)) for k, v in batch.kv_caches]
            logits = [batch.step(model, seqs, [0] * rows)]                 # prefill
            for step in range(3):                                          # decode
                tokens = [[int(l.argmax())] for l in logits[-1][-rows:]] if step else [[5]] * rows
                logits.append(batch.step(model, tokens, [len(s) + step for s in seqs]))
            runs[fused] = logits
        for got, want in zip(runs[True], runs[False], strict=True):
            assert torch.equal(got, want), rows
    # fused: the 3 decode steps at each fused row count, every layer in one call (the prefills have
    # more tokens than a fused call takes)
    assert sorted(calls) == [(rows, config.num_hidden_layers) for rows in fused_rows for _ in range(3)]
