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
