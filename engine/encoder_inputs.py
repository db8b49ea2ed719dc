"""EncoderBatch: one step of an encoder-only (pooling) model, packed; and how a step becomes one.

Called by the pooling runner (engine/pooling_runner.py). The step's sequences lie one after
another in the token dimension, as the decoder path lays them (no padding rows): BERT's
embeddings and every GEMM see exactly the real tokens; attention keeps them apart by `seq_lens`.
An encoder request is never chunked, so each scheduled request brings all its tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .scheduler_output import SchedulerOutput


@dataclass(frozen=True)
class EncoderBatch:
    input_ids: torch.Tensor                 # [T] int64
    positions: torch.Tensor                 # [T] int64: 0..n-1 within each sequence
    token_type_ids: torch.Tensor | None     # [T] int64; None: every token is segment 0
    seq_lens: tuple[int, ...]               # tokens per sequence, in scheduled order; sum == T

    @property
    def seq_starts(self) -> tuple[int, ...]:
        starts, total = [], 0
        for n in self.seq_lens:
            starts.append(total)
            total += n
        return tuple(starts)


def prepare_encoder_batch(sched: SchedulerOutput, device: torch.device) -> EncoderBatch:
    requests = [s.request for s in sched.scheduled]
    for s in sched.scheduled:
        assert s.num_new_tokens == s.request.num_prompt_tokens and s.request.num_computed_tokens == 0, \
            "an encoder request runs whole in one step"
    seq_lens = tuple(r.num_prompt_tokens for r in requests)
    input_ids = np.fromiter((t for r in requests for t in r.prompt_token_ids), dtype=np.int64, count=sum(seq_lens))
    positions = np.concatenate([np.arange(n, dtype=np.int64) for n in seq_lens]) if seq_lens else np.zeros(0, np.int64)
    token_types = None
    if any(r.model_inputs.get("token_type_ids") is not None for r in requests):
        token_types = np.zeros(len(input_ids), dtype=np.int64)
        start = 0
        for r, n in zip(requests, seq_lens):
            types = r.model_inputs.get("token_type_ids")
            if types is not None:
                token_types[start:start + n] = types
            start += n
    return EncoderBatch(
        input_ids=torch.from_numpy(input_ids).to(device),
        positions=torch.from_numpy(positions).to(device),
        token_type_ids=None if token_types is None else torch.from_numpy(token_types).to(device),
        seq_lens=seq_lens)
