"""The native kernels' build (kernels/native_build.py), its probes (read bandwidth, multiply-add
peak, vector width) and the ops get_ops binds from it (kernels/ops.py), per CPU tier this machine
runs (conftest.native_test_tiers).
"""
from __future__ import annotations

import platform
import re
import shutil
import subprocess

import pytest
import torch

from conftest import NATIVE_TEST_TIERS
from vbatch.kernels import cpu_features, cpu_native, gemm_libraries, native_build

TIERS = NATIVE_TEST_TIERS

def test_build_is_cached_per_tier_and_variant_and_a_missing_compiler_is_reported(tmp_path, monkeypatch):
    # One tier built into a fresh cache (every tier builds the same way; the others' libraries are the
    # ones the tests above loaded): each variant compiled when first asked for, then reused; each tier
    # has its own flags and key.
    tier = cpu_features.selected_tier()
    monkeypatch.setenv("VBATCH_CACHE", str(tmp_path))
    folder, compiled = native_build.build(tier)
    assert compiled == {native_build.BASE_VARIANT: True} and folder.is_relative_to(tmp_path)
    base = native_build.library_path(folder, native_build.BASE_VARIANT)
    assert sorted(p.name for p in folder.iterdir()) == [base.name]   # that variant only, no scraps
    mtime = base.stat().st_mtime_ns
    assert native_build.build(tier) == (folder, {"f32": False}) and base.stat().st_mtime_ns == mtime  # reused
    both = native_build.build(tier, ("f32", "f32_kve4m3"))
    assert both == (folder, {"f32": False, "f32_kve4m3": True}) and base.stat().st_mtime_ns == mtime
    assert len({native_build.build_flags(t) for t in TIERS}) == len(TIERS)
    with pytest.raises(FileNotFoundError):
        native_build.build(tier, compiler=str(tmp_path / "no-such-cc"))
    with pytest.raises(native_build.NativeKernelError, match="no native kernel variant f16"):
        native_build.build(tier, ("f16",))


def test_a_variant_over_another_cache_holds_the_cache_sources_only(native):
    # fp32 activations over an fp16 cache: the attention, the KV write and the layers that call them;
    # the GEMMs, the probes and the encoder attention are the f32 variant's alone.
    kv_only = native.library("f32_kvf16")
    assert native_build.variant_sources("f32_kvf16") == native_build.KV_SOURCES
    assert native_build.variant_sources("bf16") == native_build.variant_sources("f32") == native_build.SOURCES
    for name in native_build.KV_ENTRY_POINTS:
        assert hasattr(kv_only, f"{name}_f32_kvf16"), name
    for name in ("vb_gemm", "vb_fma_probe", "vb_read_probe", "vb_encoder_attention"):
        assert not hasattr(kv_only, f"{name}_f32_kvf16") and hasattr(native.library("f32"), f"{name}_f32"), name
    assert native_build.variants_for(torch.float32, torch.float16) == ("f32", "f32_kvf16")
    assert native_build.variants_for(torch.bfloat16) == ("bf16",)
    assert native_build.variants_for(torch.bfloat16, torch.float16) == ("bf16",)   # no such kernels: torch's


def test_library_path_takes_a_folder_an_older_builds_folder_or_a_library(tmp_path):
    # the benchmarks' --against: this tree's folders hold a library per variant; a build from before
    # session 39 holds one library with every variant; a library file is itself
    split, single = tmp_path / "split", tmp_path / "single"
    split.mkdir(), single.mkdir()
    (split / "libvbatch_cpu_f32_kvf16.so").touch()
    (single / "libvbatch_cpu.so").touch()
    assert native_build.library_path(split, "f32_kvf16") == split / "libvbatch_cpu_f32_kvf16.so"
    assert native_build.library_path(split, "bf16") == split / "libvbatch_cpu_bf16.so"   # not built: named anyway
    assert native_build.library_path(single, "bf16") == single / "libvbatch_cpu.so"
    assert native_build.library_path(single / "libvbatch_cpu.so", "f32") == single / "libvbatch_cpu.so"
    assert native_build.built_library(single, "bf16") == single / "libvbatch_cpu.so"
    with pytest.raises(FileNotFoundError, match=r"libvbatch_cpu_bf16.so does not exist: .*native_build bf16"):
        native_build.built_library(split, "bf16")


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


def test_zen_3_builds_its_own_span_prefetch_distance(monkeypatch):
    # Measured: the decode spans read faster prefetching 16 positions ahead on Zen 3, 32 on Zen 4 and
    # the Intel Xeon (vb_attention_spans.h SPAN_PREFETCH's NOTE). Family 25 is Zen 3 at model 1 and
    # Zen 4 at model 0x11; the source's #ifndef then takes the flag (the preprocessor's own account).
    def cpu(vendor: str, family: int, model: int) -> cpu_features.CpuFeatures:
        return cpu_features.CpuFeatures(machine="x86_64", model_name="test", flags=frozenset({"avx2", "fma", "f16c"}),
                                        vendor=vendor, family_model=(family, model))
    tier = cpu_features.PORTABLE
    zen3 = native_build.build_flags(tier, cpu("AuthenticAMD", 25, 0x01))
    assert "-DSPAN_PREFETCH=16" in zen3
    for other in (cpu("AuthenticAMD", 25, 0x11), cpu("AuthenticAMD", 26, 0x02), cpu("GenuineIntel", 6, 0x8F)):
        assert not any(flag.startswith("-DSPAN_PREFETCH") for flag in native_build.build_flags(tier, other))
    # a race's alternative (VBATCH_NATIVE_CFLAGS, bench/retune.py) replaces the CPU's choice, not redefines it
    monkeypatch.setenv("VBATCH_NATIVE_CFLAGS", "-DSPAN_PREFETCH=32")
    raced = native_build.build_flags(tier, cpu("AuthenticAMD", 25, 0x01))
    assert [f for f in raced if f.startswith("-DSPAN_PREFETCH")] == ["-DSPAN_PREFETCH=32"]
    monkeypatch.delenv("VBATCH_NATIVE_CFLAGS")
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("needs a C compiler (cc or gcc) to preprocess the kernel source")
    _, defines = native_build.VARIANTS[torch.float32, torch.float16]
    distance = {}
    for name, flags in (("zen3", zen3), ("zen4", native_build.build_flags(tier, cpu("AuthenticAMD", 25, 0x11)))):
        source = "#include \"vb_attention_spans.h\"\nint span_prefetch = SPAN_PREFETCH;\n"
        out = subprocess.run([cc, *flags, *defines, "-E", f"-I{native_build.CSRC}", "-x", "c", "-"], input=source,
                             capture_output=True, text=True, check=True).stdout
        distance[name] = re.search(r"int span_prefetch = (\w+);", out).group(1)
    assert distance == {"zen3": "16", "zen4": "32"}


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
    from vbatch.kernels import attention_ref, cpu_attention
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
