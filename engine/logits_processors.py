"""Batched logits processors and truncation filters: pure functions over [num_rows, vocab].

Called by the Sampler (engine/sampler.py) in vLLM's order: masks (allowed ids, bad words,
min_tokens) -> logit_bias -> penalties; then, for random rows after temperature, min_p and
top-k/top-p. Each function takes the tensors of a SamplingMetadata group and edits `logits`
in place; the Sampler only calls a function when its group is not None.
"""
from __future__ import annotations

import torch


def apply_allowed_token_ids(logits: torch.Tensor,            # [num_rows, vocab]
                            rows: torch.Tensor,              # [num_allowed_rows]
                            allowed_mask: torch.Tensor) -> None:  # [num_allowed_rows, vocab] bool
    logits[rows] = logits[rows].masked_fill(~allowed_mask, float("-inf"))


def apply_banned_tokens(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
    """Bad words and min_tokens: each (row, token) pair becomes -inf."""
    logits[rows, token_ids] = float("-inf")


def apply_logit_bias(logits: torch.Tensor, rows: torch.Tensor, token_ids: torch.Tensor,
                     values: torch.Tensor) -> None:
    logits.index_put_((rows, token_ids), values, accumulate=True)


def apply_penalties(logits: torch.Tensor,                    # [num_rows, vocab]
                    prompt_mask: torch.Tensor,               # [num_rows, vocab] bool
                    output_counts: torch.Tensor,             # [num_rows, vocab] float32
                    repetition: torch.Tensor,                # [num_rows]
                    frequency: torch.Tensor,                 # [num_rows]
                    presence: torch.Tensor) -> None:         # [num_rows]
    """Repetition over prompt + output (HF style: positive logits divided, negative multiplied);
    frequency (times the count) and presence (once) over the output only."""
    output_mask = output_counts > 0
    seen = prompt_mask | output_mask
    rep = repetition.unsqueeze(1).expand_as(logits)
    # Rows with penalty 1.0 divide by 1: no change, so no per-row branch is needed.
    factor = torch.where(logits > 0, 1.0 / rep, rep)
    logits.copy_(torch.where(seen, logits * factor, logits))
    logits.sub_(frequency.unsqueeze(1) * output_counts)
    logits.sub_(presence.unsqueeze(1) * output_mask.to(logits.dtype))


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> None:
    """Drop tokens whose probability is below min_p times the row's top probability."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    logits.masked_fill_(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor,                  # [num_rows, vocab]
                      top_k: torch.Tensor | None,            # [num_rows] int64 (vocab when off)
                      top_p: torch.Tensor | None) -> None:   # [num_rows] float32 (1.0 when off)
    """One ascending sort serves both filters; the masks are scattered back to vocab order.

    top-k keeps every token at least as large as the k-th largest (ties kept); top-p keeps the
    smallest high-probability set whose mass reaches p, always including the top token.
    """
    if top_k is None and top_p is None:
        return
    vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=False)     # [num_rows, vocab]
    if top_k is not None:
        kth_index = (vocab - top_k.clamp(1, vocab)).unsqueeze(1)     # [num_rows, 1]
        kth_value = sorted_logits.gather(1, kth_index)
        sorted_logits.masked_fill_(sorted_logits < kth_value, float("-inf"))
    if top_p is not None:
        cum_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        # The tail whose mass is at most 1 - p can go; the largest token always stays.
        drop = cum_probs <= (1.0 - top_p).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    logits.scatter_(1, order, sorted_logits)
