"""The dispatch point for every model op: which implementation runs is chosen once, here.

The model calls `get_ops(device)` at construction and keeps the returned `Ops` for its life;
nothing is looked up per call. Today every device gets the plain PyTorch references (the
specification); GPU kernels with identical signatures get bound for CUDA in `get_ops` and are
tested against the references. `build_rope_cache` is set-up, not a hot-path op, so it is
re-exported as is.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .activation_ref import silu_and_mul
from .attention_ref import paged_attention
from .cache_ref import write_kv_cache
from .norm_ref import fused_add_rms_norm, rms_norm
from .rotary_ref import apply_rotary, build_rope_cache

__all__ = ["Ops", "REFERENCE_OPS", "get_ops", "build_rope_cache"]


@dataclass(frozen=True)
class Ops:
    """One implementation of each op; every field has the reference's signature."""

    name: str
    write_kv_cache: Callable[..., None]
    paged_attention: Callable[..., torch.Tensor]
    rms_norm: Callable[..., torch.Tensor]
    fused_add_rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    apply_rotary: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[..., torch.Tensor]


REFERENCE_OPS = Ops(
    name="reference",
    write_kv_cache=write_kv_cache,
    paged_attention=paged_attention,
    rms_norm=rms_norm,
    fused_add_rms_norm=fused_add_rms_norm,
    apply_rotary=apply_rotary,
    silu_and_mul=silu_and_mul,
)


def get_ops(device: torch.device | str) -> Ops:
    """The ops for `device`. Until GPU kernels land, every device runs the references."""
    device = torch.device(device)  # validates the spelling early: a bad device fails at engine start
    if device.type == "cuda":
        from .triton_ops import cuda_ops  # the only place triton gets imported
        return cuda_ops(REFERENCE_OPS)
    return REFERENCE_OPS
