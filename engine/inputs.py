"""Flatten one SchedulerOutput into the tensors a forward pass takes (a pure function).

Called by the ModelRunner each step. Requests are laid one after another in the token
dimension (see kernels/attention_metadata.py). Besides the model inputs it says which hidden
rows need logits: the last row of every request that samples this step, and every row of a
prompt chunk whose request asked for prompt logprobs.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..kernels.attention_metadata import AttentionMetadata

from .models.output_rows import OutputRows
from .scheduler_output import ScheduledRequest, SchedulerOutput


@dataclass(frozen=True)
class PromptLogprobsSlice:
    """Rows [row_start, row_start + num) of the logits score prompt tokens start_position.. of request `index`."""

    index: int              # position of the request in SchedulerOutput.scheduled
    row_start: int          # first row in the logits tensor
    num: int
    start_position: int     # prompt index of the token scored by the first row
    target_token_ids: tuple[int, ...]


@dataclass(frozen=True)
class ModelInputs:
    input_ids: torch.Tensor        # [num_tokens] int64
    positions: torch.Tensor        # [num_tokens] int64
    attn: AttentionMetadata
    logits_indices: torch.Tensor   # [num_logits_rows] int64: hidden rows to compute logits for
    sample_rows: tuple[int, ...]   # logits row of each sampling request, in `sample_reqs` order
    sample_reqs: tuple[int, ...]   # indices into SchedulerOutput.scheduled of the sampling requests
    prompt_logprobs: tuple[PromptLogprobsSlice, ...]
    # The logits rows when they are each the last row of their request and fewer than the tokens
    # (steps with prompt chunks, no prompt logprobs or pooling): the model's last layer runs on them only.
    output_rows: OutputRows | None = None


def prepare_inputs(sched: SchedulerOutput, block_size: int, device: torch.device) -> ModelInputs:
    scheduled = sched.scheduled
    if scheduled and all(s.num_new_tokens == 1 and s.will_sample and not s.request.needs_prompt_logprobs
                         for s in scheduled):
        return _decode_inputs(scheduled, block_size, device)
    return _general_inputs(scheduled, block_size, device)


def _decode_inputs(scheduled: tuple[ScheduledRequest, ...], block_size: int, device: torch.device) -> ModelInputs:
    """A step where every request feeds one token and samples (decode): the inputs _general_inputs
    makes, from a few whole-step tensors (views of two) instead of some forty small ops.

    NOTE: why a path of its own: at batch 1 the runner calls this right after the model streamed its
    weights through the caches, so every op runs cold; the general path cost about 0.25 ms of a
    10.6 ms step there (tests/test_output_rows.py checks both paths give the same inputs)."""
    num_reqs = len(scheduled)
    context = [s.request.num_computed_tokens for s in scheduled]
    tables = [s.block_ids for s in scheduled]
    width = max(1, max(map(len, tables)))
    longs = torch.tensor([[s.request.all_token_ids[c] for s, c in zip(scheduled, context)], context,
                          [t[c // block_size] * block_size + c % block_size for t, c in zip(tables, context)]],
                         dtype=torch.int64, device=device)                      # [3, num_reqs]: ids, positions, slots
    seq_lens = [c + 1 for c in context]
    ints = torch.tensor([*range(num_reqs + 1), *seq_lens, *context], dtype=torch.int32, device=device)
    block_tables = np.zeros((num_reqs, width), dtype=np.int32)                   # [num_reqs, width]
    for i, t in enumerate(tables):
        block_tables[i, :len(t)] = t
    rows = tuple(range(num_reqs))
    attn = AttentionMetadata(
        slot_mapping=longs[2], query_start_loc=ints[:num_reqs + 1], seq_lens=ints[num_reqs + 1:2 * num_reqs + 1],
        context_lens=ints[2 * num_reqs + 1:], block_tables=torch.from_numpy(block_tables).to(device),
        block_size=block_size, max_query_len=1, max_seq_len=max(seq_lens), query_lens_list=(1,) * num_reqs,
        seq_lens_list=tuple(seq_lens))
    return ModelInputs(input_ids=longs[0], positions=longs[1], attn=attn,
                       logits_indices=torch.arange(num_reqs, device=device), sample_rows=rows, sample_reqs=rows,
                       prompt_logprobs=())


def _general_inputs(scheduled: tuple[ScheduledRequest, ...], block_size: int, device: torch.device) -> ModelInputs:
    num_reqs = len(scheduled)
    query_lens = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=num_reqs)
    context_lens = np.fromiter((s.request.num_computed_tokens for s in scheduled), dtype=np.int64, count=num_reqs)
    seq_lens = context_lens + query_lens
    query_start = np.zeros(num_reqs + 1, dtype=np.int64)
    np.cumsum(query_lens, out=query_start[1:])
    num_tokens = int(query_start[-1])

    # Token ids: a decode is one list index; prefill chunks are list slices.
    input_ids = np.empty(num_tokens, dtype=np.int64)
    for i, s in enumerate(scheduled):
        c, n = int(context_lens[i]), int(query_lens[i])
        if n == 1:
            input_ids[query_start[i]] = s.request.all_token_ids[c]
        else:
            input_ids[query_start[i]:query_start[i + 1]] = s.request.all_token_ids[c:c + n]

    # positions[t] = context_len(r) + (t - query_start[r]) for the request r owning token t.
    req_of_token = np.repeat(np.arange(num_reqs), query_lens)                       # [num_tokens]
    positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(query_start[:-1] - context_lens, query_lens)

    max_blocks = max((len(s.block_ids) for s in scheduled), default=1)
    block_tables = np.zeros((num_reqs, max(max_blocks, 1)), dtype=np.int32)
    for i, s in enumerate(scheduled):
        block_tables[i, :len(s.block_ids)] = s.block_ids
    slot_mapping = block_tables[req_of_token, positions // block_size].astype(np.int64) * block_size + positions % block_size

    # Logits rows: prompt-logprob chunks first need every row; samplers need their last row.
    logits_idx: list[int] = []
    sample_rows: list[int] = []
    sample_reqs: list[int] = []
    plp: list[PromptLogprobsSlice] = []
    for i, s in enumerate(scheduled):
        req = s.request
        last = int(query_start[i + 1]) - 1
        if req.needs_prompt_logprobs:
            c = int(context_lens[i])
            end = min(c + int(query_lens[i]), req.num_prompt_tokens - 1)   # rows that score a prompt token
            if end > c:
                plp.append(PromptLogprobsSlice(i, len(logits_idx), end - c, c + 1,
                                               tuple(req.prompt_token_ids[c + 1:end + 1])))
                logits_idx.extend(range(int(query_start[i]), int(query_start[i]) + end - c))
        if s.will_sample:
            # The last prompt row may already be listed above only if it scored a prompt token,
            # which it never does (it predicts the first output), so no row is listed twice.
            sample_rows.append(len(logits_idx))
            sample_reqs.append(i)
            logits_idx.append(last)

    attn = AttentionMetadata(
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        query_start_loc=torch.from_numpy(query_start.astype(np.int32)).to(device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        context_lens=torch.from_numpy(context_lens.astype(np.int32)).to(device),
        block_tables=torch.from_numpy(block_tables).to(device),
        block_size=block_size,
        max_query_len=int(query_lens.max()) if num_reqs else 0,
        max_seq_len=int(seq_lens.max()) if num_reqs else 0,
        query_lens_list=tuple(query_lens.tolist()),
        seq_lens_list=tuple(seq_lens.tolist()),
    )
    logits_indices = torch.tensor(logits_idx, dtype=torch.int64, device=device)
    output_rows = None
    # Pooling requests read hidden rows that get no logits (their pooler comes later): no pruning then.
    if not plp and 0 < len(logits_idx) < num_tokens and not any(s.request.is_pooling for s in scheduled):
        sel = np.asarray(sample_reqs, dtype=np.int64)
        sel_seq_lens = seq_lens[sel]
        output_rows = OutputRows(logits_indices, AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping[logits_idx]).to(device),
            query_start_loc=torch.arange(len(sel) + 1, dtype=torch.int32, device=device),
            seq_lens=torch.from_numpy(sel_seq_lens.astype(np.int32)).to(device),
            context_lens=torch.from_numpy((sel_seq_lens - 1).astype(np.int32)).to(device),
            block_tables=torch.from_numpy(block_tables[sel]).to(device),
            block_size=block_size, max_query_len=1, max_seq_len=int(sel_seq_lens.max()),
            query_lens_list=(1,) * len(sel), seq_lens_list=tuple(sel_seq_lens.tolist())))
    return ModelInputs(
        input_ids=torch.from_numpy(input_ids).to(device),
        positions=torch.from_numpy(positions).to(device),
        attn=attn,
        logits_indices=logits_indices,
        sample_rows=tuple(sample_rows),
        sample_reqs=tuple(sample_reqs),
        prompt_logprobs=tuple(plp),
        output_rows=output_rows,
    )
