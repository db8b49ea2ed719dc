"""Building the native CPU kernels: the C sources in kernels/csrc compiled once per machine and CPU tier.

    build(tier) -> (path of the shared library, compiled now?)   reused from $VBATCH_CACHE when it can be
    build_flags(tier) -> the compiler flags of that tier's build
    VARIANTS: (activation dtype, KV-cache dtype) -> (entry-point suffix, -D flags)

Every source is compiled once per variant (vb_act.h: fp32 activations over an fp32, fp16 or bf16
KV cache, and bf16 activations; entry points suffixed _f32, _f32_kvf16, _f32_kvbf16, _bf16; the sources
that touch the KV cache also over an fp8 one, E4M3 or E5M2, under either activations: _f32_kve4m3 ...) with
the tier's target flags (kernels/cpu_features.py) and linked into
one library in $VBATCH_CACHE/kernels/<hash of sources, flags, compiler, CPU flags>/, written to a
temporary name and renamed, so concurrent processes never load a half-written file.
$VBATCH_NATIVE_CFLAGS adds flags to the compile and the link (part of the cache key), for debugging
builds: "-fsanitize=address -fno-omit-frame-pointer" with libasan preloaded finds a kernel's stray
write at the store that makes it (docs/development.md).
NOTE: the library is built on the machine that runs it (the cache key includes the host's CPU
flags), never shipped; a lower tier's build runs on any CPU of a higher one, so the tests build
every tier the machine can run. The bindings are kernels/cpu_native.py.
"""
from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from .cache_ref import FP8_KV_DTYPES
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
# The fp8 KV caches' variants (cache_ref.FP8_KV_DTYPES) are built from the sources that touch the
# cache only (the attention, the KV write, the decoder layer and what it calls), and bind those
# sources' entry points.
KV_SOURCES = (CSRC / "cpu_paged_attention.c", CSRC / "cpu_linear_small.c", CSRC / "cpu_elementwise.c",
              CSRC / "cpu_decoder_layer.c", CSRC / "cpu_sample.c", CSRC / "cpu_decode_steps.c")
KV_ENTRY_POINTS = ("vb_paged_attention", "vb_linear_small", "vb_rms_norm", "vb_silu_and_mul", "vb_rotary",
                   "vb_write_kv", "vb_decoder_layers", "vb_sample", "vb_decode_steps")

def _cache_dir() -> Path:
    return Path(os.environ.get("VBATCH_CACHE", Path.home() / ".cache" / "vbatch")) / "kernels"


def build_flags(tier: CpuTier, cpu: CpuFeatures | None = None) -> tuple[str, ...]:
    """The compiler flags of `tier`'s build on `cpu` (default: this machine's)."""
    prefetch = ("-DVB_PREFETCH_STREAMS",) if (cpu or detect()).prefetches_weight_streams else ()
    return (*FLAGS, *tier.compile_flags, *prefetch, *_extra_flags())


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


def build(tier: CpuTier, compiler: str | None = None, cpu: CpuFeatures | None = None) -> tuple[Path, bool]:
    """Compile the C sources for `tier` (or reuse an earlier build): (the shared library's path, True
    when it was compiled now rather than reused from the cache). `cpu`: the machine the library is
    for, when not this one (a cross compiler's target: tests/test_cross_arch.py). What the compiler
    warned of is logged at debug level."""
    cc = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise FileNotFoundError("no C compiler (cc/gcc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    flags = build_flags(tier, cpu)
    texts = [source.read_text() for source in (*SOURCES, *HEADERS)]
    for_cpu = cpu or detect()
    target_cpu = f"{for_cpu.machine} {' '.join(sorted(for_cpu.flags))}"
    key = hashlib.sha256("\0".join([*texts, " ".join(flags), version, target_cpu, tier.name]).encode())
    target = _cache_dir() / key.hexdigest()[:16] / "libvbatch_cpu.so"
    if target.exists():
        return target, False
    # probed only when compiling (58 ms a tier): what the assembler can do follows from the toolchain
    # the key already names, but for a binutils upgraded under the same compiler
    flags = (*flags, *toolchain_defines(cc, tier))
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        jobs = [([cc, *flags, *defines, f"-I{CSRC}", "-c", str(source), "-o", f"{tmp}/{source.stem}_{suffix}.o"],
                 f"{source.name} ({suffix})")
                for (_, kv_dtype), (suffix, defines) in VARIANTS.items()
                for source in (KV_SOURCES if kv_dtype in FP8_KV_DTYPES else SOURCES)]

        def compile_one(job: tuple[list[str], str]) -> subprocess.CompletedProcess:
            return subprocess.run(job[0], capture_output=True, text=True)

        with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
            for (command, what), proc in zip(jobs, pool.map(compile_one, jobs)):
                if proc.returncode != 0:
                    raise RuntimeError(f"{cc} failed to build {what} for the {tier.name} tier:\n{proc.stderr[-2000:]}")
                if proc.stderr.strip():
                    logger.debug("%s warned building %s for the %s tier:\n%s", cc, what, tier.name, proc.stderr)
        library = f"{tmp}/libvbatch_cpu.so"
        objects = [command[-1] for command, _ in jobs]
        proc = subprocess.run([cc, "-shared", "-fopenmp", *_extra_flags(), *objects, "-o", library],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed to link the native kernels:\n{proc.stderr[-2000:]}")
        os.replace(library, target)
    return target, True


def entry_suffix(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> str:
    key = (dtype, kv_dtype or dtype)
    if key not in VARIANTS:
        raise NativeKernelError(f"no native kernels for {dtype} activations over a {kv_dtype} KV cache")
    return VARIANTS[key][0]


def has_variant(dtype: torch.dtype, kv_dtype: torch.dtype | None = None) -> bool:
    return (dtype, kv_dtype or dtype) in VARIANTS
