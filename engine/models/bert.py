"""BERT-family encoders for pooling: sentence embeddings (all-MiniLM-L6-v2) and cross-encoder classifiers.

Built by the pooling runner (engine/pooling_runner.py) from a transformers config via the registry,
filled by `load_weights` from Hugging Face parameter names (strict: every tensor exactly once), then
called once per step on the packed batch: `forward(batch: EncoderBatch) -> hidden [T, H]`. No KV
cache: an encoder sees each prompt whole, once. Every op goes through the `Ops` chosen at start-up
(LayerNorm, GELU and bidirectional attention within each sequence: kernels/ops.py).

Layer (post-norm, as BERT was trained):
    h = LayerNorm(h + Wo · attention(Wqkv · h))
    h = LayerNorm(h + W2 · gelu(W1 · h))

NOTE: q/k/v are fused into one `qkv` Linear (one GEMM instead of three); `load_weights` writes
HF's query/key/value tensors into its row slices.
NOTE: the GEMMs run on the packed tokens of every sequence in the step (no padding rows);
only attention groups sequences by length (kernels/torch_encoder.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import torch
from torch import nn

from ...kernels.ops import Ops, get_ops
from ..errors import UnsupportedModelError
from ..encoder_inputs import EncoderBatch
from .norm_params import NormParams as _Norm
from .weights import WeightSlots, fill_slots

_ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}


@dataclass(frozen=True)
class BertShape:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    layer_norm_eps: float
    max_position: int
    type_vocab_size: int
    gelu_approximate: str


def _read_shape(config: Any) -> BertShape:
    act = getattr(config, "hidden_act", "gelu")
    if act not in _ACTIVATIONS:
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported (supported: {', '.join(_ACTIVATIONS)})")
    if getattr(config, "position_embedding_type", "absolute") != "absolute":
        raise UnsupportedModelError(f"position_embedding_type {config.position_embedding_type!r} is not "
                                    "supported (only absolute)")
    heads = int(config.num_attention_heads)
    return BertShape(vocab_size=int(config.vocab_size), hidden_size=int(config.hidden_size),
                     intermediate_size=int(config.intermediate_size), num_layers=int(config.num_hidden_layers),
                     num_heads=heads, head_dim=int(config.hidden_size) // heads,
                     layer_norm_eps=float(config.layer_norm_eps), max_position=int(config.max_position_embeddings),
                     type_vocab_size=int(getattr(config, "type_vocab_size", 2) or 1),
                     gelu_approximate=_ACTIVATIONS[act])


class BertLayer(nn.Module):
    def __init__(self, s: BertShape, ops: Ops) -> None:
        super().__init__()
        self.s, self.ops = s, ops
        self.qkv = nn.Linear(s.hidden_size, 3 * s.hidden_size)
        self.attn_out = nn.Linear(s.hidden_size, s.hidden_size)
        self.attn_norm = _Norm(s.hidden_size)
        self.fc1 = nn.Linear(s.hidden_size, s.intermediate_size)
        self.fc2 = nn.Linear(s.intermediate_size, s.hidden_size)
        self.out_norm = _Norm(s.hidden_size)
        self.scale = s.head_dim ** -0.5

    def forward(self, hidden: torch.Tensor, seq_lens: tuple[int, ...]) -> torch.Tensor:  # [T, H] -> [T, H]
        s, ops = self.s, self.ops
        t = hidden.shape[0]
        qkv = self.qkv(hidden).view(t, 3, s.num_heads, s.head_dim)                      # [T, 3, heads, D]
        attn = ops.encoder_attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], seq_lens, self.scale)  # [T, heads, D]
        hidden = ops.add_layer_norm(self.attn_out(attn.reshape(t, s.hidden_size)), hidden,
                                    self.attn_norm.weight, self.attn_norm.bias, s.layer_norm_eps)
        fused = getattr(self.fc1, "linear_gelu", None)   # CPU: GELU inside fc1's GEMM (kernels/cpu_linear.py)
        inner = (fused(hidden, s.gelu_approximate) if fused is not None
                 else ops.gelu(self.fc1(hidden), s.gelu_approximate))                      # [T, intermediate]
        return ops.add_layer_norm(self.fc2(inner), hidden, self.out_norm.weight, self.out_norm.bias,
                                  s.layer_norm_eps)


class BertModel(nn.Module):
    """The encoder; as a pooling model it embeds (the folder's pooling, else CLS) and embeds tokens."""

    needs_kv_cache = False
    # dtype auto computes in fp32 on every CPU: embeddings are compared with fp32 references
    # (transformers within 1e-5 cosine); bf16 is an explicit --dtype bfloat16.
    exact_on_cpu = True
    default_pooling_type = "CLS"
    hf_prefix = ""              # where the encoder's tensors live in the checkpoint ("bert." under a head)

    def __init__(self, config: Any, dtype: torch.dtype, device: torch.device | str,
                 max_model_len: int | None = None, ops: Ops | None = None) -> None:
        super().__init__()
        self.config, self.dtype, self.device = config, dtype, torch.device(device)
        self.shape = s = _read_shape(config)
        self.ops = ops if ops is not None else get_ops(self.device, dtype)
        with torch.device("meta"):
            self.word_embeddings = nn.Embedding(s.vocab_size, s.hidden_size)
            self.position_embeddings = nn.Embedding(s.max_position, s.hidden_size)
            self.token_type_embeddings = nn.Embedding(s.type_vocab_size, s.hidden_size)
            self.embed_norm = _Norm(s.hidden_size)
            self.layers = nn.ModuleList(BertLayer(s, self.ops) for _ in range(s.num_layers))
            self._build_head(config)
        self.to_empty(device=self.device)
        self.to(dtype)
        self.requires_grad_(False)

    # ------------------------------------------------------------------ what the model offers
    @property
    def hidden_size(self) -> int:
        return self.shape.hidden_size

    def supported_tasks(self) -> tuple[str, ...]:
        return ("embed", "token_embed")

    def _build_head(self, config: Any) -> None:
        """Heads on top of the encoder (none for the plain encoder)."""

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        raise UnsupportedModelError(f"{type(self).__name__} has no classification head")

    # ------------------------------------------------------------------ forward
    def forward(self, batch: EncoderBatch) -> torch.Tensor:
        """The step's packed sequences -> their last hidden states [T, H]."""
        s = self.shape
        hidden = self.word_embeddings(batch.input_ids) + self.position_embeddings(batch.positions)  # [T, H]
        if batch.token_type_ids is None:
            hidden += self.token_type_embeddings.weight[0]
        else:
            hidden += self.token_type_embeddings(batch.token_type_ids)
        hidden = self.ops.layer_norm(hidden, self.embed_norm.weight, self.embed_norm.bias, s.layer_norm_eps)
        for layer in self.layers:
            hidden = layer(hidden, batch.seq_lens)
        return hidden

    # ------------------------------------------------------------------ weights
    def _weight_slots(self) -> WeightSlots:
        s, p, h = self.shape, self.hf_prefix, self.shape.hidden_size
        slots: WeightSlots = {
            p + "embeddings.word_embeddings.weight": (self.word_embeddings.weight, 0, s.vocab_size),
            p + "embeddings.position_embeddings.weight": (self.position_embeddings.weight, 0, s.max_position),
            p + "embeddings.token_type_embeddings.weight": (self.token_type_embeddings.weight, 0, s.type_vocab_size),
            p + "embeddings.LayerNorm.weight": (self.embed_norm.weight, 0, h),
            p + "embeddings.LayerNorm.bias": (self.embed_norm.bias, 0, h),
        }
        for i, layer in enumerate(self.layers):
            q = f"{p}encoder.layer.{i}."
            for kind in ("weight", "bias"):
                fused = getattr(layer.qkv, kind)
                slots[q + f"attention.self.query.{kind}"] = (fused, 0, h)
                slots[q + f"attention.self.key.{kind}"] = (fused, h, 2 * h)
                slots[q + f"attention.self.value.{kind}"] = (fused, 2 * h, 3 * h)
                slots[q + f"attention.output.dense.{kind}"] = (getattr(layer.attn_out, kind), 0, h)
                slots[q + f"attention.output.LayerNorm.{kind}"] = (getattr(layer.attn_norm, kind), 0, h)
                slots[q + f"intermediate.dense.{kind}"] = (getattr(layer.fc1, kind), 0, s.intermediate_size)
                slots[q + f"output.dense.{kind}"] = (getattr(layer.fc2, kind), 0, h)
                slots[q + f"output.LayerNorm.{kind}"] = (getattr(layer.out_norm, kind), 0, h)
        return slots

    def _ignored(self, name: str) -> bool:
        # position_ids: a derived buffer; pooler.*: BERT's next-sentence pooler and cls.*: the
        # pre-training heads (a BertForMaskedLM/BertForPreTraining export), unused for embeddings.
        return name.endswith("embeddings.position_ids") or name.startswith(("pooler.", "cls."))

    def _named(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The plain encoder also loads exports of a head model (`bert.`-prefixed names)."""
        for name, tensor in weights:
            yield (name.removeprefix("bert.") if not self.hf_prefix else name), tensor

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        fill_slots(self._named(weights), self._weight_slots(), self._ignored)

    @torch.no_grad()
    def finalize_weights(self) -> None:
        """After load_weights: let the ops repack every Linear (CPU: oneDNN's prepacked GEMMs)."""
        for layer in self.layers:
            for name in ("qkv", "attn_out", "fc1", "fc2"):
                setattr(layer, name, self.ops.pack_linear(getattr(layer, name)))


class BertForSequenceClassification(BertModel):
    """A BERT cross-encoder / classifier: CLS -> dense + tanh (BERT's pooler) -> classifier."""

    default_pooling_type = "CLS"
    hf_prefix = "bert."

    def _build_head(self, config: Any) -> None:
        h = self.shape.hidden_size
        self.num_labels = int(getattr(config, "num_labels", None) or len(getattr(config, "id2label", {}) or {}) or 2)
        self.pooler_dense = nn.Linear(h, h)
        self.classifier = nn.Linear(h, self.num_labels)

    def supported_tasks(self) -> tuple[str, ...]:
        tasks = ("classify", "embed", "token_embed")
        return tasks + (("score",) if self.num_labels == 1 else ())

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:  # [N, H] (CLS rows) -> [N, num_labels] logits
        return self.classifier(torch.tanh(self.pooler_dense(pooled)))

    def _weight_slots(self) -> WeightSlots:
        slots = super()._weight_slots()
        h = self.shape.hidden_size
        for kind in ("weight", "bias"):
            slots[f"bert.pooler.dense.{kind}"] = (getattr(self.pooler_dense, kind), 0, h)
            slots[f"classifier.{kind}"] = (getattr(self.classifier, kind), 0, self.num_labels)
        return slots

    def _ignored(self, name: str) -> bool:
        return name.endswith("embeddings.position_ids")

    def _named(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        return weights
