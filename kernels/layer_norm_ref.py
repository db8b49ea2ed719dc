"""Reference LayerNorm ops (plain PyTorch): the specification and test oracle for encoder models.

Called by the encoder layers (BERT post-norm, ViT pre-norm) through `kernels.ops`. Written out
as the formula (mean, biased variance, normalise in fp32, cast back, then scale and shift), not
with `F.layer_norm`, so the fast path (kernels/torch_encoder.py) is checked against something
independent of it.
"""
from __future__ import annotations

import torch


def layer_norm(
    x: torch.Tensor,       # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    bias: torch.Tensor,    # [hidden]
    eps: float,
) -> torch.Tensor:         # [..., hidden], dtype of x
    x32 = x.to(torch.float32)
    mean = x32.mean(-1, keepdim=True)
    var = (x32 - mean).pow(2).mean(-1, keepdim=True)
    normed = (x32 - mean) * torch.rsqrt(var + eps)
    return (normed * weight.to(torch.float32) + bias.to(torch.float32)).to(x.dtype)


def add_layer_norm(
    x: torch.Tensor,         # [..., hidden]: a sublayer's output
    residual: torch.Tensor,  # [..., hidden]: its input
    weight: torch.Tensor,    # [hidden]
    bias: torch.Tensor,      # [hidden]
    eps: float,
) -> torch.Tensor:           # [..., hidden]: LayerNorm(x + residual) (BERT's post-norm residual)
    # NOTE: the sum is rounded to the activation dtype first, as transformers' BertSelfOutput does.
    return layer_norm(x + residual, weight, bias, eps)
