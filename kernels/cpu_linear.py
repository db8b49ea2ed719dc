"""Prepacked linear layers for the CPU model's GEMMs (fp32 or bf16), with a small-rows native path.

`pack_linear(linear, native, weight_dtype) -> PackedLinear` is bound as `Ops.pack_linear` on CPU
(kernels/ops.py); the model calls it once per Linear after its weights are loaded
(`LlamaForCausalLM.finalize_weights`). The oracle is `F.linear` on the same tensors.

NOTE: why prepack. A plain `F.linear` on CPU either reorders the weight into oneDNN's blocked
layout on every call (bf16) or goes through MKL's sgemm (fp32): measured here (2 threads, SmolLM2
layer shapes), a bf16 weight packed once makes the per-layer GEMMs 2.5x faster at batch 1 (0.33 ->
0.13 ms) and 1.4x at batch 64 (1.6 -> 1.1 ms) on Zen 4; on Zen 3 (AVX2, fp32) oneDNN's packed
fp32 GEMM ran the model's shapes at 87 / 118 / 131 / 137 GFLOP/s for 16 / 64 / 256 / 1,024 rows
against MKL's F.linear at 39 / 68 / 103 / 130 (bench/gemm_backends.py). The packed layout is only
a weight layout: one packed tensor serves every batch size. Accumulation is fp32 inside the
library; a bf16 output is rounded to bf16, exactly as `F.linear` does.

NOTE: the GEMM library each layer runs through, and why: kernels/gemm_libraries.py.

NOTE: half-precision weights. With `weight_dtype` below the model's dtype (an fp32 model on a CPU
without fast bf16: dtype auto streams its weights as fp16, cpu_features.CpuTier.half_dtype)
the weight is rounded to it once here, and both paths compute with the rounded values: the packed
GEMM holds them widened back to fp32, the small-rows kernel streams them in half precision. So the
layer is one well-defined function (fp16 weights, fp32 arithmetic) whatever the batch size, and
the decode steps read half the bytes.

NOTE: Q8_0 weights (`quantization="q8_0"`, an fp32 model, explicit opt-in): the same rule one step
further. The weight is quantized once (kernels/q8_0.py: int8 and an fp16 scale per 32); the
small-rows kernel streams those bytes (53% of fp16's), the packed GEMM holds their dequantized fp32
values, so every batch size computes with the same weights q * d. A linear whose input width is not
a whole number of 32-blocks keeps `weight_dtype` (logged). On the avx2 tier the 5+-row GEMMs run
in integers instead (kernels/cpu_q8_0_linear.py: the same q * d, the rows rounded to int16).
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from . import q8_0
from .gemm_libraries import ONEDNN, GemmBackend, can_pack, gemm_backend

logger = logging.getLogger(__name__)


MLP_CHUNK_ROWS = 2048
"""Rows of a gated MLP computed together in a large step (Ops.mlp_chunk_rows): gate/up, SiLU-and-mul
and down over 2,048 rows at a time, not the step's 8,192, so the intermediate product is read back
from cache rather than memory and no allocation is large enough to be mapped and zeroed afresh.
NOTE: measured on the Intel Xeon with AMX (2 threads, SmolLM2's 30 MLPs over 8,192 rows,
/tmp-style loop over PackedGateUp + PackedLinear): bf16 1,233-1,396 GFLOP/s whole, 2,137 / 2,188 /
2,180 / 1,949 / 1,564 at 4,096 / 3,072 / 2,048 / 1,536 / 1,024-row chunks; fp32 with fp16 weights,
torch's libraries held to AVX2 (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2, the avx2 tier): 197-198 whole, 199 / 204 / 215-220 / 218 / 219-221
/ 225 at 4,096 / 3,072 / 2,048 / 1,536 / 1,024 / 512. Encoders get the same from the pooling runner,
which runs a step's sequences in sub-batches of 2,048 tokens (engine/pooling_runner.py)."""


def describe(model: nn.Module) -> str | None:
    """The GEMM library of `model`'s packed linears ("zentorch 2.13.0.2", "onednn"), None if none is packed."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            if module.gemm_name != "zentorch":
                return module.gemm_name
            from importlib.metadata import PackageNotFoundError, version
            try:
                return f"zentorch {version('zentorch')}"
            except PackageNotFoundError:
                return "zentorch"
    return None


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int, backend: GemmBackend, act: str = "none") -> torch.Tensor:
    """[..., in] -> [..., out], the activation `act` applied to the GEMM's accumulator."""
    rows = x.reshape(-1, x.shape[-1])
    out = backend.linear(rows, packed_weight, bias, act)
    return out.view(*x.shape[:-1], out_features)


class PackedLinear(nn.Module):
    """`nn.Linear` with its weight in its GEMM library's blocked layout (oneDNN's or zentorch's, see
    kernels/gemm_libraries.py); same forward signature and result.

    With the native kernels built (kernels/cpu_native.py, `native`), a plain [out, in] copy of the
    weight in `weight_dtype` is kept too and up to `small_rows` rows go through `cpu_linear_small.c`
    instead: oneDNN reads the weight at about 16 GB/s at one row, the native kernel at about 28 (Zen
    4, whole model, 2 threads; 1.7x at 1-2 rows, 1.2x at 4, slower from 8). The price is that second
    copy of the weights (for a bf16 model the tied logits head shares the embedding's storage).

    NOTE: why `small_rows` is the tier's `small_rows_wider` (kernels/cpu_features.py: 16 on every
    tier) where the library multiplies a wider copy of the weights than the kernel reads (an fp32 model
    with fp16, bf16 or Q8_0 storage: the avx2 tier's default), else SMALL_ROWS.
    There oneDNN streams 4 bytes per weight, twice fp16's, and stays bound by memory well past 4 rows.
    The limit also sets the rows the fused decoder layer and the multi-step decodes take (kernels/
    cpu_native_ops.py), which save the Python between ops: so it is decided end to end, not by the
    linears alone (`python bench/small_rows_limit.py`). Measured on Zen 4 (2 threads; docs/performance/
    avx2-on-zen4.md "Decode at 5-16 requests" and "The small-rows limit per tier"):
      - linears alone (SmolLM2-135M's 121 matrices in turn, one process alternating, oneDNN ms / kernel
        ms), avx2 tier held to AVX2, fp16 weights: 4 rows 33.6 / 12.5 (2.7x), 8 rows 36.5 / 19.5
        (1.9x), 16 rows 46.0-47.4 / 34.6-35.7 (1.3x), 24 rows 1.07-1.13x, 32 rows 0.93-1.02x, 48 rows
        0.94x. avx512-bf16 tier (oneDNN in AVX-512), fp16 / bf16 weights: 12 rows 1.05x, 16 rows
        0.98x / 0.93x. portable tier, bf16 weights, oneDNN held to SSE4.1 (as 128-bit NEON): 8 rows
        1.24x, 16 rows 0.92x. On Zen 3 (session 32) against vbatch's own GEMM over the fp16 weights,
        GEMM time / kernel time: 8 rows 1.02x, 16 rows 0.84x, 24 rows 0.72x, 32 rows 0.74x.
      - end to end (`LLM`s with different limits in one process, prompts of 128-512 tokens, 128 out,
        output tok/s): avx2 tier, 32 against 16 (session 26, against oneDNN's GEMM): 24 prompts 1.15x,
        32 prompts 1.04x (6 of 6 rounds), 48 against 32 at 48 prompts 1.00x; against vbatch's own
        GEMM when it came (session 26) 1.03x at 32 prompts. After that GEMM's prefetch and the gated
        GEMM (session 27), session 33 (avx2 held): 16 against 32 at 24 prompts 1.066x in two runs (6
        of 6 and 4 of 4 rounds), at 32 prompts 1.046x (6 of 6); 8 against 32 at 24 prompts 1.041x; at
        12 prompts all three within 1%. So 16 there too. avx512-bf16 tier, fp16 weights: 16 against 12 at 16
        prompts 1.05x (6 of 6 rounds), 32 against 16 at 32 prompts 0.95-1.08x (not kept). portable
        (SSE4.1 hold): 16 against 4 at 8 prompts 1.24x, at 16 prompts 1.06x. On Zen 3 itself
        (session 40, 6 rounds each): 16 against 32 at 24 prompts 1.06x (5 of 6 rounds), at 32 prompts
        1.11x (5 of 6); against 8 and 12 at 16 prompts 1.07x and 1.08x, at 12 prompts 1.05x and 0.95x.
    For the same bytes (bf16 weights under zentorch's bf16 GEMM on Zen 4): 4 rows 1.11x, 5 rows 0.87x,
    8 rows 0.85x. Q8_0 against the integer GEMM: kernels/cpu_q8_0_linear.py."""

    SMALL_ROWS = 4  # the kernel's rows where the library streams the bytes the kernel reads

    def __init__(self, linear: nn.Linear, *, backend: GemmBackend | None = None, native=None,
                 weight_dtype: torch.dtype | None = None, pack: bool = True, quantization: str | None = None) -> None:
        super().__init__()
        dtype = linear.weight.dtype
        self.backend = backend or gemm_backend(dtype, None if native is None else native.tier)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.quantization = quantization if quantization and self._quantizes() else None
        if self.quantization:  # Q8_0 rows for the kernel; their dequantized values for the GEMM library
            self.weight_dtype = torch.int8
            stored = q8_0.quantize(linear.weight)                   # [out, in * 17 / 16] int8
            # unpacked (cpu_q8_0_linear's integer GEMM packs the int8 rows itself): no fp32 copy
            self.compute_weight = q8_0.dequantize(stored, self.in_features).to(dtype) if pack else None
        else:
            self.weight_dtype = weight_dtype or dtype
            stored = linear.weight.detach().to(self.weight_dtype)   # [out, in]: the layer's weights, rounded once
            # the fp32 copy the library multiplies, unless it widens the stored weights itself
            direct = self.weight_dtype in self.backend.stored_dtypes
            self.compute_weight = stored.to(dtype) if self.weight_dtype != dtype and not direct else stored
        # Buffers, not parameters: nothing trains, and the packed tensor is not a plain [out, in] matrix.
        self.register_buffer("packed_weight", self.backend.pack(self.compute_weight) if pack else None,
                             persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone(), persistent=False)
        self.native = native if native is not None and native.has_small_linear(dtype, self.weight_dtype) else None
        self.register_buffer("small_weight", stored.contiguous() if self.native else None, persistent=False)
        # the most rows of x the small-rows kernel takes (class NOTE); 0: none
        self.small_rows = 0 if self.native is None else self._most_small_rows(dtype.itemsize > stored.dtype.itemsize)
        if pack:
            self.compute_weight = None  # the packed copy serves; only PackedGateUp still slices it

    def _most_small_rows(self, wider: bool) -> int:
        """The most rows the small-rows kernel takes (class NOTE); `wider`: the library multiplies a
        wider copy of the weights than the kernel streams."""
        return self.native.tier.small_rows_wider if wider else self.SMALL_ROWS

    @property
    def gemm_name(self) -> str:
        """The library its 5+-row GEMMs run in (`vbatch bench` prints it)."""
        return self.backend.name

    def _quantizes(self) -> bool:
        """Whether `quantization` applies to this layer (else it keeps weight_dtype, logged). Where
        it runs at all (fp32 models, the native kernels) kernels/ops.py `_cpu_ops` decides."""
        if not q8_0.can_quantize(self.in_features):
            logger.warning("a [%d, %d] linear keeps its unquantized weights: Q8_0 needs whole blocks of %d inputs",
                           self.out_features, self.in_features, q8_0.BLOCK)
            return False
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        small = self._small(x)
        if small is not None:
            return small
        return packed_linear(x, self.packed_weight, self.bias, self.out_features, self.backend)

    def linear_gelu(self, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        """gelu(self(x)) with GELU fused into the GEMM (an encoder MLP's first projection); equal to
        activation_ref.gelu(self(x)) within fp32 rounding (tests/test_encoder_ops.py)."""
        small = self._small(x)
        if small is not None:
            return F.gelu(small, approximate=approximate)
        if self.backend is not ONEDNN:   # the post-op is oneDNN's; the other libraries' GEMM, then GELU
            return F.gelu(self(x), approximate=approximate)
        return packed_linear(x, self.packed_weight, self.bias, self.out_features, self.backend,
                             "gelu_tanh" if approximate == "tanh" else "gelu")

    def _small(self, x: torch.Tensor) -> torch.Tensor | None:  # [..., in] -> [..., out] or None (not small)
        if x.numel() <= self.small_rows * self.in_features:
            rows = self.native.linear_small(x.reshape(-1, self.in_features), self.small_weight, self.bias,
                                            torch.get_num_threads())
            if rows is not None:
                return rows.view(*x.shape[:-1], self.out_features)
        return None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"gemm={self.backend.name}, weights={self.quantization or str(self.weight_dtype).removeprefix('torch.')}")


class PackedGateUp(PackedLinear):
    """The merged [gate; up] projection of a gated MLP, with `silu_and_mul(x)` fused into its GEMMs.

    `silu_and_mul(x)` == `silu_and_mul(self(x))` (activation_ref), so the [rows, 2 * inter] product
    is never written, read back and converted. Above `small_rows` rows, one of two ways:
      - a library with a gated GEMM (`GemmBackend.gated`: vbatch's own, the avx2 tier's fp32 GEMM):
        one GEMM over the gate and up panels in pairs, SiLU-and-mul in its epilogue with the native
        op's formula, so it equals GEMM + op bit for bit (kernels/csrc/cpu_gemm.c gemm_gated's NOTE:
        1.01-1.05x on Zen 4 held to AVX2);
      - else two GEMMs over the packed gate and up halves, the first with SiLU applied to its fp32
        accumulator, the second multiplying its accumulator by the first's result (measured on Zen
        4, 2 threads, SmolLM2's shapes, bf16: 8,192 rows 94 -> 73 ms, 2,048 rows 19.5 -> 18.5, 256
        rows 2.5 -> 2.3). In bf16, gate and up are not rounded to bf16 before the activation, so it
        differs from the reference by bf16 rounding only (tests/test_cpu_kernels.py).
    Up to `small_rows` rows: the small-rows kernel and the native SiLU-and-mul, exactly as the
    separate ops (the fused decoder layer's equality test relies on it)."""

    def __init__(self, linear: nn.Linear, *, backend: GemmBackend | None = None, native=None,
                 weight_dtype: torch.dtype | None = None) -> None:
        super().__init__(linear, backend=backend, native=native, weight_dtype=weight_dtype, pack=False)
        half = self.out_features // 2
        weight, bias = self.compute_weight, linear.bias
        self.one_gemm = self.backend.gated is not None
        if self.one_gemm:
            self.register_buffer("packed_gated", self.backend.pack_gated(weight[:half], weight[half:]),
                                 persistent=False)
            self.register_buffer("bias_gated", None if bias is None else bias.detach().clone(), persistent=False)
        else:
            self.register_buffer("packed_gate", self.backend.pack(weight[:half]), persistent=False)
            self.register_buffer("packed_up", self.backend.pack(weight[half:]), persistent=False)
            self.register_buffer("bias_gate", None if bias is None else bias.detach()[:half].clone(), persistent=False)
            self.register_buffer("bias_up", None if bias is None else bias.detach()[half:].clone(), persistent=False)
        self.compute_weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # the Linear's contract: [..., in] -> [..., 2 * inter]
        small = self._small(x)
        if small is not None:
            return small
        rows = x.reshape(-1, self.in_features)
        if self.one_gemm:
            out = self.backend.gated(rows, self.packed_gated, self.bias_gated, False)
        else:
            out = torch.cat([self.backend.linear(rows, self.packed_gate, self.bias_gate, "none"),
                             self.backend.linear(rows, self.packed_up, self.bias_up, "none")], dim=-1)
        return out.view(*x.shape[:-1], self.out_features)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., inter]
        small = self._small(x)
        if small is not None:
            return self.native.silu_and_mul(small, torch.get_num_threads())
        rows = x.reshape(-1, self.in_features)
        if self.one_gemm:
            out = self.backend.gated(rows, self.packed_gated, self.bias_gated, True)
        else:
            gate = self.backend.linear(rows, self.packed_gate, self.bias_gate, "silu")
            out = self.backend.linear_mul(rows, self.packed_up, self.bias_up, gate)
        return out.view(*x.shape[:-1], self.out_features // 2)


def pack_gate_up(linear: nn.Linear, native=None, weight_dtype: torch.dtype | None = None,
                 quantization: str | None = None) -> nn.Module:
    """The packed twin of a gated MLP's merged gate/up `linear`: `silu_and_mul` fused into its GEMMs
    (PackedGateUp) for bf16, and for fp32 where the GEMM library has a gated GEMM (vbatch's own: the
    avx2 tier); otherwise for fp32 one plain packed GEMM (the model then applies the op's
    SiLU-and-mul), because oneDNN's fp32 post-ops ran slower than the GEMM plus the native op on Zen 3
    (2 threads, 576 -> 2 x 1536: 256 rows 8.8 vs 6.3 ms, 2,048 rows 59 vs 48, 8,192 rows 264 vs 241),
    and for Q8_0 weights their own GEMMs (pack_linear), gated in one integer GEMM where they multiply in
    integers (cpu_q8_0_linear.PackedQ8_0GateUp). Any other dtype, or no oneDNN: the plain module."""
    dtype = linear.weight.dtype
    if not can_pack(dtype):
        return linear
    if dtype == torch.float32 and quantization is None:
        if gemm_backend(dtype, None if native is None else native.tier).gated is not None:
            return PackedGateUp(linear, native=native, weight_dtype=weight_dtype)
    if dtype != torch.bfloat16:
        return pack_linear(linear, native=native, weight_dtype=weight_dtype, quantization=quantization, gate_up=True)
    return PackedGateUp(linear, native=native, weight_dtype=weight_dtype)


def pack_linear(linear: nn.Linear, native=None, weight_dtype: torch.dtype | None = None,
                quantization: str | None = None, gate_up: bool = False) -> nn.Module:
    """The packed twin of `linear`, its weights stored in `weight_dtype` (default: its own) or as
    `quantization` ("q8_0", fp32 models), the small-rows kernel of `native` (NativeKernels) for its
    `small_rows` rows where it has one. Q8_0 layers multiply 5+ rows in integers
    (kernels/cpu_q8_0_linear.py) where `gemm_choice` says so; `gate_up` (a gated MLP's merged
    projection) then also with SiLU-and-mul in the GEMM (PackedQ8_0GateUp) where its halves fit."""
    if not can_pack(linear.weight.dtype):
        return linear
    if quantization == q8_0.NAME and q8_0.can_quantize(linear.in_features):
        from . import cpu_q8_0_linear
        choice = cpu_q8_0_linear.gemm_choice(native)
        if choice != "float":
            gated = gate_up and cpu_q8_0_linear.PackedQ8_0GateUp.fits(linear)
            layer = cpu_q8_0_linear.PackedQ8_0GateUp if gated else cpu_q8_0_linear.PackedQ8_0Linear
            return layer(linear, native=native, vnni=choice == "integer-vnni")
    return PackedLinear(linear, native=native, weight_dtype=weight_dtype, quantization=quantization)
