"""The OpenMP runtime's wait policy, set before torch loads it (torch-free: imported by vbatch/__init__.py).

    apply_defaults() -> str | None   what vbatch set (None: nothing: the user's setting, a bf16 CPU, too late)
    describe() -> str                the wait setting in effect, for reports (`vbatch bench`)
    without_defaults(env) -> dict    env less what vbatch set (for peers' processes: their own defaults)
    DEFAULT_SPIN_COUNT               libgomp's spins before a waiting thread sleeps, vbatch's default

The native kernels and torch share one OpenMP runtime, torch's libgomp (kernels/cpu_native.py).
libgomp reads its environment once, when torch's import loads it; so this must run before the first
`import torch` of the process, and does: every entry point imports the `vbatch` package first.

NOTE: why 30,000 spins instead of libgomp's 300,000 (docs/performance/batch-1.md, session 18). With the
default, a worker keeps spinning through the engine's Python between steps. On the 2-vCPU VMs
these issues are worked on, batch-1 decode on the fp32-arithmetic avx2 tier then had, at times,
steps that ran uniformly twice as slow (11-25% of them); with 10,000-30,000 spins none, and batch
1 6-17% faster. 10,000 cost large batches 1-3% each time it was measured, 30,000 0.5% (noise).
The avx512-bf16 tier lost 1-2% each time (at 10,000), so only the fp32-arithmetic tiers get it,
i.e. a CPU without avx512_bf16 or a lower tier forced with VBATCH_CPU_TIER (the portable tier by
extension: the same arithmetic, not measured apart).
Sleeping much sooner (0-1,000 spins, or OMP_WAIT_POLICY=passive) is far worse: the barriers
inside a step then sleep too. Intel's runtime is tuned the same way by its users (KMP_BLOCKTIME=1).
A user's own GOMP_SPINCOUNT or OMP_WAIT_POLICY is left alone, and so is every other OpenMP
runtime (they ignore the variable).
Spinning assumes each team thread has its core: when another process takes one, every barrier waits
for the scheduler to give that thread its turn (batch 1 3.6-8.6x slower). No wait policy fixes
that without costing quiet runs; the engine shrinks the team instead (engine/cpu_threads.py).
"""
from __future__ import annotations

import os
import sys

from .cpuinfo import BF16_TIER_NAME, TIER_ENV, read_cpuinfo

DEFAULT_SPIN_COUNT = "30000"
_USER_KNOBS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
_applied: str | None = None   # what apply_defaults set in this process


def _fp32_tier() -> bool:
    """Whether the native kernels will compute in fp32: a lower tier forced, or no avx512_bf16."""
    forced = os.environ.get(TIER_ENV, "").strip()
    return forced != BF16_TIER_NAME if forced else "avx512_bf16" not in read_cpuinfo()[2]


def apply_defaults() -> str | None:
    """Set GOMP_SPINCOUNT to DEFAULT_SPIN_COUNT for the fp32-arithmetic tiers, unless the user chose
    a wait policy or torch (and so libgomp) is already loaded, where it could no longer take effect."""
    global _applied
    if "torch" in sys.modules or any(k in os.environ for k in _USER_KNOBS) or not _fp32_tier():
        return None
    os.environ["GOMP_SPINCOUNT"] = _applied = DEFAULT_SPIN_COUNT
    return _applied


def _ours(env) -> bool:
    return _applied is not None and env.get("GOMP_SPINCOUNT") == _applied


def describe() -> str:
    """E.g. "GOMP_SPINCOUNT=30000 (vbatch's default)", "OMP_WAIT_POLICY=active", or the runtime's default."""
    knobs = [f"{k}={os.environ[k]}" for k in _USER_KNOBS if k in os.environ]
    if not knobs:
        return "the OpenMP runtime's default wait"
    return ", ".join(knobs) + (" (vbatch's default)" if _ours(os.environ) else "")


def without_defaults(env) -> dict:
    """A copy of `env` without the variable apply_defaults set (a user's own setting stays)."""
    out = dict(env)
    if _ours(out):
        del out["GOMP_SPINCOUNT"]
    return out
