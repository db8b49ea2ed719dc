"""Reference RMSNorm ops (plain PyTorch): the specification, CPU path and test oracle.

Called by the decoder layers through `kernels.ops`. Numerics follow transformers' LlamaRMSNorm
exactly: normalise in fp32, cast back to the input dtype, then scale by the weight.
"""
from __future__ import annotations

import torch


def rms_norm(
    x: torch.Tensor,       # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> torch.Tensor:         # [..., hidden], dtype of x (promoted with weight's dtype)
    input_dtype = x.dtype
    x32 = x.to(torch.float32)
    variance = x32.pow(2).mean(-1, keepdim=True)
    normed = x32 * torch.rsqrt(variance + eps)
    return weight * normed.to(input_dtype)


def fused_add_rms_norm(
    x: torch.Tensor,         # [..., hidden]
    residual: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,    # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Return (rms_norm(x + residual), x + residual).

    NOTE: the add happens in the activation dtype (as in transformers' decoder layer), so a
    fused GPU kernel must round the sum to that dtype before normalising to stay bit-compatible.
    """
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual
