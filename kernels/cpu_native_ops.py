"""The native C kernels as ops with the references' signatures (bound by kernels/ops.py for CPU bf16).

Every function here takes exactly the arguments of its reference (attention_ref, norm_ref,
activation_ref, cpu_rotary, cache_ref) and returns the same thing, computed by one C call
(kernels/csrc/*.c). Inputs the kernels were not built for (another dtype, odd strides, a head
size they do not take) go to the torch implementation instead, so binding these never changes
what a model may be. Test oracles: the references (tests/test_cpu_native.py).

NOTE: `apply_rotary` rotates q and k in place (they are views of the fused qkv output, which
nothing else reads) and returns them; the reference returns new tensors.
"""
from __future__ import annotations

import logging
import threading

import torch

from . import activation_ref, cache_ref, cpu_attention, cpu_rotary, norm_ref
from .attention_metadata import AttentionMetadata
from .cpu_native import NativeKernelError, NativeKernels, load

logger = logging.getLogger("vbatch.kernels")
_warned: set[str] = set()


def _kernels() -> NativeKernels:
    kernels = load()
    assert kernels is not None, "cpu_native_ops is bound only after cpu_native.load() succeeded"
    return kernels


def _bf16_rows(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.bfloat16 and t.is_contiguous() for t in tensors)


def _heads_dense(t: torch.Tensor) -> bool:  # [T, H, D] with heads and elements packed (rows may be apart)
    return t.dtype == torch.bfloat16 and t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


def paged_attention(
    query: torch.Tensor,        # [num_tokens, num_q_heads, head_dim] bf16
    key_cache: torch.Tensor,    # [num_blocks, block_size, num_kv_heads, head_dim] bf16
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] bf16
    attn: AttentionMetadata,
    scale: float,
) -> torch.Tensor:              # [num_tokens, num_q_heads, head_dim] bf16
    """Decode and prefill rows of the whole step in one call (kernels/csrc/cpu_paged_attention.c)."""
    try:
        return _kernels().paged_attention_bf16(query, key_cache, value_cache, attn, scale, torch.get_num_threads())
    except NativeKernelError as e:
        if str(e) not in _warned:
            _warned.add(str(e))
            logger.warning("%s; using the compiled torch path", e)
    return cpu_attention.paged_attention(query, key_cache, value_cache, cpu_attention.prepare_attention(attn), scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _bf16_rows(x, weight):
        return norm_ref.rms_norm(x, weight, eps)
    return _kernels().rms_norm_bf16(x, None, weight, eps, torch.get_num_threads())[0]


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not _bf16_rows(x, residual, weight) or x.shape != residual.shape:
        return norm_ref.fused_add_rms_norm(x, residual, weight, eps)
    out, new_residual = _kernels().rms_norm_bf16(x, residual, weight, eps, torch.get_num_threads())
    return out, new_residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if not _bf16_rows(x):
        return activation_ref.silu_and_mul(x)
    return _kernels().silu_and_mul_bf16(x, torch.get_num_threads())


def apply_rotary(
    positions: torch.Tensor,            # [num_tokens] (unused: the tables are per token)
    query: torch.Tensor,                # [num_tokens, num_q_heads, head_dim]
    key: torch.Tensor,                  # [num_tokens, num_kv_heads, head_dim]
    tables: cpu_rotary.RotaryTables,    # from cpu_rotary.prepare_rotary
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, signed_sin = tables
    if not (_heads_dense(query) and _heads_dense(key) and query.shape[2] % 32 == 0
            and cos.dtype == torch.bfloat16 and cos.is_contiguous() and signed_sin.is_contiguous()):
        return cpu_rotary.apply_rotary(positions, query, key, tables)
    _kernels().rotary_bf16_(query, key, cos, signed_sin, torch.get_num_threads())
    return query, key


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    if not (_heads_dense(key) and _heads_dense(value) and _bf16_rows(key_cache, value_cache)
            and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()):
        return cache_ref.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
    _kernels().write_kv_bf16(key, value, key_cache, value_cache, slot_mapping)


# --- a whole decoder layer for a few tokens (kernels/csrc/cpu_decoder_layer.c) ------------------

FUSED_LAYER_MAX_ROWS = 4  # the small-rows linear's range (cpu_linear.PackedLinear.SMALL_ROWS)


class _Step:
    """The VbStep of one forward (shared by its layers) and the scratch rows it points into."""

    def __init__(self, attn: AttentionMetadata, tables: cpu_rotary.RotaryTables, rows: int, layer) -> None:
        from .cpu_native import VbStep
        attention, mlp = layer.self_attn, layer.mlp
        hidden, q = attention.o_proj.out_features, attention.q_size
        qkv, inter = attention.qkv.out_features, mlp.down_proj.in_features
        self.attn, self.tables = attn, tables  # keeps the pointed-to tensors alive, and the identity check
        self.scratch = [torch.empty(rows, width, dtype=torch.bfloat16)
                        for width in (hidden, qkv, q, hidden, 2 * inter, inter)]
        self.inputs = (tables[0].contiguous(), tables[1].contiguous(), attn.slot_mapping.contiguous(),
                       attn.block_tables.contiguous(), attn.query_start_loc.contiguous(), attn.seq_lens.contiguous())
        cos, sin, slots, tables_, starts, lens = self.inputs
        self.struct = VbStep(rows, cos.data_ptr(), sin.data_ptr(), slots.data_ptr(), tables_.data_ptr(),
                             tables_.stride(0), starts.data_ptr(), lens.data_ptr(), attn.num_reqs, attn.block_size,
                             *(t.data_ptr() for t in self.scratch))


# The current forward's step, per thread (two engines may run in two threads of one process).
_steps = threading.local()


def _layer_struct(layer):
    """The layer's VbLayer, built once and kept on the module (None: the layer is not all native).

    NOTE: it holds raw pointers to the layer's weights as they are after `finalize_weights`; the
    model never replaces them afterwards (loading happens once, before the first step)."""
    cached = getattr(layer, "_vb_native_layer", False)
    if cached is not False:
        return cached
    from .cpu_linear import PackedLinear
    from .cpu_native import VbLayer
    attention, mlp = layer.self_attn, layer.mlp
    linears = (attention.qkv, attention.o_proj, mlp.gate_up, mlp.down_proj)
    struct = None
    s = attention.s
    if (all(isinstance(m, PackedLinear) and m.weight is not None for m in linears)
            and layer.input_layernorm.dtype == torch.bfloat16 and s.head_dim % 32 == 0 and _kernels().has_small_linear):
        pointers = [layer.input_layernorm.data_ptr(), layer.post_attention_layernorm.data_ptr()]
        for m in linears:
            pointers += [m.weight.data_ptr(), None if m.bias is None else m.bias.data_ptr()]
        struct = VbLayer(*pointers, s.hidden_size, s.num_q_heads, s.num_kv_heads, s.head_dim, s.intermediate_size,
                         layer.eps, attention.scale)
    layer._vb_native_layer = struct
    return struct


def decoder_layer(layer, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                  kv_cache, attn: AttentionMetadata, rope) -> tuple[torch.Tensor, torch.Tensor]:
    """`layer(positions, hidden, residual, kv_cache, attn, rope)`, in one native call when the step
    has at most FUSED_LAYER_MAX_ROWS tokens (decode at small batch); the module's own forward
    (the ops one by one) otherwise. Same results: each step of the native layer is the native op."""
    rows = hidden.shape[0]
    struct = _layer_struct(layer) if 0 < rows <= FUSED_LAYER_MAX_ROWS else None
    key_cache, value_cache = kv_cache
    if (struct is None or not isinstance(rope, tuple) or hidden.dtype != torch.bfloat16
            or not (key_cache.is_contiguous() and value_cache.is_contiguous())):
        return layer(positions, hidden, residual, kv_cache, attn, rope)
    step = getattr(_steps, "current", None)
    if step is None or step.attn is not attn or step.tables is not rope:
        step = _steps.current = _Step(attn, rope, rows, layer)
    first = residual is None
    hidden = hidden.contiguous()
    if first:
        residual = torch.empty_like(hidden)
    _kernels().decoder_layer_bf16(struct, step.struct, key_cache, value_cache, hidden, residual, first,
                                  torch.get_num_threads())
    return hidden, residual
