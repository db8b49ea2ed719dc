"""The dispatch point for every model op: which implementation runs is chosen once, here.

The model runner calls `get_ops(device, dtype, ...)` once and hands the `Ops` to the model, which
keeps it for its life; nothing is looked up per call, and nothing downstream re-decides it: the
runner, the sampler and the benchmarks ask the `Ops`'s fields (its native kernels, CPU tier,
weight storage, whether it compiles on first use), never compare its `name` (display only).

    CUDA            the Triton kernels (kernels/triton_ops.py), references without triton
    CPU fp32        prepacked oneDNN GEMMs (kernels/cpu_linear.py) and the native C kernels of the
                    CPU's tier (kernels/cpu_features.py, cpu_native_ops.py) on every x86-64/ARM CPU
    CPU bf16        the same with bf16 kernels where the CPU computes bf16 (avx512_bf16); elsewhere
                    the native attention and elementwise kernels with torch's own GEMMs
    anything else   the plain PyTorch references (the specification and test oracles)

`build_rope_cache` is set-up, not a hot-path op, so it is re-exported as is.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn

from . import torch_encoder
from .activation_ref import gelu, silu_and_mul
from .attention_ref import paged_attention
from .cache_ref import write_kv_cache
from .encoder_attention_ref import encoder_attention
from .layer_norm_ref import add_layer_norm, layer_norm
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
    # Encoder families (BERT, ViT): LayerNorm, add + LayerNorm (may overwrite its first argument, the
    # sublayer's fresh output), GELU, and bidirectional attention within each packed sequence.
    layer_norm: Callable[..., torch.Tensor] = layer_norm
    add_layer_norm: Callable[..., torch.Tensor] = add_layer_norm
    gelu: Callable[..., torch.Tensor] = gelu
    encoder_attention: Callable[..., torch.Tensor] = encoder_attention
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
    # Optional, CPU native (kernels/cpu_native_ops.py): `decoder_layers(layers, positions, hidden,
    # residual, kv_caches, attn, rope, final_norm=None) -> (hidden, residual)` runs consecutive decoder
    # layers, each with its cache (the model calls it in place of `layer(...)` for each; it may just
    # call the layers), then, given final_norm = (weight, eps), the model's final
    # `fused_add_rms_norm` (hidden comes back normed). None: the layers run their forward.
    decoder_layers: Callable[..., Any] | None = None
    # Optional, CPU native (kernels/cpu_native_ops.py): `decode_steps(layers, embedding, head, final_norm,
    # cos_sin_cache, input_ids, positions, kv_caches, attn, num_steps, stop_ids, temperature=None,
    # uniforms=None) -> tokens [steps, T]` runs up to num_steps decode steps of T requests (one token
    # each) in one call: the model's embedding lookup, its layers, final norm and logits `head`, the
    # sampler's plain rows (temperature [T], 0 greedy, at uniforms [num_steps, T]; None: all greedy),
    # fed back (engine/scheduler.py multi-step decodes); it ends with the first step in which a
    # request sampled one of its `stop_ids`.
    # `decode_steps_rows(layers, head, kv_caches)`: the most requests it takes for those (0: none).
    decode_steps: Callable[..., Any] | None = None
    decode_steps_rows: Callable[..., int] | None = None
    # Optional, CPU: a decoder's MLP over more rows than this runs `mlp_chunk_rows` rows at a time
    # (engine/models/row_chunks.py), so its [rows, intermediate] product stays in cache
    # (kernels/cpu_linear.py MLP_CHUNK_ROWS). None: all rows at once.
    mlp_chunk_rows: int | None = None
    # What the ops are built on, for the engine to ask (never `name`):
    native: Any = None                  # the NativeKernels they call (CPU); the sampler reads the model's logits with it
    cpu_tier: Any = None                # the cpu_features.CpuTier they were chosen for (CPU)
    weight_dtype: torch.dtype | None = None  # how the linear weights are stored (None: the model's dtype)
    quantization: str | None = None     # "q8_0": the linear weights quantized (kernels/q8_0.py); None: stored as weight_dtype
    kv_cache_dtype: torch.dtype | None = None  # how the KV cache is stored (None: the model's dtype)
    compiles_on_first_use: bool = False  # inductor-compiled paths: the runner warms them up before the first step
    graph_capturable: bool = False      # CUDA graphs may capture them (Triton: no host-side lengths read)


REFERENCE_OPS = Ops(
    name="reference",
    write_kv_cache=write_kv_cache,
    paged_attention=paged_attention,
    rms_norm=rms_norm,
    fused_add_rms_norm=fused_add_rms_norm,
    apply_rotary=apply_rotary,
    silu_and_mul=silu_and_mul,
)


# torch's fused kernels for the encoder ops: every device's fast path (kernels/torch_encoder.py).
_ENCODER_FAST = dict(layer_norm=torch_encoder.layer_norm, add_layer_norm=torch_encoder.add_layer_norm,
                     gelu=torch_encoder.gelu, encoder_attention=torch_encoder.encoder_attention)


def _cpu_ops(dtype: torch.dtype, weight_dtype: torch.dtype | None, kv_cache_dtype: torch.dtype | None,
             prefer_half: bool, tier, quantization: str | None = None) -> Ops:
    """The CPU ops for a `dtype` model on `tier` (kernels/cpu_features.py; None: the selected one).

    weight_dtype / kv_cache_dtype: how linear weights and the KV cache are stored (None: `dtype`, or
    the tier's half-precision format when `prefer_half` and the model is fp32 with native kernels
    to stream it: dtype auto on a CPU without fast bf16). quantization "q8_0": the linear weights
    quantized instead (kernels/q8_0.py; an fp32 model with the native kernels, else QuantizationError)."""
    from . import cpu_attention, cpu_features, cpu_linear, cpu_native, cpu_rotary, gemm_libraries, q8_0
    from .cpu_native_ops import NativeOps
    from .native_build import variants_for
    tier = tier or cpu_features.selected_tier()
    # half-precision storage needs the native kernels to widen it; their variants for the model's
    # storage are built now (the engine's start-up) rather than in a step
    half_storage = tier.half_dtype if dtype == torch.float32 and prefer_half else dtype
    native = cpu_native.load(tier, variants_for(dtype, kv_cache_dtype or half_storage))
    if quantization is not None and (quantization != q8_0.NAME or dtype != torch.float32 or native is None
                                     or not native.has_small_linear(dtype, torch.int8)
                                     or not gemm_libraries.can_pack(dtype)):
        raise q8_0.QuantizationError(
            f"{quantization} weights need an fp32 model, the native CPU kernels and oneDNN (here: "
            f"{str(dtype).removeprefix('torch.')} model, native kernels {'built' if native else 'not built'})")
    fast_bf16 = tier.bf16_compute and gemm_libraries.can_pack(torch.bfloat16)
    storage = half_storage if native is not None else dtype
    weight_dtype = weight_dtype or storage
    kv_cache_dtype = kv_cache_dtype or storage
    ops = dataclasses.replace(REFERENCE_OPS, name=f"cpu-{_short(dtype)}-{tier.name}", cpu_tier=tier,
                              weight_dtype=weight_dtype, kv_cache_dtype=kv_cache_dtype, quantization=quantization,
                              **_ENCODER_FAST)
    if dtype == torch.bfloat16 and fast_bf16:
        ops = dataclasses.replace(ops, apply_rotary=cpu_rotary.apply_rotary, prepare_rotary=cpu_rotary.prepare_rotary)
        if native is None and kv_cache_dtype == dtype:  # no C compiler: inductor's decode attention
            ops = dataclasses.replace(ops, name=f"{ops.name}-compiled", paged_attention=cpu_attention.paged_attention,
                                      prepare_attention=cpu_attention.prepare_attention, compiles_on_first_use=True)
    elif dtype not in (torch.float32, torch.bfloat16):
        return dataclasses.replace(REFERENCE_OPS, cpu_tier=tier)
    if gemm_libraries.can_pack(dtype) and (dtype == torch.float32 or fast_bf16):
        ops = dataclasses.replace(
            ops, pack_linear=functools.partial(cpu_linear.pack_linear, native=native, weight_dtype=weight_dtype,
                                               quantization=quantization),
            pack_gate_up=functools.partial(cpu_linear.pack_gate_up, native=native, weight_dtype=weight_dtype,
                                           quantization=quantization),
            mlp_chunk_rows=cpu_linear.MLP_CHUNK_ROWS)
    if native is not None:
        ops = NativeOps(native).bind(dataclasses.replace(ops, name=f"{ops.name}-native"))
    return ops


def _short(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}.get(dtype, str(dtype).removeprefix("torch."))


def get_ops(device: torch.device | str, dtype: torch.dtype | None = None, *,
            weight_dtype: torch.dtype | None = None, kv_cache_dtype: torch.dtype | None = None,
            prefer_half: bool = False, cpu_tier=None, quantization: str | None = None) -> Ops:
    """The ops for `device` and the model's `dtype` (None: the references). CPU only: `weight_dtype`
    and `kv_cache_dtype` store the linear weights and the KV cache in another precision
    (engine/device.py validates the pairs), `prefer_half` lets an fp32 model store both in the
    tier's half-precision format where neither is given, and `cpu_tier` (a cpu_features.CpuTier
    this CPU runs; default the selected one) picks the kernels' build (the tests and benchmarks
    compare tiers on one machine); `quantization` "q8_0" quantizes the linear weights (fp32 CPU
    models only: elsewhere a q8_0.QuantizationError)."""
    device = torch.device(device)  # validates the spelling early: a bad device fails at engine start
    if quantization is not None and (device.type != "cpu" or dtype is None):
        from .q8_0 import QuantizationError
        raise QuantizationError(f"{quantization} weights run on the CPU only (device {device}, dtype {dtype})")
    if device.type == "cuda":
        from .triton_ops import cuda_ops  # the only place triton gets imported
        return cuda_ops(dataclasses.replace(REFERENCE_OPS, **_ENCODER_FAST))
    if device.type == "cpu" and dtype is not None:
        return _cpu_ops(dtype, weight_dtype, kv_cache_dtype, prefer_half, cpu_tier, quantization)
    return REFERENCE_OPS
