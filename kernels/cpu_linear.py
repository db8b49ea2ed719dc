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

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        from . import cpu_native
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Buffers, not parameters: nothing trains, and the packed tensor is not a plain [out, in] matrix.
        self.register_buffer("packed_weight", pack_weight(linear.weight), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone(), persistent=False)
        self.native = cpu_native.load()
        self.register_buffer("weight", linear.weight.detach().contiguous() if self.native else None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native is not None and x.numel() <= self.SMALL_ROWS * self.in_features:
            rows = self.native.linear_small_bf16(x.reshape(-1, self.in_features), self.weight, self.bias,
                                                 torch.get_num_threads())
            if rows is not None:
                return rows.view(*x.shape[:-1], self.out_features)
        return packed_linear(x, self.packed_weight, self.bias, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linear(linear: nn.Linear) -> nn.Module:
    """The packed twin of `linear` (bf16 only; any other dtype keeps the plain module)."""
    if not can_pack(linear.weight.dtype):
        return linear
    return PackedLinear(linear)
