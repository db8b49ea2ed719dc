"""This CPU as /proc/cpuinfo describes it, without torch (kernels/openmp_env.py reads it before torch loads).

    read_cpuinfo() -> (model name, vendor_id, flags)   of the first processor listed
    read_cpu() -> (model name, vendor_id, flags, (cpu family, model) | None)   the same, with its x86
                                                       family and model numbers (None elsewhere), one read
    TIER_ENV                                           the variable that forces a native-kernel tier
    BF16_TIER_NAME                                     the tier that computes in bf16 (kernels/cpu_features.py)

The tiers themselves, and what each needs, are kernels/cpu_features.py's.
"""
from __future__ import annotations

import platform
from pathlib import Path

TIER_ENV = "VBATCH_CPU_TIER"
BF16_TIER_NAME = "avx512-bf16"


def _first_processor() -> dict[str, str] | None:
    """The first processor's block of /proc/cpuinfo, {lower-case key: value} (a key's first value);
    None where the file cannot be read.

    NOTE: it stops at the end of the first processor's block once it has the flags and the model
    (x86 lists both there): the kernel writes the file one processor at a time (with each one's
    clock), so on a machine of hundreds of cores reading all of it costs milliseconds, and `import
    vbatch` reads it (kernels/openmp_env.py). ARM may name its board (Hardware) after the last
    processor, so without a model there it reads on."""
    block: dict[str, str] = {}
    try:
        with Path("/proc/cpuinfo").open() as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if not key:
                    if _flags(block) and _model(block) != "unknown":
                        break   # the blank line after the first processor
                    continue
                block.setdefault(key, value.strip())
    except OSError:
        return None
    return block


def _model(block: dict[str, str]) -> str:
    return next((block[k] for k in ("model name", "cpu model", "hardware") if k in block), "unknown")


def _flags(block: dict[str, str]) -> frozenset[str]:
    return frozenset((block.get("flags") or block.get("features") or "").split())


def read_cpuinfo() -> tuple[str, str, frozenset[str]]:
    """(model name, vendor_id, flags) of the first processor in /proc/cpuinfo."""
    return read_cpu()[:3]


def read_cpu() -> tuple[str, str, frozenset[str], tuple[int, int] | None]:
    """read_cpuinfo's three, and (cpu family, model) as x86 numbers them (AMD Zen 4: 25 and 0x10-0x1f,
    0x60-0x7f or 0xa0-0xaf; Zen 5: 26), None where the first processor has no such numbers (ARM)."""
    block = _first_processor()
    if block is None:
        return platform.processor() or "unknown", "", frozenset(), None
    try:
        family_model = int(block["cpu family"]), int(block["model"])
    except (KeyError, ValueError):
        family_model = None
    return _model(block), block.get("vendor_id", ""), _flags(block), family_model
