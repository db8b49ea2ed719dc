"""NormParams: a LayerNorm's weight and bias as a module, so checkpoints' `<name>.weight` / `<name>.bias`
keys land on it; the normalisation itself is the Ops' (`ops.layer_norm`), chosen once. Used by the
encoder families (models/bert.py, models/prithvi.py)."""
from __future__ import annotations

import torch
from torch import nn


class NormParams(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim), requires_grad=False)
