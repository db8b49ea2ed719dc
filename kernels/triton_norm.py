"""Triton RMSNorm and fused residual-add + RMSNorm: GPU versions of `norm_ref` (same signatures).

Bound for CUDA by `kernels.ops.get_ops`; called twice per decoder layer. One program per row
holds the whole hidden vector (hidden <= 16k fits one block). The reference's roundings are
mirrored step by step: the residual sum rounded to the activation dtype, the norm in fp32,
the normalised row rounded to the input dtype, the weight product rounded to the output dtype.
With bf16 that makes the kernel bit-compatible with the reference (up to the order of the
fp32 sum of squares); fp16 uses plain casts.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import next_pow2, round_to_bf16


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, new_residual_ptr,
    stride_x, stride_residual, hidden, eps,
    HAS_RESIDUAL: tl.constexpr, ROUND_SUM: tl.constexpr, ROUND_NORMED: tl.constexpr,
    ROUND_OUT: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        x += tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0).to(tl.float32)
        if ROUND_SUM:
            x = round_to_bf16(x)
        tl.store(new_residual_ptr + row * hidden + cols, x.to(new_residual_ptr.dtype.element_ty), mask=mask)
    variance = tl.math.div_rn(tl.sum(x * x, axis=0), tl.zeros((), tl.float32) + hidden)
    # IEEE sqrt and division (the default GPU ones are approximate): rsqrt as torch's CPU computes it.
    normed = x * tl.math.div_rn(1.0, tl.math.sqrt_rn(variance + eps))
    if ROUND_NORMED:
        normed = round_to_bf16(normed)
    out = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32) * normed
    if ROUND_OUT:
        out = round_to_bf16(out)
    tl.store(out_ptr + row * hidden + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def _rows(t: torch.Tensor) -> torch.Tensor:  # [..., hidden] -> [rows, hidden] with a unit last stride
    t2 = t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    hidden = x.shape[-1]
    x2 = _rows(x)
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    new_residual = r2 = None
    if residual is not None:
        r2 = _rows(residual)
        sum_dtype = torch.promote_types(x.dtype, residual.dtype)
        new_residual = torch.empty(x.shape, dtype=sum_dtype, device=x.device)
    norm_input_dtype = x.dtype if new_residual is None else new_residual.dtype
    if x2.shape[0] > 0:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, x2 if r2 is None else r2, weight, out, out if new_residual is None else new_residual,
            x2.stride(0), 0 if r2 is None else r2.stride(0), hidden, eps,
            HAS_RESIDUAL=residual is not None,
            ROUND_SUM=new_residual is not None and new_residual.dtype == torch.bfloat16,
            ROUND_NORMED=norm_input_dtype == torch.bfloat16,
            ROUND_OUT=out_dtype == torch.bfloat16,
            BLOCK=next_pow2(hidden),
        )
    return out, new_residual


def rms_norm(
    x: torch.Tensor,       # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:         # [..., hidden], dtype of x (promoted with weight's dtype)
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor,         # [..., hidden]
    residual: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,    # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (rms_norm(x + residual), x + residual); the inputs are not modified."""
    out, new_residual = _launch(x, residual, weight, eps)
    assert new_residual is not None
    return out, new_residual
