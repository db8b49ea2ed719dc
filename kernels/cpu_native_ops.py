"""The native C kernels as ops with the references' signatures (bound by kernels/ops.py on CPU).

    NativeOps(kernels).bind(ops) -> Ops   the ops with every native kernel of `kernels`'s tier in place

Every method here takes exactly the arguments of its reference (attention_ref, norm_ref,
activation_ref, cpu_rotary, cache_ref) and returns the same thing, computed by one C call
(kernels/csrc/*.c) for fp32 or bf16 tensors. Inputs the kernels were not built for (another dtype,
odd strides, a head size they do not take) go to the torch implementation instead, so binding
these never changes what a model may be. Test oracles: the references (tests/test_cpu_native*.py,
tests/test_cpu_features.py).

NOTE: `apply_rotary` rotates q and k in place (they are views of the fused qkv output, which
nothing else reads) and returns them; the reference returns new tensors.
"""
from __future__ import annotations

import ctypes
import dataclasses
import logging
import operator

import torch

from . import activation_ref, attention_ref, cache_ref, cpu_attention, cpu_rotary, norm_ref, torch_encoder
from .attention_metadata import AttentionMetadata
from .cpu_native import WEIGHT_FORMAT, NativeKernelError, NativeKernels
from .cpu_native_structs import VbDecode, VbLayer, VbStep
from .native_build import has_variant

logger = logging.getLogger("vbatch.kernels")
_warned: set[str] = set()

NATIVE_DTYPES = (torch.float32, torch.bfloat16)
FUSED_LAYER_MAX_ROWS = 32  # the most rows a fused layer takes: cpu_linear_small.c's MAX_ROWS; a stack
                           # takes the fewest `small_rows` of its linears (cpu_linear.PackedLinear)

# Longest sequence the native encoder attention takes (kernels/csrc/cpu_encoder_attention.c): past
# it SDPA's flash kernel, whose per-tile overhead no longer dominates, is used.
NATIVE_ENCODER_MAX_LEN = 512


def _rows(*tensors: torch.Tensor) -> bool:  # contiguous, one native dtype
    return all(t.dtype == tensors[0].dtype and t.is_contiguous() for t in tensors) and tensors[0].dtype in NATIVE_DTYPES


def _linears(layer) -> tuple:  # the decoder layer's four linears, in the order VbLayer holds them
    return layer.self_attn.qkv, layer.self_attn.o_proj, layer.mlp.gate_up, layer.mlp.down_proj


def _heads_dense(t: torch.Tensor) -> bool:  # [T, H, D] with heads and elements packed (rows may be apart)
    return t.dtype in NATIVE_DTYPES and t.dim() == 3 and t.stride(2) == 1 and t.stride(1) == t.shape[2]


class _Stack:
    """What one stack of layers keeps between forwards for the native call: its VbLayers, the
    caches' pointer arrays, scratch rows for `max_rows` tokens and the VbStep pointing
    into them (each forward rewrites the step's inputs). Kept on the stack's first layer.

    NOTE: why keep all this: each step used to rebuild it, about 60 tensor calls and six allocations
    of Python, and the step runs it with cold caches (the weights just streamed through them), where
    each torch call costs several microseconds (docs/performance/batch-1.md, session 19). One forward at a
    time per model, as for its KV cache."""

    def __init__(self, layers: ctypes.Array, first_layer, max_rows: int) -> None:
        self.layers = layers                  # the VbLayers
        attention, mlp = first_layer.self_attn, first_layer.mlp
        self.dtype = first_layer.input_layernorm.dtype
        widths = (attention.o_proj.out_features, attention.qkv.out_features, attention.q_size,
                  attention.o_proj.out_features, 2 * mlp.down_proj.in_features, mlp.down_proj.in_features)
        self.max_rows = max_rows              # the scratch rows' capacity: the tokens a call takes
        self.scratch = [torch.empty(self.max_rows, w, dtype=self.dtype) for w in widths]
        self.step = VbStep(0, None, None, None, None, 0, None, None, 0, 0, *(t.data_ptr() for t in self.scratch))
        self.kv: tuple = ()                   # the (key, value) caches the pointer arrays were made for
        self.kv_arrays: tuple | None = None   # (key pointers, value pointers, cache dtype); None: not native

    def caches(self, kv_caches) -> tuple | None:
        """(key pointers, value pointers, dtype) for these caches (the same objects as last time: kept)."""
        if len(kv_caches) != len(self.kv) or not all(map(operator.is_, kv_caches, self.kv)):
            dtype = kv_caches[0][0].dtype
            ok = (all(k.dtype == v.dtype == dtype and k.is_contiguous() and v.is_contiguous() for k, v in kv_caches)
                  and has_variant(self.dtype, dtype))
            pointers = ctypes.c_void_p * len(kv_caches)
            self.kv_arrays = (pointers(*(k.data_ptr() for k, _ in kv_caches)),
                              pointers(*(v.data_ptr() for _, v in kv_caches)), dtype) if ok else None
            self.kv = tuple(kv_caches)
        return self.kv_arrays

    def point_at(self, attn: AttentionMetadata, tables: cpu_rotary.RotaryTables, rows: int) -> tuple:
        """Points the step at this forward's inputs; returns them (the caller keeps them alive for the call)."""
        inputs = (tables[0].contiguous(), tables[1].contiguous(), attn.slot_mapping.contiguous(),
                  attn.block_tables.contiguous(), attn.query_start_loc.contiguous(), attn.seq_lens.contiguous())
        cos, sin, slots, block_tables, starts, lens = inputs
        st = self.step
        st.rows, st.cos, st.signed_sin, st.slots = rows, cos.data_ptr(), sin.data_ptr(), slots.data_ptr()
        st.block_tables, st.table_stride = block_tables.data_ptr(), block_tables.stride(0)
        st.query_start, st.seq_lens = starts.data_ptr(), lens.data_ptr()
        st.num_reqs, st.block_size = attn.num_reqs, attn.block_size
        return inputs


class NativeOps:
    """One tier's native kernels behind the references' signatures."""

    def __init__(self, kernels: NativeKernels) -> None:
        self.kernels = kernels

    def bind(self, ops):  # ops: kernels.ops.Ops -> Ops
        return dataclasses.replace(
            ops, paged_attention=self.paged_attention, prepare_attention=None, rms_norm=self.rms_norm,
            fused_add_rms_norm=self.fused_add_rms_norm, silu_and_mul=self.silu_and_mul,
            apply_rotary=self.apply_rotary, prepare_rotary=cpu_rotary.prepare_rotary,
            write_kv_cache=self.write_kv_cache, decoder_layers=self.decoder_layers,
            decode_steps=self.decode_steps, decode_steps_rows=self.decode_steps_rows,
            encoder_attention=self.encoder_attention, native=self.kernels)

    def encoder_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens, scale: float
                          ) -> torch.Tensor:  # [T, H, D] each -> [T, H, D]
        """Short sequences (<= NATIVE_ENCODER_MAX_LEN: sentence encoders) in the native kernel; longer
        ones (ViT tiles of 1,025 tokens) through SDPA's flash kernel (kernels/torch_encoder.py)."""
        if max(seq_lens) <= NATIVE_ENCODER_MAX_LEN:
            out = self.kernels.encoder_attention(q, k, v, seq_lens, scale, torch.get_num_threads())
            if out is not None:
                return out
        return torch_encoder.encoder_attention(q, k, v, seq_lens, scale)

    def paged_attention(
        self,
        query: torch.Tensor,        # [num_tokens, num_q_heads, head_dim] fp32 / bf16
        key_cache: torch.Tensor,    # [num_blocks, block_size, num_kv_heads, head_dim]: query's dtype, or half
        value_cache: torch.Tensor,  # precision under fp32 queries
        attn: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:              # [num_tokens, num_q_heads, head_dim]
        """Decode and prefill rows of the whole step in one call (kernels/csrc/cpu_paged_attention.c)."""
        if has_variant(query.dtype, key_cache.dtype) and key_cache.dtype == value_cache.dtype:
            try:
                return self.kernels.paged_attention(query, key_cache, value_cache, attn, scale, torch.get_num_threads())
            except NativeKernelError as e:
                if str(e) not in _warned:
                    _warned.add(str(e))
                    logger.warning("%s; using the torch path", e)
        if query.dtype == key_cache.dtype == torch.bfloat16:
            return cpu_attention.paged_attention(query, key_cache, value_cache,
                                                 cpu_attention.prepare_attention(attn), scale)
        return attention_ref.paged_attention(query, key_cache, value_cache, attn, scale)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if not _rows(x, weight):
            return norm_ref.rms_norm(x, weight, eps)
        return self.kernels.rms_norm(x, None, weight, eps, torch.get_num_threads())[0]

    def fused_add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        if not _rows(x, residual, weight) or x.shape != residual.shape:
            return norm_ref.fused_add_rms_norm(x, residual, weight, eps)
        out, new_residual = self.kernels.rms_norm(x, residual, weight, eps, torch.get_num_threads())
        return out, new_residual

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        if not _rows(x):
            return activation_ref.silu_and_mul(x)
        return self.kernels.silu_and_mul(x, torch.get_num_threads())

    def apply_rotary(
        self,
        positions: torch.Tensor,            # [num_tokens] (unused: the tables are per token)
        query: torch.Tensor,                # [num_tokens, num_q_heads, head_dim]
        key: torch.Tensor,                  # [num_tokens, num_kv_heads, head_dim]
        tables: cpu_rotary.RotaryTables,    # from cpu_rotary.prepare_rotary
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, signed_sin = tables
        if not (_heads_dense(query) and _heads_dense(key) and query.shape[2] % 32 == 0
                and query.dtype == key.dtype == cos.dtype == signed_sin.dtype
                and cos.is_contiguous() and signed_sin.is_contiguous()):
            return cpu_rotary.apply_rotary(positions, query, key, tables)
        self.kernels.rotary_(query, key, cos, signed_sin, torch.get_num_threads())
        return query, key

    def write_kv_cache(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                       value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        if not (_heads_dense(key) and _heads_dense(value) and key_cache.is_contiguous() and value_cache.is_contiguous()
                and key.dtype == value.dtype and key_cache.dtype == value_cache.dtype
                and has_variant(key.dtype, key_cache.dtype)
                and slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous()):
            return cache_ref.write_kv_cache(key, value, key_cache, value_cache, slot_mapping)
        self.kernels.write_kv(key, value, key_cache, value_cache, slot_mapping, torch.get_num_threads())

    # --- whole decoder layers for a few tokens (kernels/csrc/cpu_decoder_layer.c) ---------------

    def _layer_struct(self, layer):
        """The layer's VbLayer, built once and kept on the module (None: the layer is not all native).

        NOTE: it holds raw pointers to the layer's weights as they are after `finalize_weights`; the
        model never replaces them afterwards (loading happens once, before the first step)."""
        cached = getattr(layer, "_vb_native_layer", None)
        if cached is not None and cached[0] is self.kernels:
            return cached[1]
        from .cpu_linear import PackedLinear
        attention = layer.self_attn
        linears = _linears(layer)
        dtype = layer.input_layernorm.dtype
        struct = None
        s = attention.s
        if (all(isinstance(m, PackedLinear) and m.small_weight is not None and m.native is self.kernels
                for m in linears)
                and len({m.small_weight.dtype for m in linears}) == 1 and dtype in NATIVE_DTYPES
                and s.head_dim % 32 == 0):
            pointers = [layer.input_layernorm.data_ptr(), layer.post_attention_layernorm.data_ptr()]
            for m in linears:
                pointers += [m.small_weight.data_ptr(), None if m.bias is None else m.bias.data_ptr()]
            struct = VbLayer(*pointers, s.hidden_size, s.num_q_heads, s.num_kv_heads, s.head_dim, s.intermediate_size,
                             WEIGHT_FORMAT[linears[0].small_weight.dtype], layer.eps, attention.scale)
        layer._vb_native_layer = (self.kernels, struct)
        return struct

    def _stack(self, layers) -> _Stack | None:
        """The layers' native state (_Stack), built once and kept on the first layer (None: some
        layer is not all native)."""
        ids = tuple(map(id, layers))
        cached = getattr(layers[0], "_vb_native_stack", None)
        if cached is not None and cached[0] is self.kernels and cached[1] == ids:
            return cached[2]
        structs = [self._layer_struct(layer) for layer in layers]
        stack = None
        if not any(s is None for s in structs):
            rows = min(m.small_rows for layer in layers for m in _linears(layer))
            stack = _Stack((VbLayer * len(structs))(*structs), layers[0], min(rows, FUSED_LAYER_MAX_ROWS))
        layers[0]._vb_native_stack = (self.kernels, ids, stack)
        return stack

    def decoder_layers(self, layers, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                       kv_caches, attn: AttentionMetadata, rope, final_norm: tuple[torch.Tensor, float] | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """`layer(positions, hidden, residual, kv_cache, attn, rope)` for each layer in turn (with its
        own cache), then with final_norm = (weight, eps) `fused_add_rms_norm(hidden, residual, weight,
        eps)`: in one native call when the step has at most the stack's `max_rows` tokens (decode at
        small batch: the rows its linears' small-rows kernel takes, up to FUSED_LAYER_MAX_ROWS); the
        modules' own forward and the op (the ops one by one) otherwise. Same results:
        each step of the native layer is the native op."""
        rows = hidden.shape[0]
        stack = self._stack(layers) if layers and 0 < rows <= FUSED_LAYER_MAX_ROWS else None
        caches = None
        if (stack is not None and rows <= stack.max_rows and isinstance(rope, tuple) and hidden.dtype == stack.dtype
                and rope[0].dtype == hidden.dtype):
            caches = stack.caches(kv_caches)
        if caches is None:
            for layer, kv_cache in zip(layers, kv_caches, strict=True):
                hidden, residual = layer(positions, hidden, residual, kv_cache, attn, rope)
            if final_norm is not None:
                hidden, residual = self.fused_add_rms_norm(hidden, residual, *final_norm)
            return hidden, residual
        inputs = stack.point_at(attn, rope, rows)
        norm = final_norm is not None and final_norm[0].dtype == hidden.dtype and final_norm[0].is_contiguous()
        stack.step.final_norm = final_norm[0].data_ptr() if norm else None
        stack.step.final_eps = final_norm[1] if norm else 0.0
        first = residual is None
        hidden = hidden.contiguous()
        if first:
            residual = torch.empty_like(hidden)
        self.kernels.decoder_layers(stack.layers, stack.step, *caches, hidden, residual, first,
                                    torch.get_num_threads())
        del inputs
        if final_norm is not None and not norm:
            hidden, residual = self.fused_add_rms_norm(hidden, residual, *final_norm)
        return hidden, residual

    # --- several greedy decode steps in one call (kernels/csrc/cpu_decode_steps.c) --------------

    def decode_steps_rows(self, layers, head, kv_caches) -> int:
        """The most requests `decode_steps` runs for these layers, logits head and caches (0: none):
        every layer native (`decoder_layers`' one call), the head a small-rows native linear; as many
        rows as both take."""
        stack = self._stack(tuple(layers)) if layers else None
        if (stack is None or stack.caches(tuple(kv_caches)) is None or getattr(head, "native", None) is not self.kernels
                or head.small_weight is None or head.bias is not None):
            return 0
        return min(stack.max_rows, head.small_rows)

    def decode_steps(self, layers, embedding: torch.Tensor, head, final_norm: tuple[torch.Tensor, float],
                     cos_sin_cache: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches,
                     attn: AttentionMetadata, num_steps: int, stop_ids, temperature: torch.Tensor | None = None,
                     uniforms: torch.Tensor | None = None) -> torch.Tensor:
        """Up to num_steps decode steps of T requests in one native call -> [steps run, T] int64, the
        tokens each step sampled (the Ops.decode_steps contract; the caller checked decode_steps_rows).
        The same kernels as a step of the engine (the model's forward with decoder_layers and its final
        norm, the head's small-rows linear, the sampler's plain rows), so the same tokens."""
        layers, kv_caches = tuple(layers), tuple(kv_caches)
        rows = input_ids.shape[0]
        stack = self._stack(layers)
        key_pointers, value_pointers, kv_dtype = stack.caches(kv_caches)
        dtype = stack.dtype
        assert 0 < rows <= stack.max_rows and attn.num_reqs == rows
        # The rotary rows of every position the steps reach (a view of the expanded whole tables).
        low = int(positions.min())
        high = int(positions.max()) + num_steps
        tables = cpu_rotary.position_tables(cos_sin_cache, low, high, dtype)             # 2 x [high - low, 1, D]
        stops = [tuple(s) for s in stop_ids]
        width = max(map(len, stops), default=0)
        stop_table = torch.tensor([list(s) + [-1] * (width - len(s)) for s in stops] if width else [[-1]],
                                  dtype=torch.int64)                                     # [T, width]
        head_dim = layers[0].self_attn.s.head_dim
        scratch = (torch.empty(rows, head.out_features, dtype=dtype), torch.empty(2, rows, head_dim, dtype=dtype),
                   torch.empty(rows, dtype=torch.int64), torch.empty(rows, dtype=torch.int32))
        logits, rotary, slots, seq_lens = scratch
        if temperature is not None:   # random rows: each step's uniform per row, as the sampler draws them
            temperature = temperature.to(torch.float32).contiguous()
            uniforms = uniforms.to(torch.float32).contiguous()
            assert temperature.shape == (rows,) and uniforms.shape == (num_steps, rows)
        decode = VbDecode(embedding.data_ptr(), head.small_weight.data_ptr(), WEIGHT_FORMAT[head.small_weight.dtype],
                          head.out_features, tables[0].data_ptr(), tables[1].data_ptr(), low, tables[0].shape[0],
                          stop_table.data_ptr(), width, None if temperature is None else temperature.data_ptr(),
                          None if temperature is None else uniforms.data_ptr(), logits.data_ptr(),
                          rotary[0].data_ptr(), rotary[1].data_ptr(), slots.data_ptr(), seq_lens.data_ptr())
        block_tables, starts = attn.block_tables.contiguous(), attn.query_start_loc.contiguous()
        st = stack.step
        st.rows, st.block_tables, st.table_stride = rows, block_tables.data_ptr(), block_tables.stride(0)
        st.query_start, st.num_reqs, st.block_size = starts.data_ptr(), rows, attn.block_size
        st.final_norm, st.final_eps = final_norm[0].data_ptr(), final_norm[1]
        tokens = torch.empty(num_steps + 1, rows, dtype=torch.int64)                     # [steps + 1, T]
        tokens[0] = input_ids
        hidden, residual = torch.empty(2, rows, embedding.shape[1], dtype=dtype)
        done = self.kernels.decode_steps(stack.layers, st, decode, key_pointers, value_pointers, kv_dtype, tokens,
                                         positions.to(torch.int64).contiguous(), hidden, residual,
                                         torch.get_num_threads())
        del tables, scratch, block_tables, starts, temperature, uniforms
        return tokens[1:done + 1]
