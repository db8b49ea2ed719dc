"""OutputRows: the token rows of a step whose final hidden state is used (the rows that get logits).

Built by engine/inputs.py when every such row is the last token of its request (no prompt
logprobs asked for, no pooling request in the step) and they are fewer than the step's tokens, as
in every step that carries prompt chunks. The model's last decoder layer then computes q/k/v,
rotary and the KV-cache write for every token (later steps attend to them) but attention, o_proj,
the MLP and the final norm only for these rows: nothing reads the other rows' output of the last
layer. For SmolLM2's prompt tokens that is 2.8% of the linear-layer work (o_proj + MLP of one of 30
layers) and 1/30 of the attention.
llama.cpp prunes its last layer the same way. The kept rows get the same ops as unpruned; only
the GEMMs' and attention's row counts change, which may move a value by bf16 rounding, as any
change of batch composition does.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...kernels.attention_metadata import AttentionMetadata


@dataclass(frozen=True)
class OutputRows:
    indices: torch.Tensor      # [N] int64: the kept token rows, in logits order, one per request, its last
    attn: AttentionMetadata    # decode-shaped metadata of those N rows: one query each, the step's seq_lens
