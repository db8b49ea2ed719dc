"""Q8_0 weights: int8 values with one fp16 scale per block of 32, as llama.cpp's Q8_0.

    quantize(weight [out, in]) -> Tensor [out, in + in / 16] int8   (the row layout below)
    dequantize(packed, in_features) -> Tensor [out, in] fp32        (the weights the layer computes with)
    split(packed, in_features) -> (q [out, in] int8, d [out, in / 32] fp16)

The layout (cpu_linear_small.c's VB_WEIGHT_Q8_0, vb_kernels.h): each output row is its `in` int8
values followed by its `in / 32` fp16 scales, so one row is one contiguous stream of bytes.
For a block x of 32 weights: d = fp16(max |x| / 127), q = round(x / d) clamped to [-127, 127]
(q = 0 where d is 0), and the weight the layer uses is q * d in fp32. The oracle is that formula
written out per element (tests/test_q8_0.py); the layer's oracle is `F.linear` on `dequantize`.

NOTE: the error. Rounding to the nearest of 255 levels per block gives |x - q d| <= d / 2 =
max |x| / 254 per weight (plus fp16's rounding of d, relative 2^-11), against fp16's relative
2^-11 per weight: an absolute error about 8x fp16's on a block's largest weights. It is an
explicit opt-in (`--quantization q8_0`), never a default; docs/performance/avx2-zen3.md reports its greedy
agreement with the fp16 weights on the real model.
"""
from __future__ import annotations

import torch

BLOCK = 32
NAME = "q8_0"


class QuantizationError(ValueError):
    """A weight that Q8_0 cannot hold (rows not whole blocks, or scales beyond fp16's range)."""


def row_bytes(in_features: int) -> int:
    return in_features + in_features // BLOCK * 2


def can_quantize(in_features: int) -> bool:
    return in_features > 0 and in_features % BLOCK == 0


def quantize(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] (any float dtype) -> [out, row_bytes(in)] int8: each row's values, then its scales."""
    out_features, in_features = weight.shape
    if not can_quantize(in_features):
        raise QuantizationError(f"Q8_0 needs rows of whole {BLOCK}-weight blocks; this weight has {in_features} columns")
    blocks = weight.detach().to(torch.float32).reshape(out_features, in_features // BLOCK, BLOCK)
    amax = blocks.abs().amax(dim=-1)                                        # [out, in / 32]
    scale = (amax / 127).to(torch.float16)
    if not torch.isfinite(scale).all():
        raise QuantizationError("a block's largest weight is beyond what an fp16 Q8_0 scale holds (or not finite)")
    d = scale.to(torch.float32).unsqueeze(-1)                               # [out, in / 32, 1]
    safe = torch.where(d > 0, d, torch.ones_like(d))
    q = torch.where(d > 0, torch.round(blocks / safe), torch.zeros_like(blocks)).clamp_(-127, 127)
    packed = torch.empty(out_features, row_bytes(in_features), dtype=torch.int8)
    packed[:, :in_features] = q.reshape(out_features, in_features).to(torch.int8)
    packed[:, in_features:] = scale.view(torch.int8).reshape(out_features, -1)
    return packed


def split(packed: torch.Tensor, in_features: int) -> tuple[torch.Tensor, torch.Tensor]:
    """packed [out, row_bytes(in)] int8 -> (q [out, in] int8, d [out, in / 32] fp16), views where they can be."""
    if packed.dtype != torch.int8 or packed.dim() != 2 or packed.shape[1] != row_bytes(in_features):
        raise QuantizationError(f"not a Q8_0 weight of {in_features} columns: {tuple(packed.shape)} {packed.dtype}")
    return packed[:, :in_features], packed[:, in_features:].contiguous().view(torch.float16)


def dequantize(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """The fp32 weights [out, in] a Q8_0 layer computes with: q * d per block."""
    q, d = split(packed, in_features)
    out_features = q.shape[0]
    blocks = q.to(torch.float32).reshape(out_features, in_features // BLOCK, BLOCK)
    return (blocks * d.to(torch.float32).unsqueeze(-1)).reshape(out_features, in_features)


def in_features_of(packed: torch.Tensor) -> int:
    """The column count of a Q8_0 weight from its row length (row_bytes is 17/16 of it)."""
    in_features = packed.shape[1] * 16 // 17
    if row_bytes(in_features) != packed.shape[1]:
        raise QuantizationError(f"{packed.shape[1]} bytes per row is not a Q8_0 row")
    return in_features
