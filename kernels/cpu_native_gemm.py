"""The native GEMMs' bindings (kernels/csrc/cpu_gemm.c, cpu_gemm_q8.c), part of cpu_native.NativeKernels.

    NativeGemms.gemm / gemm_gated / gemm_q8_0(..., gated=)   raw bindings; None where the build has none
    NativeGemms.has_gemm / has_gemm_q8_0 / has_gemm_q8_0_vnni probes, run once per library

The packing they read: kernels/gemm_libraries.py (fp32, fp16) and kernels/cpu_q8_0_linear.py (Q8_0).
"""
from __future__ import annotations

import torch

from . import q8_0
from .native_build import NativeKernelError

_Q8_GEMM_ERRORS = {2: "input width not a multiple of 32", 3: "out of memory for the rounded rows or its buffers",
                   4: "AVX-VNNI asked for on a CPU without avx_vnni, or a build whose assembler lacked it"}


class NativeGemms:
    """The GEMM methods of cpu_native.NativeKernels (which supplies `function`, the entry point of a name
    for a dtype, and `_probes`, the probes' results)."""

    def gemm(self, rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
             num_threads: int) -> torch.Tensor | None:
        """rows [M, K] fp32 (unit column stride) times a weight packed by gemm_libraries.pack_panels ([N, K]
        fp32 or fp16, panels of 16 outputs; fp16 widened exactly in the kernel), plus bias [N] (cpu_gemm.c)
        -> [M, N] fp32; None: this build has no GEMM (it needs AVX2, FMA and F16C)."""
        n, k = packed.shape
        assert rows.dtype == torch.float32 and packed.dtype in (torch.float32, torch.float16)
        assert packed.is_contiguous() and rows.shape[1] == k >= 1
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        if bias is not None:
            assert bias.dtype == torch.float32 and bias.is_contiguous() and bias.shape == (n,)
        out = torch.empty(rows.shape[0], n, dtype=torch.float32)
        name = "vb_gemm" if packed.dtype == torch.float32 else "vb_gemm_f16"
        rc = self.function(name, torch.float32)(rows.data_ptr(), rows.stride(0), packed.data_ptr(),
                                           None if bias is None else bias.data_ptr(), out.data_ptr(), n,
                                           rows.shape[0], n, k, num_threads)
        if rc == 3:
            raise NativeKernelError("native fp16 GEMM: out of memory for its per-thread weight block")
        return out if rc == 0 else None

    def gemm_gated(self, rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, fuse: bool,
                   num_threads: int) -> torch.Tensor | None:
        """rows [M, K] fp32 (unit column stride) times a gated MLP's gate and up weights packed by
        gemm_libraries.pack_gated_panels ([2 * inter, K] fp32 or fp16), plus bias [2 * inter] (the gate's,
        then the up projection's) -> silu(gate) * up [M, inter] fp32 when `fuse` (vb_silu_and_mul's
        formula, in the GEMM's epilogue), else gate | up [M, 2 * inter] (cpu_gemm.c); None: this build
        has no GEMM."""
        two_inter, k = packed.shape
        assert rows.dtype == torch.float32 and packed.dtype in (torch.float32, torch.float16) and two_inter % 2 == 0
        assert packed.is_contiguous() and rows.shape[1] == k >= 1
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        if bias is not None:
            assert bias.dtype == torch.float32 and bias.is_contiguous() and bias.shape == (two_inter,)
        inter = two_inter // 2
        out = torch.empty(rows.shape[0], inter if fuse else two_inter, dtype=torch.float32)
        name = "vb_gemm_gated" if packed.dtype == torch.float32 else "vb_gemm_gated_f16"
        rc = self.function(name, torch.float32)(rows.data_ptr(), rows.stride(0), packed.data_ptr(),
                                           None if bias is None else bias.data_ptr(), out.data_ptr(), out.shape[1],
                                           rows.shape[0], inter, k, int(fuse), num_threads)
        if rc == 3:
            raise NativeKernelError("native gated GEMM: out of memory for its per-thread buffers")
        return out if rc == 0 else None

    @property
    def has_gemm(self) -> bool:
        """Whether this build has the fp32 GEMM (cpu_gemm.c: AVX2 and FMA)."""
        if "gemm" not in self._probes:
            probe = torch.ones(1, 1)
            self._probes["gemm"] = self.gemm(probe, probe, None, 1) is not None
        return self._probes["gemm"]

    def gemm_q8_0(self, rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int,
                  vnni: bool, num_threads: int, gated: bool = False) -> torch.Tensor | None:
        """rows [M, K] fp32 (unit column stride) times Q8_0 weights packed by cpu_q8_0_linear.pack_panels
        (int16 [panels x 17, K]; cpu_gemm_q8.c), plus bias [out] -> [M, out] fp32, in integer
        arithmetic (rows rounded to int16, one scale per row); `vnni`: with AVX-VNNI (the CPU must
        have avx_vnni). `gated`: the weight is a gated MLP's merged [gate; up] projection (out = 2 x
        inter, inter a multiple of 16) and the result silu(gate) * up [M, inter] (vb_silu_and_mul's
        formula, in the GEMM's epilogue). None: this build has no such GEMM (it needs AVX2 and FMA)."""
        k = packed.shape[1]
        assert rows.dtype == torch.float32 and packed.dtype == torch.int16 and packed.is_contiguous()
        assert rows.shape[1] == k and packed.shape[0] * 16 == -(-out_features // 16) * 16 * 17
        assert not gated or out_features % 32 == 0
        if rows.stride(1) != 1:
            rows = rows.contiguous()
        if bias is not None:
            assert bias.dtype == torch.float32 and bias.is_contiguous() and bias.shape == (out_features,)
        width = out_features // 2 if gated else out_features
        out = torch.empty(rows.shape[0], width, dtype=torch.float32)
        rc = self.function("vb_gemm_q8_gated" if gated else "vb_gemm_q8", torch.float32)(
            rows.data_ptr(), rows.stride(0), packed.data_ptr(), None if bias is None else bias.data_ptr(),
            out.data_ptr(), width, rows.shape[0], width, k, int(vnni), num_threads)
        if rc == 1:
            return None
        if rc != 0:
            raise NativeKernelError(f"native Q8_0 GEMM: error {rc} ({_Q8_GEMM_ERRORS.get(rc, 'unknown')})")
        return out

    @property
    def has_gemm_q8_0(self) -> bool:
        """Whether this build has the integer Q8_0 GEMM (cpu_gemm_q8.c: AVX2 and FMA)."""
        if "gemm_q8_0" not in self._probes:
            probe = torch.zeros(1, q8_0.BLOCK)
            self._probes["gemm_q8_0"] = self.gemm_q8_0(probe, torch.zeros(17, q8_0.BLOCK, dtype=torch.int16),
                                                             None, 1, False, 1) is not None
        return self._probes["gemm_q8_0"]

    @property
    def has_gemm_q8_0_vnni(self) -> bool:
        """Whether the integer Q8_0 GEMM can use AVX-VNNI here: /proc/cpuinfo lists avx_vnni (where
        vbatch reads the CPU for every other choice, kernels/cpu_features.py), and the kernel agrees:
        its own CPUID check passes and the build's assembler knew the instruction (kernels/
        native_build.py toolchain_defines)."""
        if "gemm_q8_0_vnni" not in self._probes:
            from .cpu_features import detect
            ok = self.has_gemm_q8_0 and detect().has("avx_vnni")
            if ok:
                try:
                    self.gemm_q8_0(torch.zeros(1, q8_0.BLOCK), torch.zeros(17, q8_0.BLOCK, dtype=torch.int16), None, 1,
                                   True, 1)
                except NativeKernelError:
                    ok = False
            self._probes["gemm_q8_0_vnni"] = ok
        return self._probes["gemm_q8_0_vnni"]
