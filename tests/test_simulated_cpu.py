"""tools/simulated_cpu.py: /proc/cpuinfo rewritten as another CPU kind's, and a command run under it.

Oracles: hand-written /proc/cpuinfo excerpts (a Zen 4 of two processors, a Zen 3), the tiers each
kind's real CPU selects (Zen 3: avx2; Zen 4, Cooper Lake: avx512-bf16; Cascade Lake: avx512, as
test_cpu_features.py's flag sets), and, end to end, what a child process under the tool sees:
vbatch's parser on the bind-mounted file and torch's own CPU capability.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from vbatch.kernels import cpuinfo
from vbatch.kernels.cpu_features import CpuFeatures

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tools"))

import simulated_cpu  # noqa: E402

ZEN4_FLAGS = ("fpu sse sse2 ssse3 fma cx16 sse4_1 sse4_2 aes avx f16c avx2 bmi1 bmi2 avx512f avx512dq avx512cd "
              "avx512bw avx512vl avx512ifma avx512vbmi avx512_vbmi2 avx512_vnni avx512_bf16 avx512_bitalg "
              "avx512_vpopcntdq gfni vaes")
ZEN4 = "".join(f"processor\t: {i}\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC 9R14\n"
               f"flags\t\t: {ZEN4_FLAGS}\nbogomips\t: 5200.00\n\n" for i in range(2))
ZEN3 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\nmodel name\t: AMD EPYC 7B13\n"
        "flags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2 vaes\n\n")
# each kind's tier on its real CPU, and torch's capability under its hold
WANT = {"zen3": ("avx2", "AVX2"), "zen4": ("avx512-bf16", "AVX512"), "cascade-lake": ("avx512", "AVX512"),
        "cooper-lake": ("avx512-bf16", "AVX512")}


def _parsed(text: str, tmp_path, monkeypatch) -> tuple[str, str, frozenset[str]]:
    path = tmp_path / "cpuinfo"
    path.write_text(text)
    monkeypatch.setattr(cpuinfo, "Path", lambda _p: path)
    return cpuinfo.read_cpuinfo()


@pytest.mark.parametrize("kind", sorted(simulated_cpu.KINDS))
def test_cpuinfo_is_rewritten_as_the_kind(kind, tmp_path, monkeypatch):
    spec = simulated_cpu.KINDS[kind]
    text = simulated_cpu.rewrite_cpuinfo(ZEN4, spec)
    model, vendor, flags = _parsed(text, tmp_path, monkeypatch)
    assert (model, vendor) == (spec.model, spec.vendor)
    assert cpuinfo.read_cpu()[3] == spec.family_model   # AMD's decide the Zen generation
    assert CpuFeatures("x86_64", model, flags, vendor).tiers[0].name == WANT[kind][0]
    assert {"avx512_bf16", "avx512ifma", "avx512vbmi", "avx512_bitalg"}.isdisjoint(flags - spec.simd)
    assert {"aes", "bmi2", "gfni", "sse4_2"} <= flags          # the non-SIMD-tier flags stay this CPU's
    # every processor block rewritten, every other line kept
    assert text.count(spec.model) == 2 and "AMD EPYC 9R14" not in text
    rewritten = ("flags", "vendor_id", "model", "cpu family")   # "model" covers "model name"
    assert [ln for ln in text.splitlines() if not ln.startswith(rewritten)] == \
        [ln for ln in ZEN4.splitlines() if not ln.startswith(rewritten)]


def test_a_kind_this_cpu_cannot_run_is_refused():
    missing = "avx512_vnni avx512bw avx512cd avx512dq avx512f avx512vl"
    with pytest.raises(simulated_cpu.CannotSimulate, match=f"lacks {missing}"):
        simulated_cpu.rewrite_cpuinfo(ZEN3, simulated_cpu.KINDS["cascade-lake"])
    assert simulated_cpu.KINDS["zen3"].flags(frozenset(ZEN3.split("flags\t\t: ")[1].split())) >= {"avx2", "fma", "f16c"}


@pytest.mark.parametrize("kind", sorted(simulated_cpu.KINDS))
def test_a_command_under_the_tool_sees_the_kind(kind, monkeypatch):
    # a child process: vbatch's tier from the bind-mounted /proc/cpuinfo, torch held by the variables;
    # a forced tier in the caller's environment must not leak in
    monkeypatch.setenv("VBATCH_CPU_TIER", "portable")
    probe = ("from vbatch.kernels import cpu_features; import torch; "
             "print(cpu_features.selected_tier().name, torch.backends.cpu.get_cpu_capability(), "
             "*cpu_features.detect().family_model)")
    done = subprocess.run([sys.executable, str(REPO / "tools" / "simulated_cpu.py"), kind, "--",
                           sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    if done.returncode == 2 and "cannot simulate" in done.stderr:
        # not Linux, no unshare or mount namespace, or a CPU without the kind's flags
        pytest.skip(done.stderr.strip())
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [*WANT[kind], *map(str, simulated_cpu.KINDS[kind].family_model)]
