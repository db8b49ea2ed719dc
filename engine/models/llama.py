"""The Llama-family decoder on the paged KV cache: Llama 2/3 (SmolLM2), Qwen2 and Mistral.

Built by the model runner from a transformers config (via `registry.get_model_class`), filled by
`load_weights` from Hugging Face parameter names, then called once per step with the flattened
batch: `forward(input_ids, positions, kv_caches, attn[, output_rows]) -> hidden`, `compute_logits(hidden)`.
Every op goes through the `Ops` chosen once at construction (`kernels.ops.get_ops`); the
attention metadata is an argument, never global state.

NOTE: q/k/v are fused into one `qkv` Linear and gate/up into one `gate_up` Linear (two GEMMs
instead of five per layer); `load_weights` writes the HF tensors into their row slices.
NOTE: parameters are created on the meta device and materialised empty: `load_weights` is strict
(every tensor must arrive), so random initialisation would be wasted start-up time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.attention_metadata import AttentionMetadata
from ...kernels.ops import Ops, build_rope_cache, get_ops
from ...kernels.rotary_ref import SUPPORTED_ROPE_TYPES, rope_type_of
from ..errors import ModelLoadError, UnsupportedModelError
from .output_rows import OutputRows
from .row_chunks import in_row_chunks
from .weights import fill_slots

KVCache = tuple[torch.Tensor, torch.Tensor]  # key_cache, value_cache: [num_blocks, block_size, Hk, D]


@dataclass(frozen=True)
class LlamaShape:
    """The numbers the layers need, read once from the HF config (whatever its version)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    tie_word_embeddings: bool


def _rope_settings(config: Any) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling dict or None) from transformers 5 `rope_parameters` or older `rope_theta`/`rope_scaling`."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    theta = params.get("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    rope_type = rope_type_of(params)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if float(params.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UnsupportedModelError("partial_rotary_factor != 1 is not supported")
    return float(theta), (dict(params) if rope_type != "default" else None)


def _check_full_attention(config: Any, max_model_len: int) -> None:
    # Qwen2 configs carry a sliding_window that only applies when use_sliding_window is set.
    window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", True) else None
    if window is not None and int(window) < max_model_len:
        raise UnsupportedModelError(
            f"sliding-window attention (sliding_window={window} < max_model_len={max_model_len}) "
            "is not supported", hint="set max_model_len to at most the sliding window")


class LlamaAttention(nn.Module):
    def __init__(self, s: LlamaShape, ops: Ops) -> None:
        super().__init__()
        self.ops, self.s = ops, s
        self.q_size, self.kv_size = s.num_q_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.qkv = nn.Linear(s.hidden_size, self.q_size + 2 * self.kv_size, bias=s.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, s.hidden_size, bias=s.o_bias)
        self.scale = s.head_dim ** -0.5

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, kv_cache: KVCache,
                attn: AttentionMetadata, rope_cache: Any, output_rows: OutputRows | None = None) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(num_tokens, self.s.num_q_heads, self.s.head_dim)   # [T, Hq, D]
        k = k.view(num_tokens, self.s.num_kv_heads, self.s.head_dim)  # [T, Hk, D]
        v = v.view(num_tokens, self.s.num_kv_heads, self.s.head_dim)  # [T, Hk, D]
        q, k = self.ops.apply_rotary(positions, q, k, rope_cache)
        key_cache, value_cache = kv_cache
        self.ops.write_kv_cache(k, v, key_cache, value_cache, attn.slot_mapping)
        if output_rows is not None:  # the last layer: every token's K/V is written, only these rows go on
            q, attn = q[output_rows.indices], output_rows.attn                 # [N, Hq, D]
        out = self.ops.paged_attention(q, key_cache, value_cache, attn, self.scale)  # [T or N, Hq, D]
        return self.o_proj(out.reshape(q.shape[0], self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, s: LlamaShape, ops: Ops) -> None:
        super().__init__()
        self.ops = ops
        self.gate_up = nn.Linear(s.hidden_size, 2 * s.intermediate_size, bias=s.mlp_bias)
        self.down_proj = nn.Linear(s.intermediate_size, s.hidden_size, bias=s.mlp_bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        return in_row_chunks(self._rows, hidden, self.ops.mlp_chunk_rows)

    def _rows(self, hidden: torch.Tensor) -> torch.Tensor:
        fused = getattr(self.gate_up, "silu_and_mul", None)  # Ops.pack_gate_up's module: one fused call
        if fused is not None:
            return self.down_proj(fused(hidden))
        return self.down_proj(self.ops.silu_and_mul(self.gate_up(hidden)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, s: LlamaShape, ops: Ops) -> None:
        super().__init__()
        self.ops, self.eps = ops, s.rms_norm_eps
        self.self_attn = LlamaAttention(s, ops)
        self.mlp = LlamaMLP(s, ops)
        self.input_layernorm = nn.Parameter(torch.empty(s.hidden_size), requires_grad=False)
        self.post_attention_layernorm = nn.Parameter(torch.empty(s.hidden_size), requires_grad=False)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, attn: AttentionMetadata,
                rope_cache: Any,  # the cache or Ops.prepare_rotary tables
                output_rows: OutputRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        # The residual stream is carried un-normalised; each norm folds in the previous add.
        if residual is None:
            residual = hidden
            hidden = self.ops.rms_norm(hidden, self.input_layernorm, self.eps)
        else:
            hidden, residual = self.ops.fused_add_rms_norm(hidden, residual, self.input_layernorm, self.eps)
        hidden = self.self_attn(positions, hidden, kv_cache, attn, rope_cache, output_rows)
        if output_rows is not None:
            residual = residual[output_rows.indices]                            # [N, hidden]
        hidden, residual = self.ops.fused_add_rms_norm(hidden, residual, self.post_attention_layernorm, self.eps)
        return self.mlp(hidden), residual


class LlamaForCausalLM(nn.Module):
    """Llama 2/3 and SmolLM2; the base of the Qwen2 and Mistral variants below."""

    qkv_bias_default = False  # Qwen2 hard-wires q/k/v biases (its config has no attention_bias)
    prunes_last_layer = True  # forward takes output_rows (models/output_rows.py)
    o_bias_follows_attention_bias = True

    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device | str,
                 max_model_len: int | None = None, ops: Ops | None = None) -> None:
        """`ops`: the op implementations the runner chose (kernels.ops.get_ops); default: the device's
        ops for `dtype` with the model's own weight storage."""
        super().__init__()
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.shape = s = self._read_shape(config, max_model_len)
        _check_full_attention(config, max_model_len or s.max_position)
        self.num_layers, self.num_kv_heads, self.head_dim = s.num_layers, s.num_kv_heads, s.head_dim
        self.ops = ops if ops is not None else get_ops(self.device, dtype)
        with torch.device("meta"):
            self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size, dtype=dtype)
            self.layers = nn.ModuleList(LlamaDecoderLayer(s, self.ops) for _ in range(s.num_layers))
            self.norm = nn.Parameter(torch.empty(s.hidden_size), requires_grad=False)
            self.lm_head = None if s.tie_word_embeddings else nn.Linear(s.hidden_size, s.vocab_size, bias=False)
        self.logits_head: nn.Module | None = None  # set by finalize_weights when the ops repack the head
        self.to_empty(device=self.device)
        self.to(dtype)
        self.requires_grad_(False)
        self.register_buffer(
            "rope_cache", build_rope_cache(s.head_dim, s.max_position, s.rope_theta, s.rope_scaling)
            .to(self.device), persistent=False)  # [max_position, head_dim] fp32

    def _read_shape(self, config: Any, max_model_len: int | None) -> LlamaShape:
        if getattr(config, "hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {config.hidden_act!r} is not supported (only silu)")
        theta, scaling = _rope_settings(config)
        num_q_heads = int(config.num_attention_heads)
        attention_bias = bool(getattr(config, "attention_bias", False))
        return LlamaShape(
            vocab_size=int(config.vocab_size), hidden_size=int(config.hidden_size),
            intermediate_size=int(config.intermediate_size), num_layers=int(config.num_hidden_layers),
            num_q_heads=num_q_heads,
            num_kv_heads=int(getattr(config, "num_key_value_heads", None) or num_q_heads),
            head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // num_q_heads),
            rms_norm_eps=float(config.rms_norm_eps), rope_theta=theta, rope_scaling=scaling,
            max_position=int(max_model_len or config.max_position_embeddings),
            qkv_bias=attention_bias or self.qkv_bias_default,
            o_bias=attention_bias and self.o_bias_follows_attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)))

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """Shape of one layer's key cache (and, separately, its value cache)."""
        return (num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn: AttentionMetadata, output_rows: OutputRows | None = None) -> torch.Tensor:
        """[T] token ids -> [T, hidden]; with `output_rows`, [N, hidden] for those rows only (their last
        layer skips the other rows after the KV write: models/output_rows.py)."""
        hidden = self.embed_tokens(input_ids)  # [T, hidden]
        residual = None
        # Ops with a per-step rotary table (CPU) gather cos/sin once here, not in every layer.
        rope = (self.rope_cache if self.ops.prepare_rotary is None
                else self.ops.prepare_rotary(positions, self.rope_cache, self.dtype))
        if self.ops.prepare_attention is not None:  # CPU bf16: decode slot table once per step
            attn = self.ops.prepare_attention(attn)
            if output_rows is not None:
                output_rows = OutputRows(output_rows.indices, self.ops.prepare_attention(output_rows.attn))
        layers, kv_caches = tuple(self.layers), tuple(kv_caches)
        # The last layer runs alone when it skips rows (output_rows); the others, one by one or, with
        # CPU native ops at small batch, all in one call.
        upto = len(layers) - 1 if output_rows is not None else len(layers)
        final_norm = (self.norm, self.shape.rms_norm_eps)
        if self.ops.decoder_layers is not None:  # with the final norm too when it ends the stack
            hidden, residual = self.ops.decoder_layers(layers[:upto], positions, hidden, residual, kv_caches[:upto],
                                                       attn, rope, final_norm if output_rows is None else None)
            if output_rows is None:
                return hidden  # [T, hidden]
        else:
            for layer, kv_cache in zip(layers[:upto], kv_caches[:upto], strict=True):
                hidden, residual = layer(positions, hidden, residual, kv_cache, attn, rope)
        if output_rows is not None:
            hidden, residual = layers[-1](positions, hidden, residual, kv_caches[-1], attn, rope, output_rows)
        hidden, _ = self.ops.fused_add_rms_norm(hidden, residual, *final_norm)
        return hidden  # [T or N, hidden]

    def decode_steps_rows(self, kv_caches: list[KVCache]) -> int:
        """The most requests `decode_steps` takes with these caches (0: the ops cannot run it here)."""
        if self.ops.decode_steps_rows is None or self.logits_head is None or self.norm.dtype != self.dtype:
            return 0
        return self.ops.decode_steps_rows(tuple(self.layers), self.logits_head, tuple(kv_caches))

    def decode_steps(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                     attn: AttentionMetadata, num_steps: int, stop_ids, temperature: torch.Tensor | None = None,
                     uniforms: torch.Tensor | None = None) -> torch.Tensor:
        """Up to `num_steps` decode steps of T requests in one call of the ops: [T] tokens at
        `positions` -> [steps run, T], what each step sampled from compute_logits(forward(...)) as the
        sampler's plain rows do (temperature [T], 0: argmax, at uniforms [num_steps, T]; None: all
        greedy), each step feeding the previous one's tokens. It ends with the first step in which a
        request sampled one of its `stop_ids` (T sequences of token ids). `attn`: the first step's; the block
        tables must hold every slot the steps write. Only when decode_steps_rows(kv_caches) >= T."""
        return self.ops.decode_steps(tuple(self.layers), self.embed_tokens.weight, self.logits_head,
                                     (self.norm, self.shape.rms_norm_eps), self.rope_cache, input_ids, positions,
                                     tuple(kv_caches), attn, num_steps, stop_ids, temperature, uniforms)

    def compute_logits(self, hidden: torch.Tensor, keep_dtype: bool = False) -> torch.Tensor:
        """[N, hidden] -> [N, vocab], fp32 (keep_dtype: the model's dtype, for a sampler that reads it)."""
        if self.logits_head is not None:
            logits = self.logits_head(hidden)
        else:
            weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
            logits = F.linear(hidden, weight)
        return logits if keep_dtype else logits.float()

    @torch.no_grad()
    def finalize_weights(self) -> None:
        """After load_weights: let the ops repack every Linear (CPU: oneDNN blocked layouts, and the
        weights in the ops' storage dtype for the small-rows kernels).

        The tied head gets its own packed copy of the embedding (the lookup needs the plain one):
        26 MB more in bf16, for a 3x faster logits GEMM at batch 64 here. With half-precision weight
        storage (an fp32 model on an AVX2 CPU) the head computes with the rounded embedding, the
        lookup keeps the exact one."""
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv, attn.o_proj = self.ops.pack_linear(attn.qkv), self.ops.pack_linear(attn.o_proj)
            mlp.gate_up = (self.ops.pack_gate_up or self.ops.pack_linear)(mlp.gate_up)
            mlp.down_proj = self.ops.pack_linear(mlp.down_proj)
        head = self.lm_head
        if head is None:
            with torch.device("meta"):
                head = nn.Linear(self.shape.hidden_size, self.shape.vocab_size, bias=False)
            head.weight = nn.Parameter(self.embed_tokens.weight, requires_grad=False)
        packed = self.ops.pack_linear(head)
        self.logits_head = None if isinstance(packed, nn.Linear) else packed

    # ------------------------------------------------------------------ weights
    def _weight_slots(self) -> dict[str, tuple[torch.Tensor, int, int]]:
        """HF name -> (our tensor, first row, end row) it fills."""
        s, slots = self.shape, {}
        q, kv, inter = s.num_q_heads * s.head_dim, s.num_kv_heads * s.head_dim, s.intermediate_size
        slots["model.embed_tokens.weight"] = (self.embed_tokens.weight, 0, s.vocab_size)
        slots["model.norm.weight"] = (self.norm, 0, s.hidden_size)
        if self.lm_head is not None:
            slots["lm_head.weight"] = (self.lm_head.weight, 0, s.vocab_size)
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = layer.self_attn, layer.mlp
            for kind in ("weight", "bias") if s.qkv_bias else ("weight",):
                fused = getattr(attn.qkv, kind)
                slots[p + f"self_attn.q_proj.{kind}"] = (fused, 0, q)
                slots[p + f"self_attn.k_proj.{kind}"] = (fused, q, q + kv)
                slots[p + f"self_attn.v_proj.{kind}"] = (fused, q + kv, q + 2 * kv)
            for kind in ("weight", "bias") if s.o_bias else ("weight",):
                slots[p + f"self_attn.o_proj.{kind}"] = (getattr(attn.o_proj, kind), 0, s.hidden_size)
            for kind in ("weight", "bias") if s.mlp_bias else ("weight",):
                slots[p + f"mlp.gate_proj.{kind}"] = (getattr(mlp.gate_up, kind), 0, inter)
                slots[p + f"mlp.up_proj.{kind}"] = (getattr(mlp.gate_up, kind), inter, 2 * inter)
                slots[p + f"mlp.down_proj.{kind}"] = (getattr(mlp.down_proj, kind), 0, s.hidden_size)
            slots[p + "input_layernorm.weight"] = (layer.input_layernorm, 0, s.hidden_size)
            slots[p + "post_attention_layernorm.weight"] = (layer.post_attention_layernorm, 0, s.hidden_size)
        return slots

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (cast to the model dtype); every expected one must arrive exactly once."""
        def ignore(name: str) -> bool:
            # rotary_emb.inv_freq: a derived buffer some checkpoints carry (ours is rebuilt from the config);
            # lm_head.weight on a tied model: the head is the embedding (some exports store the alias anyway).
            return name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.lm_head is None)
        fill_slots(weights, self._weight_slots(), ignore)


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen2 / Qwen2.5: biases on q/k/v (not on o_proj), lm_head untied unless the config ties it."""

    qkv_bias_default = True
    o_bias_follows_attention_bias = False


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: the Llama layout with GQA; only configs without an effective sliding window."""
