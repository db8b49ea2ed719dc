"""The dispatch point for every model op: which implementation runs is chosen once, here.

The model calls `get_ops(device)` at construction and keeps the returned `Ops` for its life;
nothing is looked up per call. Today every device gets the plain PyTorch references (the
specification); GPU kernels with identical signatures get bound for CUDA in `get_ops` and are
tested against the references. `build_rope_cache` is set-up, not a hot-path op, so it is
re-exported as is.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

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
    # Called once per nn.Linear after the weights load; may return a faster module with the same
    # forward (CPU bf16: oneDNN-prepacked weights, kernels/cpu_linear.py). Default: keep it.
    pack_linear: Callable[[nn.Module], nn.Module] = lambda linear: linear
    # Optional, CPU bf16 (kernels/cpu_linear.py): packs a gated MLP's merged [gate; up] Linear into a
    # module with the same forward and a `silu_and_mul(x)` method equal to `silu_and_mul(module(x))`
    # (SiLU and the product fused into the GEMMs). None: `pack_linear` packs it like any Linear.
    pack_gate_up: Callable[[nn.Module], nn.Module] | None = None
    # Optional, CPU bf16 (kernels/cpu_rotary.py): `prepare_rotary(positions, cos_sin_cache, dtype)`
    # runs once per forward and the model passes its result to every layer's `apply_rotary` in
    # place of the cos/sin cache. None: `apply_rotary` gets the cache itself (the reference contract).
    prepare_rotary: Callable[..., Any] | None = None
    # Optional, CPU bf16 (kernels/cpu_attention.py): `prepare_attention(attn) -> attn'` runs once per
    # forward; attn' (an AttentionMetadata with extra per-step fields) goes to every layer.
    prepare_attention: Callable[..., Any] | None = None
    # Optional, CPU bf16 native (kernels/cpu_native_ops.py): `decoder_layer(layer, positions, hidden,
    # residual, kv_cache, attn, rope) -> (hidden, residual)` runs a whole decoder layer (the model calls
    # it in place of `layer(...)`; it may just call the layer). None: the layers run their forward.
    decoder_layer: Callable[..., Any] | None = None


REFERENCE_OPS = Ops(
    name="reference",
    write_kv_cache=write_kv_cache,
    paged_attention=paged_attention,
    rms_norm=rms_norm,
    fused_add_rms_norm=fused_add_rms_norm,
    apply_rotary=apply_rotary,
    silu_and_mul=silu_and_mul,
)


def _cpu_ops(dtype: torch.dtype) -> Ops:
    """bf16 on a CPU with avx512_bf16: prepacked oneDNN GEMMs and the native (C) paged attention,
    or the inductor-compiled decode attention where no C compiler is at hand.

    fp32 keeps the references: its greedy tokens are tested identical to transformers'."""
    from . import cpu_attention, cpu_linear, cpu_native, cpu_rotary
    if not cpu_linear.can_pack(dtype):
        return REFERENCE_OPS
    ops = dataclasses.replace(REFERENCE_OPS, name="cpu-bf16", paged_attention=cpu_attention.paged_attention,
                              pack_linear=cpu_linear.pack_linear, pack_gate_up=cpu_linear.pack_gate_up,
                              apply_rotary=cpu_rotary.apply_rotary,
                              prepare_rotary=cpu_rotary.prepare_rotary,
                              prepare_attention=cpu_attention.prepare_attention)
    if cpu_native.load() is not None:  # the C kernels (no C compiler: the torch paths above)
        from . import cpu_native_ops as n
        ops = dataclasses.replace(ops, name="cpu-bf16-native", paged_attention=n.paged_attention,
                                  prepare_attention=None, rms_norm=n.rms_norm,
                                  fused_add_rms_norm=n.fused_add_rms_norm, silu_and_mul=n.silu_and_mul,
                                  apply_rotary=n.apply_rotary, write_kv_cache=n.write_kv_cache,
                                  decoder_layer=n.decoder_layer)
    return ops


def get_ops(device: torch.device | str, dtype: torch.dtype | None = None) -> Ops:
    """The ops for `device` (and the model's `dtype`; None: the references)."""
    device = torch.device(device)  # validates the spelling early: a bad device fails at engine start
    if device.type == "cuda":
        from .triton_ops import cuda_ops  # the only place triton gets imported
        return cuda_ops(REFERENCE_OPS)
    if device.type == "cpu" and dtype is not None:
        return _cpu_ops(dtype)
    return REFERENCE_OPS
