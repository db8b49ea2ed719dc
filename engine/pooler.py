"""Pooler: a step's hidden states -> one result tensor per pooling request, by its task.

Called by the pooling runner after the model's forward. Sequences lie packed in `hidden` [T, H]
(engine/encoder_inputs.py). Per task (engine/pooling_params.py):
    embed           the sequence's vector by the model's pooling (MEAN over its tokens, its CLS =
                    first token, or its LAST token), first `dimensions` values, L2-normalised
    token_embed     every token's vector, likewise truncated and normalised row by row
    classify/score  the model's classifier on its classification pooling (BERT: CLS), then softmax
                    (sigmoid for one label) unless use_activation is off; score is the one number
Results are fp32 CPU tensors, whatever the model's dtype and device.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from .models.pooling_config import PoolerConfig, PoolingType
from .pooling_params import PoolingParams


def pool_sequences(hidden: torch.Tensor, seq_lens: Sequence[int], pooling_type: PoolingType) -> torch.Tensor:
    """[T, H] packed sequences -> [B, H] fp32, one row per sequence."""
    lens = torch.tensor(seq_lens, dtype=torch.long, device=hidden.device)          # [B]
    starts = torch.cumsum(lens, 0) - lens                                           # [B]
    if pooling_type == "CLS":
        return hidden[starts].float()
    if pooling_type == "LAST":
        return hidden[starts + lens - 1].float()
    if pooling_type == "MEAN":
        seg = torch.repeat_interleave(torch.arange(len(seq_lens), device=hidden.device), lens)   # [T]
        sums = torch.zeros(len(seq_lens), hidden.shape[1], dtype=torch.float32, device=hidden.device)
        sums.index_add_(0, seg, hidden.float())
        return sums / lens[:, None].to(torch.float32)
    raise ValueError(f"pooling type {pooling_type!r} has one row per token, not per sequence")


def _activation(logits: torch.Tensor) -> torch.Tensor:  # [..., L]
    return torch.sigmoid(logits) if logits.shape[-1] == 1 else torch.softmax(logits, dim=-1)


class Pooler:
    def __init__(self, config: PoolerConfig, classify: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 classify_pooling_type: PoolingType = "CLS") -> None:
        self.config = config
        self.classify = classify
        self.classify_pooling_type = classify_pooling_type

    def __call__(self, hidden: torch.Tensor, seq_lens: Sequence[int],
                 params: Sequence[PoolingParams]) -> list[torch.Tensor]:
        tasks = [p.task for p in params]
        starts = [0]
        for n in seq_lens:
            starts.append(starts[-1] + n)
        embedded = pool_sequences(hidden, seq_lens, self.config.pooling_type) if "embed" in tasks else None
        logits = None
        if "classify" in tasks or "score" in tasks:
            assert self.classify is not None, "the model has no classifier (supported_tasks said so)"
            rows = pool_sequences(hidden, seq_lens, self.classify_pooling_type).to(hidden.dtype)
            logits = self.classify(rows).float()                                        # [B, L]
        out: list[torch.Tensor] = []
        for i, p in enumerate(params):
            if p.task == "embed":
                out.append(_embed(embedded[i], p))
            elif p.task == "token_embed":
                out.append(_embed(hidden[starts[i]:starts[i + 1]].float(), p))
            elif p.task in ("classify", "score"):
                row = logits[i]
                row = _activation(row) if p.use_activation else row
                out.append(row.reshape(()) if p.task == "score" else row)
            else:
                raise ValueError(f"task {p.task!r} has no pooler here")
        return [t.cpu() for t in out]


def _embed(vectors: torch.Tensor, p: PoolingParams) -> torch.Tensor:  # [H] or [n, H] fp32
    if p.dimensions is not None:
        vectors = vectors[..., :p.dimensions]
    if p.normalize:
        vectors = F.normalize(vectors, p=2, dim=-1)
    return vectors
