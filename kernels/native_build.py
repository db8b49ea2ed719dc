"""Building the native CPU kernels: the C sources in kernels/csrc compiled once per machine, CPU tier and variant.

    build(tier, variants) -> (the build's folder, {variant: compiled now?})   reused from $VBATCH_CACHE when it can be
    library_path(folder, variant) -> that variant's shared library in a build's folder
    build_flags(tier) -> the compiler flags of that tier's build
    VARIANTS: (activation dtype, KV-cache dtype) -> (variant: the entry points' suffix, -D flags)

Each variant is a library of its own (vb_act.h): fp32 activations over an fp32, fp16 or bf16 KV cache,
bf16 activations over a bf16 one, and either over an fp8 one (E4M3 or E5M2); entry points suffixed
_f32, _f32_kvf16, _f32_kvbf16, _bf16, _f32_kve4m3 ... A variant whose cache is its activations' dtype
(f32, bf16) is every source; the others are the sources that touch the cache only (KV_SOURCES: the
attention, the KV write, the decoder layer and what it calls), with those sources' entry points. The
libraries of one tier share a folder, $VBATCH_CACHE/kernels/<hash of sources, flags, compiler, CPU
flags>/, each written to a temporary name and renamed, so concurrent processes never load a
half-written file.
$VBATCH_NATIVE_CFLAGS adds flags to the compile and the link (part of the cache key), for debugging
builds: "-fsanitize=address -fno-omit-frame-pointer" with libasan preloaded finds a kernel's stray
write at the store that makes it (docs/development.md).
NOTE: the library is built on the machine that runs it (the cache key includes the host's CPU
flags), never shipped; a lower tier's build runs on any CPU of a higher one, so the tests build
every tier the machine can run. The bindings are kernels/cpu_native.py.
NOTE: why a library per variant, built when first asked for: all eight variants are 68 compiles,
50 s on two cores, which a user's first run sat through in silence; an engine needs two or three of
them (fp32 activations over an fp16 cache: 17 compiles, the attention source the longest).
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .cpu_features import CpuFeatures, CpuTier, detect

logger = logging.getLogger(__name__)


class NativeKernelError(RuntimeError):
    """A native kernel refused its arguments (shape it was not built for, out of memory)."""


CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "cpu_paged_attention.c", CSRC / "cpu_linear_small.c", CSRC / "cpu_elementwise.c",
           CSRC / "cpu_decoder_layer.c", CSRC / "cpu_sample.c", CSRC / "cpu_encoder_attention.c",
           CSRC / "cpu_read_probe.c", CSRC / "cpu_fma_probe.c", CSRC / "cpu_gemm.c", CSRC / "cpu_gemm_q8.c",
           CSRC / "cpu_decode_steps.c")
HEADERS = (CSRC / "vb_simd.h", CSRC / "vb_act.h", CSRC / "vb_kernels.h", CSRC / "vb_attention.h",
           CSRC / "vb_attention_tiled.h", CSRC / "vb_attention_tiled8.h", CSRC / "vb_attention_spans.h", CSRC / "vb_blocking.h",
           CSRC / "vb_silu_mul.h")
FLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-std=gnu11", "-ffp-contract=fast",
         "-Wall", "-Wno-psabi")
# (activation dtype, KV-cache dtype): the variants the sources are compiled for (vb_act.h), with
# their entry points' suffix and the -D flags that select them
VARIANTS = {(torch.float32, torch.float32): ("f32", ("-DVB_ACT_F32",)),
            (torch.float32, torch.float16): ("f32_kvf16", ("-DVB_ACT_F32", "-DVB_KV_F16")),
            (torch.float32, torch.bfloat16): ("f32_kvbf16", ("-DVB_ACT_F32", "-DVB_KV_BF16")),
            (torch.bfloat16, torch.bfloat16): ("bf16", ()),
            (torch.float32, torch.float8_e4m3fn): ("f32_kve4m3", ("-DVB_ACT_F32", "-DVB_KV_E4M3")),
            (torch.float32, torch.float8_e5m2): ("f32_kve5m2", ("-DVB_ACT_F32", "-DVB_KV_E5M2")),
            (torch.bfloat16, torch.float8_e4m3fn): ("bf16_kve4m3", ("-DVB_KV_E4M3",)),
            (torch.bfloat16, torch.float8_e5m2): ("bf16_kve5m2", ("-DVB_KV_E5M2",))}
# A variant over a cache of another dtype than its activations (the half and fp8 caches) is built
# from the sources that touch the cache only (the attention, the KV write, the decoder layer and what
# it calls), and binds those sources' entry points; its other entry points would be its activations'
# own variant's again.
KV_SOURCES = (CSRC / "cpu_paged_attention.c", CSRC / "cpu_linear_small.c", CSRC / "cpu_elementwise.c",
              CSRC / "cpu_decoder_layer.c", CSRC / "cpu_sample.c", CSRC / "cpu_decode_steps.c")
KV_ENTRY_POINTS = ("vb_paged_attention", "vb_linear_small", "vb_rms_norm", "vb_silu_and_mul", "vb_rotary",
                   "vb_write_kv", "vb_decoder_layers", "vb_sample", "vb_decode_steps")
ALL_VARIANTS = tuple(suffix for suffix, _ in VARIANTS.values())
# the probes' and the GEMMs' variant (fp32 entry points): what cpu_native.load() builds by default
BASE_VARIANT = VARIANTS[torch.float32, torch.float32][0]
_DEFINES = {suffix: defines for suffix, defines in VARIANTS.values()}
_KV_ONLY = frozenset(suffix for (act, kv), (suffix, _) in VARIANTS.items() if act != kv)


def variant_sources(variant: str) -> tuple[Path, ...]:
    """The C sources `variant`'s library is compiled from."""
    return KV_SOURCES if variant in _KV_ONLY else SOURCES


def entry_points_of(variant: str) -> tuple[str, ...] | None:
    """The entry points (without the suffix) `variant`'s library has; None: all of them."""
    return KV_ENTRY_POINTS if variant in _KV_ONLY else None


def _cache_dir() -> Path:
    return Path(os.environ.get("VBATCH_CACHE", Path.home() / ".cache" / "vbatch")) / "kernels"


def build_flags(tier: CpuTier, cpu: CpuFeatures | None = None) -> tuple[str, ...]:
    """The compiler flags of `tier`'s build on `cpu` (default: this machine's)."""
    cpu = cpu or detect()
    prefetch = ("-DVB_PREFETCH_STREAMS",) if cpu.prefetches_weight_streams else ()
    span = cpu.span_prefetch_positions
    chosen = (*prefetch, *((f"-DSPAN_PREFETCH={span}",) if span is not None else ()))
    extra = _extra_flags()
    # a constant VBATCH_NATIVE_CFLAGS sets (bench/retune.py's alternative builds) replaces this CPU's
    # choice of it instead of redefining it
    overridden = {flag.split("=")[0] for flag in extra if flag.startswith("-D")}
    return (*FLAGS, *tier.compile_flags, *(f for f in chosen if f.split("=")[0] not in overridden), *extra)


def _extra_flags() -> tuple[str, ...]:
    return tuple(os.environ.get("VBATCH_NATIVE_CFLAGS", "").split())


_AVXVNNI_PROBE = 'void f(void) { __asm__ volatile("%{vex%} vpdpwssd %%ymm0, %%ymm1, %%ymm2" ::: "xmm2"); }\n'


@functools.cache
def toolchain_defines(cc: str, tier: CpuTier) -> tuple[str, ...]:
    """-D flags for what `cc`'s assembler cannot do for `tier`: VB_NO_AVXVNNI_ASM where it does not
    know AVX-VNNI's `{vex} vpdpwssd` (binutils before 2.36), so cpu_gemm_q8.c leaves that path out
    rather than the whole build failing."""
    if "-mavx2" not in tier.compile_flags and "-march=native" not in tier.compile_flags:
        return ()
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "probe.c"
        source.write_text(_AVXVNNI_PROBE)
        proc = subprocess.run([cc, *tier.compile_flags, "-c", str(source), "-o", str(Path(tmp) / "probe.o")],
                              capture_output=True, text=True)
    return () if proc.returncode == 0 else ("-DVB_NO_AVXVNNI_ASM",)


def _library_name(variant: str) -> str:
    return f"libvbatch_cpu_{variant}.so"


def library_path(build_or_library: Path, variant: str) -> Path:
    """`variant`'s library in a build's folder (what build() returns); a library file is itself (the
    benchmarks' --against takes either). A folder of a build from before the libraries were split by
    variant holds one library with every variant: that one."""
    if build_or_library.is_file():
        return build_or_library
    path = build_or_library / _library_name(variant)
    old = build_or_library / "libvbatch_cpu.so"
    return old if not path.exists() and old.exists() else path


def built_library(build_or_library: Path, variant: str) -> Path:
    """library_path() of a build that must already hold `variant` (the benchmarks' --against):
    FileNotFoundError, saying how to build it, when it does not."""
    path = library_path(build_or_library, variant)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: build that checkout's {variant} variant first "
                                f"(python -m vbatch.kernels.native_build {variant}, run in it)")
    return path


def build(tier: CpuTier, variants: Sequence[str] = (BASE_VARIANT,), compiler: str | None = None,
          cpu: CpuFeatures | None = None,
          compiling: Callable[[Path, list[str]], None] | None = None) -> tuple[Path, dict[str, bool]]:
    """Compile `variants` (suffixes of VARIANTS) for `tier`, those not built earlier, all compiles in one
    pool: (the build's folder, {variant: True when compiled now rather than reused from the cache});
    library_path(folder, variant) is each one's library. `cpu`: the machine the libraries are for,
    when not this one (a cross compiler's target: tests/test_cross_arch.py). `compiling(folder,
    variants)` is called before a compile starts. What the compiler warned of is logged at debug level."""
    unknown = [v for v in variants if v not in _DEFINES]
    if unknown:
        raise NativeKernelError(f"no native kernel variant {', '.join(unknown)} (there are {', '.join(ALL_VARIANTS)})")
    cc = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise FileNotFoundError("no C compiler (cc/gcc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    flags = build_flags(tier, cpu)
    texts = [source.read_text() for source in (*SOURCES, *HEADERS)]
    for_cpu = cpu or detect()
    target_cpu = f"{for_cpu.machine} {' '.join(sorted(for_cpu.flags))}"
    key = hashlib.sha256("\0".join([*texts, " ".join(flags), version, target_cpu, tier.name]).encode())
    folder = _cache_dir() / key.hexdigest()[:16]
    missing = [v for v in dict.fromkeys(variants) if not (folder / _library_name(v)).exists()]
    if missing:
        if compiling is not None:
            compiling(folder, missing)
        # probed only when compiling (58 ms a tier): what the assembler can do follows from the toolchain
        # the key already names, but for a binutils upgraded under the same compiler
        _compile(cc, (*flags, *toolchain_defines(cc, tier)), tier, folder, missing)
    return folder, {v: v in missing for v in variants}


def _compile(cc: str, flags: tuple[str, ...], tier: CpuTier, folder: Path, variants: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        # (source, variant), the longest compiles first, so that they do not end the pool's run alone
        jobs = sorted(((source, variant) for variant in variants for source in variant_sources(variant)),
                      key=lambda job: -_COMPILE_WEIGHT.get(job[0].name, 1))

        def object_of(source: Path, variant: str) -> str:
            return f"{tmp}/{source.stem}_{variant}.o"

        def compile_one(job: tuple[Path, str]) -> subprocess.CompletedProcess:
            source, variant = job
            return subprocess.run([cc, *flags, *_DEFINES[variant], f"-I{CSRC}", "-c", str(source), "-o",
                                   object_of(source, variant)], capture_output=True, text=True)

        with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
            for (source, variant), proc in zip(jobs, pool.map(compile_one, jobs)):
                what = f"{source.name} ({variant})"
                if proc.returncode != 0:
                    raise RuntimeError(f"{cc} failed to build {what} for the {tier.name} tier:\n{proc.stderr[-2000:]}")
                if proc.stderr.strip():
                    logger.debug("%s warned building %s for the %s tier:\n%s", cc, what, tier.name, proc.stderr)
        for variant in variants:
            library = f"{tmp}/{_library_name(variant)}"
            objects = [object_of(source, variant) for source in variant_sources(variant)]
            proc = subprocess.run([cc, "-shared", "-fopenmp", *_extra_flags(), *objects, "-o", library],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"{cc} failed to link the native kernels ({variant}):\n{proc.stderr[-2000:]}")
            os.replace(library, folder / _library_name(variant))


# Relative compile times of the sources (gcc 12 -O3, every tier alike): the paged attention's
# variants take about half of a build, so they start first.
_COMPILE_WEIGHT = {"cpu_paged_attention.c": 10, "cpu_linear_small.c": 3, "cpu_gemm_q8.c": 3}


def variants_for(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> tuple[str, ...]:
    """The variants a model of `dtype` activations over a `kv_dtype` KV cache (default: `dtype`) runs:
    its activations' own and its cache's, where they exist."""
    keys = ((dtype, dtype), (dtype, kv_dtype or dtype))
    return tuple(dict.fromkeys(VARIANTS[key][0] for key in keys if key in VARIANTS))


def entry_suffix(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> str:
    key = (dtype, kv_dtype or dtype)
    if key not in VARIANTS:
        raise NativeKernelError(f"no native kernels for {dtype} activations over a {kv_dtype} KV cache")
    return VARIANTS[key][0]


def has_variant(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> bool:
    return (dtype, kv_dtype or dtype) in VARIANTS


def main(argv: Sequence[str] | None = None) -> int:
    """python -m vbatch.kernels.native_build [--tier T] [VARIANT ...]: build this checkout's libraries
    (default: every variant of the selected tier) and print their folder, which the benchmarks'
    --against takes (bench/small_rows.py, decode_attention.py, gemm_builds.py)."""
    import argparse

    from .cpu_features import selected_tier, tier_named
    ap = argparse.ArgumentParser(prog="python -m vbatch.kernels.native_build",
                                 description="Build this checkout's native kernel libraries; print their folder.")
    ap.add_argument("--tier", default=None, help="a CPU tier this machine runs (default: the selected one)")
    ap.add_argument("variants", nargs="*", metavar="VARIANT", help=f"any of {', '.join(ALL_VARIANTS)} (default: all)")
    args = ap.parse_args(argv)
    tier = tier_named(args.tier) if args.tier else selected_tier()
    try:
        folder, _ = build(tier, args.variants or ALL_VARIANTS,
                          compiling=lambda _, missing: print(f"compiling {', '.join(missing)} ({tier.name} tier)",
                                                             file=sys.stderr, flush=True))
    except NativeKernelError as e:
        ap.error(str(e))
    print(folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
