"""CPU feature detection and the native-kernel tier it selects (kernels/cpu_features.py).

Oracles: hand-written /proc/cpuinfo excerpts of the kinds of machine these tests run on (AMD Zen 4
with avx512_bf16, Zen 3 with AVX2 only, an Intel Xeon with AMX), an Intel Xeon with AVX-512 but no
avx512_bf16 (Cascade Lake), an aarch64 one and a CPU without AVX2; the engine's
dtype choice (engine/device.py) follows the tier.
"""
from __future__ import annotations

import pytest
import torch

from vbatch.engine.device import cpu_has_fast_bf16, resolve_dtype, resolve_kv_cache_dtype, resolve_weight_dtype
from vbatch.engine.errors import ConfigError
from vbatch.kernels import cpu_features, cpuinfo
from vbatch.kernels.cpu_features import AVX2, AVX512, AVX512_BF16, PORTABLE, CpuFeatures

ZEN4 = ("fpu sse sse2 ssse3 fma cx16 sse4_1 sse4_2 avx f16c avx2 bmi2 avx512f avx512dq avx512cd avx512bw "
        "avx512vl avx512_bf16 avx512vnni")
ZEN3 = "fpu sse sse2 ssse3 fma cx16 sse4_1 sse4_2 avx f16c avx2 bmi1 bmi2"
INTEL_AMX = ("fpu sse sse2 ssse3 fma cx16 sse4_1 sse4_2 avx f16c avx2 bmi2 avx512f avx512dq avx512cd avx512bw "
             "avx512vl avx_vnni avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8")   # Xeon (Sapphire Rapids on)
CASCADE_LAKE = ("fpu sse sse2 ssse3 fma cx16 sse4_1 sse4_2 avx f16c avx2 bmi2 avx512f avx512dq avx512cd "
                "avx512bw avx512vl avx512_vnni")                          # Xeon Gold 6248 (AWS c5, GCP n2)
KNIGHTS_LANDING = "fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 avx512f avx512cd avx512er avx512pf"
OLD_X86 = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx"           # AVX without AVX2/FMA
ARM = "fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics fphp asimdhp cpuid asimdrdm"


def _features(flags: str, machine: str = "x86_64") -> CpuFeatures:
    return CpuFeatures(machine=machine, model_name="test", flags=frozenset(flags.split()))


@pytest.mark.parametrize("flags,want", [(ZEN4, ["avx512-bf16", "avx512", "avx2", "portable"]),
                                        (ZEN3, ["avx2", "portable"]),
                                        (INTEL_AMX, ["avx512-bf16", "avx512", "avx2", "portable"]),
                                        (CASCADE_LAKE, ["avx512", "avx2", "portable"]),
                                        (KNIGHTS_LANDING, ["avx2", "portable"]), (OLD_X86, ["portable"])],
                         ids=["zen4", "zen3", "intel-amx", "cascade-lake", "knights-landing", "avx-only"])
def test_tiers_follow_the_flags(flags, want):
    assert [t.name for t in _features(flags).tiers] == want


def test_machine_kind_names_amx_where_bf16_gemms_use_it():
    assert cpu_features.machine_kind(AVX512_BF16, _features(INTEL_AMX)) == "avx512-bf16-amx"
    assert cpu_features.machine_kind(AVX512_BF16, _features(ZEN4)) == "avx512-bf16"
    assert cpu_features.machine_kind(AVX2, _features(ZEN3)) == "avx2"
    # A forced lower tier is filed apart from the CPUs whose best tier it is (no bf16 GEMMs in it).
    assert cpu_features.machine_kind(AVX2, _features(INTEL_AMX)) == "avx2-on-avx512-bf16-amx"
    assert cpu_features.machine_kind(AVX2, _features(ZEN4)) == "avx2-on-avx512-bf16"
    assert cpu_features.machine_kind(PORTABLE, _features(ZEN3)) == "portable-on-avx2"
    assert cpu_features.machine_kind(AVX512, _features(CASCADE_LAKE)) == "avx512"
    assert cpu_features.machine_kind(AVX2, _features(CASCADE_LAKE)) == "avx2-on-avx512"
    assert cpu_features.machine_kind(AVX512, _features(ZEN4)) == "avx512-on-avx512-bf16"


@pytest.mark.parametrize("vendor,family_model,zen", [
    ("AuthenticAMD", (23, 0x01), 1), ("AuthenticAMD", (23, 0x31), 2),     # EPYC Naples, Rome
    ("AuthenticAMD", (25, 0x01), 3), ("AuthenticAMD", (25, 0x21), 3),     # EPYC Milan, Ryzen 5000
    ("AuthenticAMD", (25, 0x11), 4), ("AuthenticAMD", (25, 0x61), 4),     # EPYC Genoa, Ryzen 7000
    ("AuthenticAMD", (25, 0xA0), 4), ("AuthenticAMD", (26, 0x02), 5),     # EPYC Bergamo, Turin
    ("AuthenticAMD", (27, 0x00), None), ("AuthenticAMD", None, None),     # unknown numbers, none (ARM)
    ("GenuineIntel", (6, 143), None)])                                    # Sapphire Rapids
def test_the_amd_zen_generation_follows_family_and_model(vendor, family_model, zen):
    cpu = CpuFeatures("x86_64", "test", frozenset(ZEN4.split()), vendor, family_model)
    assert cpu.amd_zen == zen


def test_machine_kind_files_zen5_apart_on_its_avx512_tiers():
    # Zen 5 runs 512-bit vectors at full width, Zen 4 in two halves: another machine for large batches;
    # the 8-lane tier forced there is filed under the host kind, like every forced tier
    zen5, zen4 = (CpuFeatures("x86_64", "AMD EPYC", frozenset(ZEN4.split()), "AuthenticAMD", (family, model))
                  for family, model in ((26, 2), (25, 0x11)))
    assert cpu_features.machine_kind(AVX512_BF16, zen5) == "avx512-bf16-zen5"
    assert cpu_features.machine_kind(AVX2, zen5) == "avx2-on-avx512-bf16-zen5"
    assert cpu_features.machine_kind(AVX512_BF16, zen4) == "avx512-bf16"
    assert cpu_features.machine_kind(AVX2, zen4) == "avx2-on-avx512-bf16"


def test_the_avx512_tier_computes_fp32_in_16_lanes_through_onednn():
    # no bf16 arithmetic: fp32 over fp16-stored weights; the GEMMs stay with the library (its AVX-512
    # fp32 kernels), and the build targets AVX-512 without naming avx512_bf16
    assert not AVX512.bf16_compute and AVX512.half_dtype == torch.float16 and not AVX512.native_gemm
    assert "-mavx512f" in AVX512.compile_flags
    assert not any("bf16" in flag or flag.startswith("-march") for flag in AVX512.compile_flags)
    assert not AVX512.q8_0_integer_gemm and not _features(CASCADE_LAKE).q8_0_integer_gemm_beats_avx512


def test_arm_runs_the_portable_tier():
    arm = _features(ARM, machine="aarch64")
    assert arm.tiers == (PORTABLE,) and PORTABLE.compile_flags == ()   # no x86 target flags


def test_cpuinfo_is_parsed_for_x86_and_arm(tmp_path, monkeypatch):
    x86 = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\nmodel name\t: AMD EPYC 7B13\n" \
          "flags\t\t: " + ZEN3 + "\n\nprocessor\t: 1\ncpu family\t: 26\nmodel name\t: AMD EPYC 7B13\nflags\t\t: " + ZEN3 + "\n"
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: " + ARM + "\nCPU implementer\t: 0x41\n"
    intel = "processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R) Processor\nflags\t\t: " \
            + INTEL_AMX + "\n"
    for text, model, vendor, tier, family_model in (
            (x86, "AMD EPYC 7B13", "AuthenticAMD", AVX2, (25, 1)),   # the first processor's numbers
            (arm, "unknown", "", PORTABLE, None),
            (intel, "Intel(R) Xeon(R) Processor", "GenuineIntel", AVX512_BF16, None)):   # no numbers listed
        path = tmp_path / "cpuinfo"
        path.write_text(text)
        monkeypatch.setattr(cpuinfo, "Path", lambda _p, path=path: path)
        got_model, got_vendor, flags, got_family_model = cpuinfo.read_cpu()
        assert cpuinfo.read_cpuinfo() == (got_model, got_vendor, flags)
        cpu = CpuFeatures("m", got_model, flags, got_vendor, got_family_model)
        assert (got_model, got_vendor) == (model, vendor) and cpu.tiers[0] is tier
        assert cpu.is_amd == (vendor == "AuthenticAMD") and cpu.family_model == family_model
        assert cpu.amd_zen == (3 if family_model else None)


def test_cpuinfo_stops_after_the_first_processor(monkeypatch):
    # x86 names the model and the flags in the first block: nothing after it is read (the kernel
    # writes /proc/cpuinfo per processor, costly on machines of hundreds of cores)
    first = ["processor\t: 0\n", "vendor_id\t: AuthenticAMD\n", "model name\t: AMD EPYC 7B13\n",
             "flags\t\t: " + ZEN3 + "\n", "\n"]

    class Lines:
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def __iter__(self):
            yield from first
            raise AssertionError("read past the first processor")

    monkeypatch.setattr(cpuinfo, "Path", lambda _p: type("P", (), {"open": lambda self: Lines()})())
    assert cpuinfo.read_cpuinfo()[:2] == ("AMD EPYC 7B13", "AuthenticAMD")


def test_this_machine_runs_what_its_flags_say():
    cpu = cpu_features.detect()
    assert cpu.tiers[-1] is PORTABLE
    assert (AVX512_BF16 in cpu.tiers) == cpu.has("avx512_bf16", "avx512bw", "avx512vl")
    assert (AVX512 in cpu.tiers) == cpu.has("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c")
    assert (AVX2 in cpu.tiers) == cpu.has("avx2", "fma", "f16c")
    assert "avx512_bf16" in cpu.deciding_flags    # named as present or as missing


def test_environment_forces_a_lower_tier_and_refuses_others(monkeypatch):
    monkeypatch.setenv(cpu_features.TIER_ENV, "portable")
    assert cpu_features.selected_tier() is PORTABLE
    monkeypatch.setenv(cpu_features.TIER_ENV, "sse9")
    with pytest.raises(ConfigError, match="unknown CPU tier 'sse9'; tiers: avx512-bf16, avx512, avx2, portable"):
        cpu_features.selected_tier()
    with pytest.raises(ConfigError, match="needs avx2 f16c fma"):
        cpu_features.tier_named("avx2", _features(OLD_X86))
    monkeypatch.delenv(cpu_features.TIER_ENV)
    assert cpu_features.selected_tier() is cpu_features.detect().tiers[0]


def test_dtype_auto_follows_the_tier(monkeypatch):
    # bf16 only where the tier computes it (avx512_bf16); a forced lower tier computes in fp32.
    monkeypatch.setenv(cpu_features.TIER_ENV, "portable")
    assert not cpu_has_fast_bf16() and resolve_dtype("auto", torch.device("cpu")) == torch.float32
    monkeypatch.delenv(cpu_features.TIER_ENV)
    want = torch.bfloat16 if cpu_features.selected_tier().bf16_compute and cpu_has_fast_bf16() else torch.float32
    assert resolve_dtype("auto", torch.device("cpu")) == want


def test_storage_dtype_pairs():
    cpu = torch.device("cpu")
    for resolve, field in ((resolve_weight_dtype, "weight_dtype"), (resolve_kv_cache_dtype, "kv_cache_dtype")):
        assert resolve("auto", torch.float32, cpu) is None                   # the ops decide
        assert resolve("float16", torch.float32, cpu) == torch.float16       # fp32 model, fp16 storage
        assert resolve("bfloat16", torch.bfloat16, cpu) == torch.bfloat16
        with pytest.raises(ConfigError, match=f"{field}: float16 storage under a bfloat16 model"):
            resolve("float16", torch.bfloat16, cpu)
        with pytest.raises(ConfigError, match=field):
            resolve("float16", torch.float32, torch.device("cuda"))
    # the fp8 KV caches (vLLM's names; fp8 is E4M3): under fp32 or bf16 models, on the CPU only
    for name, want in (("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        assert resolve_kv_cache_dtype(name, torch.float32, cpu) == want
        assert resolve_kv_cache_dtype(name, torch.bfloat16, cpu) == want
        with pytest.raises(ConfigError, match=f"kv_cache_dtype: {name} is stored and read by the CPU kernels only"):
            resolve_kv_cache_dtype(name, torch.bfloat16, torch.device("cuda"))
    with pytest.raises(ConfigError, match="weight_dtype"):
        resolve_weight_dtype("fp8", torch.float32, cpu)


def test_the_summary_counts_each_test_for_the_tier_its_id_names():
    from conftest import tier_of_test
    names = ["avx512-bf16", "avx512", "avx2", "portable"]
    assert tier_of_test("tests/test_x.py::test_a[avx512-bf16-float32]", names) == "avx512-bf16"
    assert tier_of_test("tests/test_x.py::test_a[avx512-float32]", names) == "avx512"
    assert tier_of_test("tests/test_x.py::test_a[float32-avx512]", names) == "avx512"
    assert tier_of_test("tests/test_x.py::test_a[avx2]", names) == "avx2"
    assert tier_of_test("tests/test_x.py::test_a[float32]", names) is None
    assert tier_of_test("tests/test_x.py::test_a", names) is None
