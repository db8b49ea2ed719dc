"""Transparent huge pages for this process: whether it gets them, and torch's allocator told to
ask for them, before torch loads (torch-free: imported by vbatch/__init__.py).

    available() -> bool            Linux with THP "always" or "madvise", and VBATCH_HUGE_PAGES not "0"
    apply_default() -> str | None  what vbatch set (None: nothing: unavailable, the user's setting, too late)
    describe() -> str | None       the setting in effect, for reports (`vbatch bench`); None: off
    without_default(env) -> dict   env less what vbatch set (for peers' processes: their own defaults)

torch's CPU allocator advises each allocation of 2 MiB or more for huge pages when
THP_MEM_ALLOC_ENABLE=1 is set at its first allocation, which is inside `import torch`:
so this must run before the first `import torch` of the process, and does (every entry point
imports the `vbatch` package first). The weights and the KV cache are placed on huge pages by
vbatch itself (kernels/cpu_huge_pages.py), whenever torch was imported; this covers the rest: the
activations and oneDNN's packed GEMM weights.

NOTE: why. Measured on the Intel Xeon with torch held to AVX2 (session 21, docs/performance/batch-1.md
"Huge pages"), 64 prompts of 128-512 tokens x 128, 2 ABBA rounds, the weights and KV cache already
on huge pages: 187.15 -> 191.3 output tok/s (median of 4 each; every pair gained), prefill and
decode alike. THP's "madvise" mode (the default of most distributions) gives huge pages only to
memory that asks; "always" gives them anyway, and "never" to nobody (then this sets nothing).
"""
from __future__ import annotations

import mmap
import os
import sys

SWITCH = "VBATCH_HUGE_PAGES"           # "0": no huge pages anywhere (this default, the arena, the KV cache)
TORCH_KNOB = "THP_MEM_ALLOC_ENABLE"
_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"
_applied: str | None = None            # what apply_default set in this process


def available() -> bool:
    """Whether memory advised here gets huge pages: Linux with THP on ("always" or "madvise", the
    bracketed word of the setting), and not switched off with VBATCH_HUGE_PAGES=0."""
    return os.environ.get(SWITCH, "1") != "0" and _kernel_gives_them()


def _kernel_gives_them() -> bool:  # Linux, THP not "never"
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(_SETTING) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def apply_default() -> str | None:
    """Set THP_MEM_ALLOC_ENABLE=1 where huge pages are available, unless the user set it or torch
    is already loaded (its allocator has read the variable by then)."""
    global _applied
    if "torch" in sys.modules or TORCH_KNOB in os.environ or not available():
        return None
    os.environ[TORCH_KNOB] = _applied = "1"
    return _applied


def describe() -> str | None:
    """E.g. "THP_MEM_ALLOC_ENABLE=1 (vbatch's default)"; None when torch's allocations use plain pages."""
    value = os.environ.get(TORCH_KNOB)
    if value in (None, "", "0") or not _kernel_gives_them():
        return None
    return f"{TORCH_KNOB}={value}" + (" (vbatch's default)" if value == _applied else "")


def without_default(env) -> dict:
    """A copy of `env` without the variable apply_default set (a user's own setting stays)."""
    out = dict(env)
    if _applied is not None and out.get(TORCH_KNOB) == _applied:
        del out[TORCH_KNOB]
    return out
