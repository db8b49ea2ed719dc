"""Reference gated activation (plain PyTorch): SiLU(gate) * up on a fused gate|up projection.

Called by the MLP of the decoder layers through `kernels.ops`; the spec and test oracle for
any fast version.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:  # x: [..., 2 * d] (gate | up) -> [..., d]
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:  # [...] -> [...]
    """GELU written out: x * Phi(x) with the erf ("none", BERT's and ViT's "gelu"), or the tanh
    approximation ("tanh", transformers' gelu_new / gelu_pytorch_tanh). Computed in fp32."""
    x32 = x.to(torch.float32)
    if approximate == "tanh":
        inner = 0.7978845608028654 * (x32 + 0.044715 * x32.pow(3))      # sqrt(2/pi)
        return (0.5 * x32 * (1.0 + torch.tanh(inner))).to(x.dtype)
    if approximate != "none":
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    return (0.5 * x32 * (1.0 + torch.erf(x32 * 0.7071067811865476))).to(x.dtype)
