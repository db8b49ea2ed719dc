"""Prepacked oneDNN linear layers for bf16 on CPU (the CPU model's GEMMs).

`pack_linear(nn.Linear) -> PackedLinear` is bound as `Ops.pack_linear` for bf16 on CPUs with
avx512_bf16 (kernels/ops.py); the model calls it once per Linear after its weights are loaded
(`LlamaForCausalLM.finalize_weights`). The oracle is `F.linear` on the same bf16 tensors.

NOTE: why prepack. A plain bf16 `F.linear` on this CPU runs oneDNN too, but reorders the weight
into oneDNN's blocked layout on every call: measured here (2 threads, SmolLM2 layer shapes) a
packed weight makes the per-layer GEMMs 2.5x faster at batch 1 (0.33 -> 0.13 ms) and 1.4x at batch
64 (1.6 -> 1.1 ms). The packed layout is only a weight layout: one packed tensor serves every
batch size (checked from 1 to 300 rows; the batch-size hint changes nothing measurable).
Accumulation is fp32 inside oneDNN; the output is rounded to bf16, exactly as `F.linear` does.
"""
from __future__ import annotations

import torch
from torch import nn

_PACK_BATCH_HINT = 64  # oneDNN wants a batch-size hint for the reorder; any size runs on the result


def can_pack(dtype: torch.dtype) -> bool:
    """True when this torch build and CPU run prepacked bf16 oneDNN linears."""
    if dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor:  # [out, in] bf16 -> opaque packed bf16
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_BATCH_HINT)


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int) -> torch.Tensor:  # x: [..., in] -> [..., out]
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, packed_weight, bias, "none", [], "")
    return out.view(*x.shape[:-1], out_features)


class PackedLinear(nn.Module):
    """`nn.Linear` with its weight in oneDNN's blocked layout; same forward signature and result.

    With the native kernels built (kernels/cpu_native.py), the plain [out, in] weight is kept too
    and up to `SMALL_ROWS` rows go through `cpu_linear_small.c` instead: oneDNN reads the weight at
    about 16 GB/s at one row, the native kernel at about 28 (whole model, 2 threads, measured
    here; 1.7x at 1-2 rows, 1.2x at 4, slower from 8). The price is a second copy of the weights
    (the tied logits head shares the embedding's storage, so it costs nothing)."""

    SMALL_ROWS = 4

    def __init__(self, linear: nn.Linear, pack: bool = True) -> None:
        super().__init__()
        from . import cpu_native
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Buffers, not parameters: nothing trains, and the packed tensor is not a plain [out, in] matrix.
        self.register_buffer("packed_weight", pack_weight(linear.weight) if pack else None, persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone(), persistent=False)
        self.native = cpu_native.load()
        self.register_buffer("weight", linear.weight.detach().contiguous() if self.native else None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        small = self._small(x)
        return small if small is not None else packed_linear(x, self.packed_weight, self.bias, self.out_features)

    def _small(self, x: torch.Tensor) -> torch.Tensor | None:  # [..., in] -> [..., out] or None (not small)
        if self.native is not None and x.numel() <= self.SMALL_ROWS * self.in_features:
            rows = self.native.linear_small_bf16(x.reshape(-1, self.in_features), self.weight, self.bias,
                                                 torch.get_num_threads())
            if rows is not None:
                return rows.view(*x.shape[:-1], self.out_features)
        return None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PackedGateUp(PackedLinear):
    """The merged [gate; up] projection of a gated MLP, with `silu_and_mul(x)` fused into its GEMMs.

    `silu_and_mul(x)` == `silu_and_mul(self(x))` (activation_ref): above SMALL_ROWS rows it is two
    oneDNN GEMMs over the packed gate and up halves, the first with SiLU applied to its fp32
    accumulator, the second multiplying its accumulator by the first's bf16 result, so the
    [rows, 2 * inter] product is never written, read back and converted (measured here, 2
    threads, SmolLM2's shapes: 8,192 rows 94 -> 73 ms, 2,048 rows 19.5 -> 18.5, 256 rows 2.5 ->
    2.3). Gate and up are not rounded to bf16 before the activation, so it differs from the
    reference by bf16 rounding only (tests/test_cpu_kernels.py). Up to SMALL_ROWS rows: the small-rows
    kernel and the native SiLU-and-mul, exactly as the separate ops (the fused decoder layer's
    equality test relies on it)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear, pack=False)
        half = self.out_features // 2
        weight, bias = linear.weight.detach(), linear.bias
        self.register_buffer("packed_gate", pack_weight(weight[:half]), persistent=False)
        self.register_buffer("packed_up", pack_weight(weight[half:]), persistent=False)
        self.register_buffer("bias_gate", None if bias is None else bias.detach()[:half].clone(), persistent=False)
        self.register_buffer("bias_up", None if bias is None else bias.detach()[half:].clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # the Linear's contract: [..., in] -> [..., 2 * inter]
        small = self._small(x)
        if small is not None:
            return small
        half = self.out_features // 2
        return torch.cat([packed_linear(x, self.packed_gate, self.bias_gate, half),
                          packed_linear(x, self.packed_up, self.bias_up, half)], dim=-1)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., inter]
        small = self._small(x)
        if small is not None:
            from .cpu_native_ops import silu_and_mul
            return silu_and_mul(small)
        rows = x.reshape(-1, self.in_features)
        gate = torch.ops.mkldnn._linear_pointwise(rows, self.packed_gate, self.bias_gate, "swish", [], "")
        out = torch.ops.mkldnn._linear_pointwise.binary(rows, gate, self.packed_up, self.bias_up, "mul")
        return out.view(*x.shape[:-1], self.out_features // 2)


def pack_gate_up(linear: nn.Linear) -> nn.Module:
    """The packed twin of a gated MLP's merged gate/up `linear`, with `silu_and_mul` fused (bf16 only)."""
    if not can_pack(linear.weight.dtype):
        return linear
    return PackedGateUp(linear)


def pack_linear(linear: nn.Linear) -> nn.Module:
    """The packed twin of `linear` (bf16 only; any other dtype keeps the plain module)."""
    if not can_pack(linear.weight.dtype):
        return linear
    return PackedLinear(linear)
