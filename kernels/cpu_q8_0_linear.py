"""Q8_0 linear layers whose large-batch GEMMs run in integer arithmetic (kernels/csrc/cpu_gemm_q8.c).

    gemm_choice(native) -> "integer-vnni" | "integer" | "float"   how this CPU's Q8_0 layers multiply 5+ rows
    pack_panels(stored, in_features) -> int16 [panels * 17, in]    a Q8_0 weight in the kernel's layout
    PackedQ8_0Linear(linear, native=, vnni=)                       nn.Linear's contract, Q8_0 weights
    PackedQ8_0GateUp(linear, native=, vnni=)                       a merged gate/up projection, with silu_and_mul

A model loaded with `quantization="q8_0"` (kernels/q8_0.py) streams its Q8_0 bytes through the
small-rows kernel for 1-4 rows here, up to the tier's `small_rows_wider` with the "float" GEMM
(cpu_linear.PackedLinear.small_rows).
For more rows (prefill, large decode batches) it either multiplies its dequantized fp32 weights
with oneDNN ("float", kernels/cpu_linear.py PackedLinear) or, here, multiplies the int8 weights by
the rows rounded to int16 in int32 ("integer"), with AVX-VNNI's vpdpwssd where the CPU has avx_vnni
("integer-vnni"). The integer path adds one rounding, of each row to 1 / 65,534 of its largest
magnitude (cpu_gemm_q8.c); its oracle is the same integer arithmetic written in torch
(tests/test_cpu_gemm_q8.py), and F.linear on the dequantized weights within that rounding.

NOTE: where it runs (CpuTier.q8_0_integer_gemm, VBATCH_Q8_0_GEMM=integer | integer-avx2 | float
overrides). Measured on the Intel Xeon (session 15, 2 threads, SmolLM2's four layer shapes summed,
bench/gemm_backends.py --q8-0) against oneDNN's fp32 GEMM over the dequantized weights:
  - torch held to AVX2 (the avx2 tier's setting): integer 1.2-1.8x, integer-vnni 1.6-2.2x at
    16-1,024 rows (oneDNN 156-240 GFLOP/s; integer 277-306, integer-vnni 339-421).
  - not held (oneDNN on AVX-512): integer 0.74-1.16x, integer-vnni 1.0-1.4x; so the AVX-512 tiers
    (avx512-bf16, whose fast path is a bf16 model anyway, and avx512) keep "float" on Intel.
Zen 4 (session 24, AMD EPYC, avx512_bf16, no AVX-VNNI, the same bench, not held): integer 197-299
against oneDNN's AVX-512 fp32 at 135-218 GFLOP/s at 16-8,192 rows (1.26-1.47x; Zen 4 runs 512-bit
FMAs as two 256-bit halves). The 256-prompt q8_0 run (ABBA, VBATCH_Q8_0_GEMM=float | integer):
191.5 / 191.6 against 249.3 / 224.3 output tok/s, 1.24x on the medians. So on AMD the
AVX-512 tiers take the integer GEMM too (CpuFeatures.q8_0_integer_gemm_beats_avx512). Zen 5,
whose EPYC parts run 512-bit FMAs at full width, is not measured.
On Zen 3 the integer multipliers are pipes of their own beside the two FMA pipes (vpmaddwd on FP0
and FP3), so the kernel's peak there is twice the fp32 FMA peak.
"""
from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_features, q8_0
from .cpu_linear import PackedLinear

logger = logging.getLogger(__name__)

GEMM_ENV = "VBATCH_Q8_0_GEMM"
CHOICES = ("integer", "integer-avx2", "float")
PANEL = 16  # outputs per panel (cpu_gemm_q8.c NR)


def gemm_choice(native) -> str:
    """How Q8_0 layers multiply 5+ rows with the native kernels `native` (cpu_native.NativeKernels or
    None): "integer-vnni", "integer" (cpu_gemm_q8.c) or "float" (oneDNN over the dequantized weights).
    VBATCH_Q8_0_GEMM overrides the tier's choice: integer (with VNNI where the CPU has it),
    integer-avx2 (never VNNI) or float."""
    wanted = os.environ.get(GEMM_ENV, "").strip().lower()
    if wanted and wanted not in CHOICES:
        logger.warning("%s=%s is not one of %s; using the default", GEMM_ENV, wanted, ", ".join(CHOICES))
        wanted = ""
    if native is None or wanted == "float" or not native.has_gemm_q8_0:
        return "float"
    if not wanted and not (native.tier.q8_0_integer_gemm or cpu_features.detect().q8_0_integer_gemm_beats_avx512):
        return "float"
    return "integer-vnni" if wanted != "integer-avx2" and native.has_gemm_q8_0_vnni else "integer"


def pack_panels(stored: torch.Tensor, in_features: int) -> torch.Tensor:
    """Q8_0 rows (kernels/q8_0.py, [out, row_bytes(in)] int8) -> cpu_gemm_q8.c's layout, int16
    [panels * 17, in]: the outputs in panels of 16 (the last padded with zero weights and scales),
    all panels' weights as [panels][in / 2][16][2], then the scales as fp32 [panels][in / 32][16]."""
    q, d = q8_0.split(stored, in_features)                 # [N, K] int8, [N, K / 32] fp16
    n, k = q.shape
    panels = -(-n // PANEL)
    weights = torch.zeros(panels * PANEL, k, dtype=torch.int16)
    weights[:n] = q
    scales = torch.zeros(panels * PANEL, k // q8_0.BLOCK, dtype=torch.float32)
    scales[:n] = d
    weights = weights.view(panels, PANEL, k // 2, 2).permute(0, 2, 1, 3)            # [P, K / 2, 16, 2]
    scales = scales.view(panels, PANEL, k // q8_0.BLOCK).permute(0, 2, 1).contiguous()  # [P, K / 32, 16]
    return torch.cat([weights.reshape(-1), scales.view(torch.int16).reshape(-1)]).view(panels * 17, k)


class PackedQ8_0Linear(PackedLinear):
    """A Q8_0 `PackedLinear` whose 5+-row GEMMs are cpu_gemm_q8.c's (`vnni`: with AVX-VNNI); 1-4 rows
    go through the small-rows kernel exactly as PackedLinear's. Needs whole 32-blocks of inputs
    (q8_0.can_quantize) and native kernels with both the Q8_0 small-rows kernel and the GEMM."""

    def _most_small_rows(self, wider: bool) -> int:
        """4 rows, not the tier's `small_rows_wider` (PackedLinear's NOTE).

        NOTE: the integer GEMM reads 2 bytes per weight against the kernel's 17/16 and multiplies
        faster, so from 5 rows it wins. Zen 4 held to AVX2 (as PackedLinear's NOTE, GEMM ms / kernel
        ms): 4 rows 11.4 / 11.2, 5 rows 12.2 / 15.7, 8 rows 16.2 / 19.4, 16 rows 23.1 / 35.9. End to
        end (`bench/small_rows_limit.py --quantization q8_0`, session 33, the same hold, 5 rounds,
        output tok/s over limit 4's): limit 2 at 4 prompts 0.77x (the fused layers and multi-step
        decodes then stop at 2 requests), limit 8 at 4 prompts 0.99x and at 8 prompts 1.015x (3 of 5
        rounds): a tie, so 4 stays."""
        return self.SMALL_ROWS

    def __init__(self, linear: nn.Linear, *, native, vnni: bool) -> None:
        super().__init__(linear, native=native, pack=False, quantization=q8_0.NAME)
        assert self.quantization == q8_0.NAME and self.native is not None
        self.vnni = vnni
        self.register_buffer("packed_weight", pack_panels(self.small_weight, self.in_features), persistent=False)

    @property
    def gemm_name(self) -> str:
        return "vbatch integer Q8_0" + (" (AVX-VNNI)" if self.vnni else " (AVX2)")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        small = self._small(x)
        if small is not None:
            return small
        rows = x.reshape(-1, self.in_features)
        out = self.native.gemm_q8_0(rows, self.packed_weight, self.bias, self.out_features, self.vnni,
                                    torch.get_num_threads())
        return out.view(*x.shape[:-1], self.out_features)

    def linear_gelu(self, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        return F.gelu(self(x), approximate=approximate)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"gemm={self.gemm_name}, weights=q8_0")


class PackedQ8_0GateUp(PackedQ8_0Linear):
    """A gated MLP's merged [gate; up] projection over Q8_0 weights, with `silu_and_mul(x)` ==
    `silu_and_mul(self(x))` in one call: 1-4 rows the small-rows kernel then the native op (exactly
    the separate ops, as the fused decoder layer computes them), 5+ rows one integer GEMM with
    SiLU-and-mul in its epilogue (cpu_gemm_q8.c vb_gemm_q8_gated: the [rows, 2 * inter] product is
    never written out; it equals the GEMM followed by the native op bit for bit). Needs inter a
    multiple of the 16-output panel (`fits`)."""

    @staticmethod
    def fits(linear: nn.Linear) -> bool:
        return linear.out_features % (2 * PANEL) == 0

    def __init__(self, linear: nn.Linear, *, native, vnni: bool) -> None:
        assert self.fits(linear)
        super().__init__(linear, native=native, vnni=vnni)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., inter]
        small = self._small(x)
        if small is not None:
            return self.native.silu_and_mul(small, torch.get_num_threads())
        rows = x.reshape(-1, self.in_features)
        out = self.native.gemm_q8_0(rows, self.packed_weight, self.bias, self.out_features, self.vnni,
                                    torch.get_num_threads(), gated=True)
        return out.view(*x.shape[:-1], self.out_features // 2)
