"""What every Triton kernel file shares: the interpreter switches and bf16 rounding.

Imported by the `triton_*.py` op files (never by the CPU path: nothing outside the CUDA binding
in `ops.py` and the Triton tests may import triton). Kernels are defined when their module is
imported, so `TRITON_INTERPRET=1` must be in the environment before that import for them to
run on CPU tensors (how CI tests them).

NOTE (loop bounds): the Triton 3.6 interpreter with numpy >= 2.4 cannot use a runtime value as a
`range` bound (it converts a 1-element array to int, which numpy 2.4 refuses); compiled GPU
kernels are unaffected and Triton >= 3.7 fixed the interpreter. `STATIC_LOOPS` is True only in
that broken combination: kernels then loop to a `tl.constexpr` bound and mask the surplus
iterations instead. Everywhere else (every GPU, CI's Triton 3.9) they loop to the runtime bound.
NOTE (bf16 rounding): torch rounds fp32 -> bf16 to nearest even; compiled Triton casts do too, but
the interpreter truncates. `round_to_bf16` rounds explicitly with integer ops, so a kernel that
mirrors a reference's intermediate bf16 roundings agrees bit for bit in both modes.
"""
from __future__ import annotations

import os

import numpy as np
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _version(text: str) -> tuple[int, int]:
    major, minor = text.split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


STATIC_LOOPS = INTERPRET and _version(triton.__version__) < (3, 7) and _version(np.__version__) >= (2, 4)


def next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


@triton.jit
def round_to_bf16(x):
    """fp32 -> fp32 holding the nearest-even bf16 value (a later cast to bf16 is then exact)."""
    bits = x.to(tl.int32, bitcast=True)
    lsb = (bits >> 16) & 1
    bits = (bits + 0x7FFF + lsb) & -65536  # -65536 == 0xFFFF0000: clear the low half
    return bits.to(tl.float32, bitcast=True)
