"""Run a command as vbatch would run on another x86-64 CPU kind: the suite as on Zen 3 or an Intel
Xeon, from a Zen 4 (Linux; root, or unprivileged user namespaces).

    python tools/simulated_cpu.py KIND                  # ./.ci/run in a fresh clone of HEAD
    python tools/simulated_cpu.py KIND -- CMD [ARG ...]  # CMD here, in this checkout

KIND: zen3 (AVX2 + FMA + F16C), zen4 (AVX-512 with avx512_bf16 in two 256-bit halves, no AVX-VNNI:
from a Zen 5), cascade-lake (AVX-512 without avx512_bf16, Intel), cooper-lake (AVX-512 with
avx512_bf16, Intel, no AMX). What it does:
- /proc/cpuinfo, in a private mount namespace (`unshare -m` and a bind mount), becomes this
  machine's own with every processor's vendor, model name, family and model numbers and flags
  swapped for KIND's. vbatch
  reads the CPU from there alone (kernels/cpuinfo.py), so it picks KIND's tier, builds and tests
  KIND's kernels, and takes KIND's choices (vendor: zentorch, the weight-stream prefetch, the Q8_0
  GEMM). The parser tests then read that file too: nothing in vbatch is patched.
- torch, oneDNN and MKL ask the CPU itself (cpuid), so they are held to KIND's instruction set with
  their own variables (CpuKind.holds), as bench/peers.py's stand-ins are.
- The C compiler's -march=native still sees this CPU, so KIND's SIMD flags must be a subset of this
  CPU's (checked: the code built for KIND must run here). A Zen 4 can stand in for Zen 3 and the
  Intel kinds, a Zen 5 for all four.
Exits with the command's status; 2 when KIND cannot be simulated here (the reason on stderr).

NOTE: why. The suite must pass on every CPU kind CI or a user may have, and each session draws one
machine. Session 29 ran the suite as Zen 3 by patching read_cpuinfo in a scratch clone (a failing
bf16 test found, 248ca23); session 30 ran it as Cascade Lake the same way and found a test that
failed there with KeyError 'avx512' (4fb773b). This tool makes those runs one command, without the
patch, and keeps the kinds' flags in one place.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class CpuKind:
    vendor: str
    model: str
    family_model: tuple[int, int]   # x86 `cpu family` and `model` (AMD's decide the Zen generation)
    simd: frozenset[str]       # the SIMD flags KIND has (each must be this CPU's too)
    holds: dict[str, str]      # torch / oneDNN / MKL held to KIND's instruction set

    def flags(self, real: frozenset[str]) -> frozenset[str]:
        """This CPU's flags less the SIMD ones KIND lacks: KIND's AVX-512, AVX-VNNI and AMX subsets
        exactly, everything else (sse*, bmi*, aes, ...) as this CPU has it."""
        def simd_flag(flag: str) -> bool:
            return flag.startswith(("avx512", "amx")) or flag in ("avx_vnni", "avx_vnni_int8", "avx_ifma")
        return frozenset(f for f in real if not simd_flag(f) or f in self.simd)


_AVX2 = frozenset({"avx", "avx2", "fma", "f16c"})
_SKYLAKE_SP = _AVX2 | {"avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl"}
KINDS = {
    "zen3": CpuKind("AuthenticAMD", "AMD EPYC 7763 64-Core Processor", (25, 1), _AVX2,
                    {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}),
    # Zen 4 from a Zen 5: the same AVX-512 subsets less avx512_vp2intersect, and no AVX-VNNI (the
    # Q8_0 GEMM's choice follows it: kernels/cpu_q8_0_linear.py)
    "zen4": CpuKind("AuthenticAMD", "AMD EPYC 9654 96-Core Processor", (25, 17),
                    _SKYLAKE_SP | {"avx512ifma", "avx512vbmi", "avx512_vbmi2", "avx512_vnni", "avx512_bitalg",
                                   "avx512_vpopcntdq", "avx512_bf16"},
                    {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
                     "MKL_ENABLE_INSTRUCTIONS": "AVX512"}),
    "cascade-lake": CpuKind("GenuineIntel", "Intel(R) Xeon(R) Gold 6248 CPU @ 2.50GHz", (6, 85),
                            _SKYLAKE_SP | {"avx512_vnni"},
                            {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI",
                             "MKL_ENABLE_INSTRUCTIONS": "AVX512"}),
    "cooper-lake": CpuKind("GenuineIntel", "Intel(R) Xeon(R) Platinum 8380H CPU @ 2.90GHz", (6, 85),
                           _SKYLAKE_SP | {"avx512_vnni", "avx512_bf16"},
                           {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
                            "MKL_ENABLE_INSTRUCTIONS": "AVX512"}),
}


class CannotSimulate(RuntimeError):
    """KIND cannot be simulated on this machine (the message says why)."""


def _key_value(line: str) -> tuple[str, str]:
    key, _, value = line.partition(":")
    return key.strip().lower(), value.strip()


def rewrite_cpuinfo(text: str, kind: CpuKind) -> str:
    """/proc/cpuinfo's `text` with each processor's vendor_id, model name, cpu family, model and flags
    made KIND's; every other line as it was. CannotSimulate when this CPU lacks one of KIND's SIMD flags."""
    out = []
    for line in text.splitlines(keepends=True):
        key, value = _key_value(line)
        if key == "flags":
            real = frozenset(value.split())
            missing = kind.simd - real
            if missing:
                raise CannotSimulate(f"this CPU lacks {' '.join(sorted(missing))}: "
                                     "code built for the kind would not run here")
            line = line.partition(":")[0] + ": " + " ".join(sorted(kind.flags(real))) + "\n"
        elif key == "vendor_id":
            line = line.partition(":")[0] + ": " + kind.vendor + "\n"
        elif key == "model name":
            line = line.partition(":")[0] + ": " + kind.model + "\n"
        elif key in ("cpu family", "model"):
            line = line.partition(":")[0] + ": " + str(kind.family_model[key == "model"]) + "\n"
        out.append(line)
    return "".join(out)


def run(kind_name: str, command: list[str], cwd: Path) -> int:
    """`command` in `cwd` with /proc/cpuinfo made KIND's (a private mount namespace) and the holds set."""
    kind = KINDS[kind_name]
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        raise CannotSimulate("needs Linux and util-linux's unshare")
    text = rewrite_cpuinfo(Path("/proc/cpuinfo").read_text(), kind)
    # root: a mount namespace; otherwise a user namespace mapping us to root inside it
    unshare = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-m", "-r"]
    env = os.environ | kind.holds
    env.pop("VBATCH_CPU_TIER", None)   # the tier must come from the simulated flags
    with tempfile.TemporaryDirectory(prefix="vbatch-cpuinfo-") as folder:
        fake = Path(folder) / "cpuinfo"
        fake.write_text(text)
        probe = subprocess.run(unshare + ["mount", "--bind", str(fake), "/proc/cpuinfo"], capture_output=True, text=True)
        if probe.returncode != 0:
            raise CannotSimulate(f"cannot bind-mount over /proc/cpuinfo here: {probe.stderr.strip() or probe.returncode}")
        script = 'mount --bind "$0" /proc/cpuinfo && exec "$@"'
        return subprocess.run(unshare + ["sh", "-c", script, str(fake)] + command, cwd=cwd, env=env).returncode


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=sorted(KINDS))
    ap.add_argument("command", nargs="*", help="after --: the command (default: ./.ci/run in a fresh clone of HEAD)")
    args = ap.parse_args()
    try:
        if args.command:
            return run(args.kind, args.command, Path.cwd())
        with tempfile.TemporaryDirectory(prefix=f"vbatch-{args.kind}-") as clone:
            subprocess.run(["git", "clone", "-q", str(REPO), clone], check=True)
            print(f"simulated {args.kind}: ./.ci/run in a clone of HEAD at {clone}", file=sys.stderr, flush=True)
            return run(args.kind, ["./.ci/run"], Path(clone))
    except CannotSimulate as e:
        print(f"simulated_cpu: cannot simulate {args.kind} here: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
