"""What this CPU can run, read once: its instruction-set features and the native-kernel tier they allow.

    detect() -> CpuFeatures            the flags of this machine's CPU (cached)
    CpuFeatures.tiers                  the tiers it runs, fastest first
    selected_tier() -> CpuTier         the best of them, or the one VBATCH_CPU_TIER names

A tier is one build of the native C kernels (kernels/native_build.py compiles one library per tier
with the tier's compiler flags) plus the choices that go with it: which half-precision format an
fp32 model's weights and KV cache are stored in (dtype auto), and whether bf16 is a compute dtype
worth choosing.

    avx512-bf16  AVX-512 with avx512_bf16 (Zen 4, Sapphire Rapids): bf16 models, vdpbf16ps dot
                 products; built with -march=native.
    avx512       AVX-512 F/BW/VL/DQ without avx512_bf16 (Intel Skylake-SP, Cascade Lake, Ice Lake: most
                 cloud x86 servers): as avx2, fp32 arithmetic over fp16-stored weights and KV cache, in
                 16-lane vectors; the 5+-row GEMMs in oneDNN's AVX-512 fp32 (gemm_libraries NOTE).
    avx2         AVX2 + FMA + F16C (Zen 2/3, Haswell and later): fp32 models whose weights and KV
                 cache are stored as fp16 (widened by vcvtph2ps), fp32 FMAs.
    portable     plain C that the compiler vectorises for its baseline target (SSE2 on x86-64,
                 NEON on aarch64): fp32 models, bf16-stored weights and KV cache (widened by a shift).

Every tier runs on a CPU that runs a faster one, so an AVX-512 machine with avx512_bf16 can build
and test all four and an AVX2 machine two (tests/conftest.py native_test_tiers);
VBATCH_CPU_TIER=portable forces the slowest for the whole process. The engine never compares tier names: it asks a tier's fields.
"""
from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

import torch

from ..engine.errors import ConfigError
from .cpuinfo import BF16_TIER_NAME, TIER_ENV, read_cpu


@dataclass(frozen=True)
class CpuTier:
    name: str
    required_flags: frozenset[str]      # /proc/cpuinfo flags the built code executes
    compile_flags: tuple[str, ...]      # the target flags for this tier's build
    half_dtype: torch.dtype             # how an fp32 model (dtype auto) stores weights and KV cache, widened in registers
    bf16_compute: bool                  # bf16 dot products in hardware: bf16 is the fast model dtype
    description: str
    # Q8_0 layers (--quantization q8_0) run their 5+-row GEMMs in integers (cpu_gemm_q8.c) rather than
    # oneDNN over the dequantized fp32 weights: where measured faster (kernels/cpu_q8_0_linear.py)
    q8_0_integer_gemm: bool = False
    # The most rows the small-rows kernel (and with it the fused decoder layer) takes where the GEMM
    # library multiplies an fp32 copy of narrower stored weights (an fp32 model with fp16, bf16 or
    # Q8_0 storage); 4 where both read the same bytes. Measured per tier: kernels/cpu_linear.py
    # PackedLinear's NOTE. At most cpu_linear_small.c's MAX_ROWS.
    small_rows_wider: int = 16
    # fp32 GEMMs (5+ rows) in vbatch's own cpu_gemm.c rather than oneDNN, fp16-stored weights packed
    # as they are: where measured faster (kernels/gemm_libraries.py NOTE)
    native_gemm: bool = False

    def runs_on(self, features: "CpuFeatures") -> bool:
        return self.required_flags <= features.flags


AVX512_BF16 = CpuTier(
    name=BF16_TIER_NAME,
    required_flags=frozenset({"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx2", "fma", "f16c"}),
    compile_flags=("-march=native",),
    half_dtype=torch.float16,
    bf16_compute=True,
    description="AVX-512 with avx512_bf16: bf16 activations and weights, vdpbf16ps dot products",
)
# NOTE: why a tier of its own. Without it these CPUs took the avx2 tier: every kernel in 8 lanes and
# the GEMMs in vbatch's AVX2 one (6 x 16 tiles of ymm), half the multiply-adds a cycle of the two
# 512-bit FMA units of a Xeon Gold 6xxx / Platinum. Here the kernels are the same C in 16 lanes (the
# code the avx512-bf16 tier runs for fp32 models: VL 16, F16C's 512-bit widening) and the GEMMs are
# oneDNN's, which runs AVX-512 fp32 there (native_gemm off: it keeps an fp32 copy of the weights, as
# the avx512-bf16 tier does for fp32 models). Zen 4 executes each 512-bit FMA as two 256-bit halves,
# so there the two GEMMs tie (docs/performance/avx512.md); Zen 4 always has avx512_bf16, so it never
# picks this tier by itself. Q8_0 layers stay on oneDNN too off AMD (q8_0_integer_gemm_beats_avx512).
AVX512 = CpuTier(
    name="avx512",
    required_flags=frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}),
    compile_flags=("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c",
                   "-mtune=native"),
    half_dtype=torch.float16,
    bf16_compute=False,
    description="AVX-512 without avx512_bf16: fp32 arithmetic in 16 lanes, fp16-stored weights widened in registers",
)
AVX2 = CpuTier(
    name="avx2",
    required_flags=frozenset({"avx", "avx2", "fma", "f16c"}),
    compile_flags=("-mavx2", "-mfma", "-mf16c", "-mtune=native"),
    half_dtype=torch.float16,
    bf16_compute=False,
    description="AVX2 + FMA + F16C: fp32 arithmetic, fp16-stored weights widened in registers",
    q8_0_integer_gemm=True,
    native_gemm=True,
)
PORTABLE = CpuTier(
    name="portable",
    required_flags=frozenset(),
    compile_flags=(),
    half_dtype=torch.bfloat16,
    bf16_compute=False,
    description="plain C vectorised by the compiler for its baseline target: fp32 arithmetic, "
                "bf16-stored weights",
)
TIERS = (AVX512_BF16, AVX512, AVX2, PORTABLE)  # fastest first


@dataclass(frozen=True)
class CpuFeatures:
    machine: str               # platform.machine(): x86_64, aarch64, ...
    model_name: str            # the CPU's marketing name, for reports
    flags: frozenset[str]      # /proc/cpuinfo `flags` (x86) or `Features` (ARM)
    vendor: str = ""           # /proc/cpuinfo `vendor_id` (x86): AuthenticAMD, GenuineIntel; "" elsewhere
    family_model: tuple[int, int] | None = None   # x86 `cpu family` and `model`; None elsewhere

    @property
    def amd_zen(self) -> int | None:
        """The AMD Zen generation from the x86 family and model (AMD's family / model tables): family
        23 is Zen and Zen+ (models below 0x30) or Zen 2; 25 is Zen 3 or, at models 0x10-0x1f, 0x60-0x7f
        and 0xa0-0xaf, Zen 4; 26 is Zen 5. None for other CPUs and unknown numbers."""
        if not self.is_amd or self.family_model is None:
            return None
        family, model = self.family_model
        if family == 23:
            return 2 if model >= 0x30 else 1
        if family == 25:
            return 4 if 0x10 <= model <= 0x1F or 0x60 <= model <= 0x7F or 0xA0 <= model <= 0xAF else 3
        return 5 if family == 26 else None

    def has(self, *flags: str) -> bool:
        return all(flag in self.flags for flag in flags)

    @property
    def is_amd(self) -> bool:
        """An AMD x86 CPU: the one vendor whose tuned libraries (ZenDNN, kernels/cpu_linear.py) help."""
        return self.vendor == "AuthenticAMD"

    @property
    def prefetches_weight_streams(self) -> bool:
        """Whether the small-rows kernels prefetch each weight stream ahead of its loads (each at its
        own measured distance: kernels/csrc/cpu_linear_small.c): measured to help on Intel; on AMD
        no gain on Zen 3, and on Zen 4 a loss at 2-4 rows."""
        return self.vendor == "GenuineIntel"

    @property
    def span_prefetch_positions(self) -> int | None:
        """How many positions ahead the decode attention's spans (AVX2, portable) prefetch the cache
        rows where this CPU measured another distance than the source's 32 (kernels/csrc/
        vb_attention_spans.h SPAN_PREFETCH's NOTE): Zen 3 16 (1.02-1.11x the speed of 32 in six
        races, session 40), where Zen 4 took 1.19x the time at 16 and the Intel Xeon 1.09x. None: 32."""
        return 16 if self.amd_zen == 3 else None

    @property
    def q8_0_integer_gemm_beats_avx512(self) -> bool:
        """Whether Q8_0 layers multiply 5+ rows faster in vbatch's integer GEMM (256-bit vpmaddwd,
        cpu_gemm_q8.c) than in oneDNN's AVX-512 fp32 GEMM over the dequantized weights, on a CPU of
        an AVX-512 tier, avx512-bf16 or avx512 (kernels/cpu_q8_0_linear.py gemm_choice). AMD: Zen 4
        runs each 512-bit FMA as two 256-bit halves, so oneDNN's AVX-512 fp32 gets no more
        multiply-adds a cycle than AVX2, and the integer GEMM's 16 products per instruction win
        (1.26-1.47x there, 1.24x end to end). Zen 5's FMAs are full width, yet there the integer GEMM
        with AVX-VNNI still ran 1.00 / 1.00 / 1.00 / 0.97x the fastest at 16 / 64 / 256 / 2,048 rows
        and oneDNN's fp32 0.79 / 0.88 / 0.98 / 1.00x (`bench/gemm_backends.py --q8-0`, session 38).
        Intel's AVX-512 FMAs are full width: the integer GEMM ran 0.74-1.16x there (session 15)."""
        return self.is_amd

    @property
    def tiers(self) -> tuple[CpuTier, ...]:
        """The tiers this CPU runs, fastest first (portable always)."""
        return tuple(tier for tier in TIERS if tier.runs_on(self))

    @property
    def deciding_flags(self) -> str:
        """The flags that decide the tier, as present/absent, e.g. 'avx2 fma f16c, no avx512_bf16'."""
        wanted = ("avx512f", "avx512_bf16", "amx_bf16", "avx2", "fma", "f16c")
        have = [f for f in wanted if f in self.flags]
        missing = [f for f in ("avx512_bf16", "avx2") if f not in self.flags]
        return " ".join(have) + (", no " + ", no ".join(missing) if missing else "")


@functools.cache
def detect() -> CpuFeatures:
    model, vendor, flags, family_model = read_cpu()
    return CpuFeatures(machine=platform.machine(), model_name=model, flags=flags, vendor=vendor,
                       family_model=family_model)


def tier_named(name: str, features: CpuFeatures | None = None) -> CpuTier:
    """The tier called `name`, if this CPU runs it (a clear error otherwise)."""
    features = features or detect()
    by_name = {tier.name: tier for tier in TIERS}
    if name not in by_name:
        raise ConfigError(TIER_ENV, f"unknown CPU tier {name!r}; tiers: {', '.join(by_name)}")
    tier = by_name[name]
    if not tier.runs_on(features):
        missing = " ".join(sorted(tier.required_flags - features.flags))
        raise ConfigError(TIER_ENV, f"CPU tier {name!r} needs {missing}, which this CPU lacks; it runs: "
                                    f"{', '.join(t.name for t in features.tiers)}")
    return tier


def machine_kind(tier: CpuTier | None = None, cpu: CpuFeatures | None = None) -> str:
    """The kind of machine a benchmark is filed under (docs/benchmarks.md): the tier's name, with
    "-amx" where bf16 GEMMs run on AMX tiles (oneDNN's, kernels/cpu_linear.py: 2-4x the avx512_bf16
    rate on an Intel Xeon), a different machine for every large-batch figure. A tier below the
    CPU's best (VBATCH_CPU_TIER) is filed as "<tier>-on-<the CPU's own kind>": its figures come from
    a faster machine and must not replace those of a CPU whose best tier it is. An AVX-512 tier on AMD
    Zen 5 is filed as "<tier>-zen5": Zen 5 runs 512-bit vectors at full width where Zen 4 splits
    each into two 256-bit halves, twice the multiply-adds a cycle (fp32 registers-only peak 529-538
    against 262 GFLOP/s for 8-lane vectors on the same 2 cores; bf16 GEMMs ~980 GFLOP/s against
    Zen 4's 444: session 38), so its large-batch figures are another machine's too."""
    tier, cpu = tier or selected_tier(), cpu or detect()
    own = tier.name + ("-amx" if tier.bf16_compute and cpu.has("amx_bf16") else "")
    if "avx512f" in tier.required_flags and cpu.amd_zen == 5:
        own += "-zen5"
    best = cpu.tiers[0]
    return own if tier == best or not tier.runs_on(cpu) else f"{own}-on-{machine_kind(best, cpu)}"


def selected_tier() -> CpuTier:
    """The tier the engine builds and uses: VBATCH_CPU_TIER if set (it may only name a tier this
    CPU runs), else the fastest this CPU runs."""
    name = os.environ.get(TIER_ENV, "").strip()
    return tier_named(name) if name else detect().tiers[0]
