"""This CPU as /proc/cpuinfo describes it, without torch (kernels/openmp_env.py reads it before torch loads).

    read_cpuinfo() -> (model name, vendor_id, flags)   of the first processor listed
    TIER_ENV                                           the variable that forces a native-kernel tier
    BF16_TIER_NAME                                     the tier that computes in bf16 (kernels/cpu_features.py)

The tiers themselves, and what each needs, are kernels/cpu_features.py's.
"""
from __future__ import annotations

import platform
from pathlib import Path

TIER_ENV = "VBATCH_CPU_TIER"
BF16_TIER_NAME = "avx512-bf16"


def read_cpuinfo() -> tuple[str, str, frozenset[str]]:
    """(model name, vendor_id, flags) of the first processor in /proc/cpuinfo.

    NOTE: it stops at the end of the first processor's block once it has the flags and the model
    (x86 lists both there): the kernel writes the file one processor at a time (with each one's
    clock), so on a machine of hundreds of cores reading all of it costs milliseconds, and `import
    vbatch` reads it (kernels/openmp_env.py)."""
    model, vendor, flags = "unknown", "", frozenset()
    try:
        with Path("/proc/cpuinfo").open() as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if not key and flags and model != "unknown":
                    break   # the blank line after the first processor (ARM may name its board at the end)
                if key in ("model name", "cpu model", "hardware") and model == "unknown":
                    model = value.strip()
                elif key == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key in ("flags", "features") and not flags:
                    flags = frozenset(value.split())
    except OSError:
        return platform.processor() or "unknown", "", frozenset()
    return model, vendor, flags
