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


_NUCLEUS_CANDIDATES = 256


def apply_top_k_top_p(logits: torch.Tensor,                  # [num_rows, vocab]
                      top_k: torch.Tensor | None,            # [num_rows] int64 (vocab when off)
                      top_p: torch.Tensor | None,            # [num_rows] float32 (1.0 when off)
                      max_top_k: int) -> None:               # max of top_k (vocab when any row is off)
    """Keep each row's k best tokens, then the smallest best set whose mass reaches p.

    Both filters work by position on candidates sorted best-first, then scatter back. The
    candidates come from the cheapest exact source (a full sort of a 50k vocabulary is
    ~10x slower than a small topk on CPU):
    - every row limits k to a small part of the vocabulary: `topk(max_top_k)`;
    - top-p only, and the best 256 tokens already hold each row's p: `topk(256)`
      (the nucleus is a best-first prefix, so it lies inside them);
    - otherwise one full sort.
    """
    if top_k is None and top_p is None:
        return
    vocab = logits.shape[-1]
    values = order = probs = None
    if top_k is not None and max_top_k * 4 <= vocab:
        values, order = logits.topk(max_top_k, dim=-1)               # [num_rows, max_top_k]
    elif top_k is None and _NUCLEUS_CANDIDATES * 4 <= vocab:
        values, order = logits.topk(_NUCLEUS_CANDIDATES, dim=-1)     # [num_rows, candidates]
        probs = (values - logits.logsumexp(dim=-1, keepdim=True)).exp()
        if not bool((probs.sum(dim=-1) >= top_p).all()):
            values = order = probs = None
    if values is None:
        values, order = logits.sort(dim=-1, descending=True)         # [num_rows, vocab]
    if top_k is not None:
        positions = torch.arange(values.shape[1], device=logits.device)
        values.masked_fill_(positions.unsqueeze(0) >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        if probs is None:   # top-p renormalises over what top-k kept
            probs = values.softmax(dim=-1)
        # Drop a token once the better tokens before it already reach p; the best token
        # (nothing before it) always stays, even when p rounds to nothing.
        mass_before = probs.cumsum(dim=-1) - probs
        mass_before[:, 0] = 0.0
        values.masked_fill_(mass_before >= top_p.unsqueeze(1), float("-inf"))
    logits.fill_(float("-inf")).scatter_(1, order, values)
