"""SamplingMetadata: one step's sampling parameters as batched tensors (one row per request).

Built by the model runner each step from the requests that sample this step (`build`), read
only by the Sampler. Each optional group is None when no row uses it, so the common cases
(all greedy, no penalties, no masks) cost nothing in the sampler and almost nothing here.

Per-request generators live in a dict the caller owns (the model runner's, keyed by request
id, dropped when the request finishes): a request whose params carry a seed gets
`torch.Generator(device).manual_seed(seed)` there on its first step, and keeps it across steps
and preemptions, so its draws do not depend on the batch it lands in. Requests themselves are
never written here.

NOTE: the Python work here runs per request per step, the hot loop of the engine. Rows that
use no penalties, bad words, bias or masks cost a few attribute reads; per-token work
(prompt/output histograms, bad-word prefix checks) happens only for rows that need it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .request import Request

_SAMPLING_EPS = 1e-5


@dataclass(frozen=True)
class SamplingMetadata:
    num_rows: int
    all_greedy: bool
    all_random: bool
    # Temperature per row; greedy rows hold 1.0 so a mixed batch can divide safely. None: all greedy.
    temperature: torch.Tensor | None            # [num_rows] float32
    is_greedy: torch.Tensor | None              # [num_rows] bool; None: no greedy row
    top_p: torch.Tensor | None                  # [num_rows] float32; None: no row uses top_p
    top_k: torch.Tensor | None                  # [num_rows] int64, vocab_size when off; None: no row uses it
    max_top_k: int                              # largest row k (vocab_size when some row is off)
    min_p: torch.Tensor | None                  # [num_rows] float32; None: no row uses min_p
    # Per-row generators for seeded rows: (row index, generator).
    generators: tuple[tuple[int, torch.Generator], ...]
    # Penalties (None when no row uses any penalty).
    repetition_penalties: torch.Tensor | None   # [num_rows] float32
    frequency_penalties: torch.Tensor | None    # [num_rows] float32
    presence_penalties: torch.Tensor | None     # [num_rows] float32
    prompt_token_mask: torch.Tensor | None      # [num_rows, vocab] bool: token occurs in the prompt
    output_token_counts: torch.Tensor | None    # [num_rows, vocab] float32: occurrences in the output
    # allowed_token_ids: the rows that restrict, and a mask of what they allow.
    allowed_rows: torch.Tensor | None           # [num_allowed_rows] int64
    allowed_mask: torch.Tensor | None           # [num_allowed_rows, vocab] bool (True: allowed)
    # Bad words and min_tokens (stop ids masked): (row, token) pairs set to -inf.
    banned_rows: torch.Tensor | None            # [num_banned] int64
    banned_token_ids: torch.Tensor | None       # [num_banned] int64
    # logit_bias as (row, token, bias) triples, added.
    bias_rows: torch.Tensor | None              # [num_biases] int64
    bias_token_ids: torch.Tensor | None         # [num_biases] int64
    bias_values: torch.Tensor | None            # [num_biases] float32
    # logprobs: k per row (None: not asked), and the largest k (None: no row asks).
    num_logprobs: tuple[int | None, ...]
    max_num_logprobs: int | None
    # Every row's temperature is exactly 1 (greedy rows count as 1): the sampler skips the division.
    temperature_all_one: bool = False
    # Per row: only a temperature (or greedy) acts on it: no truncation, penalties, masks, bias or
    # logprobs. Such rows may be sampled straight from the model's logits (engine/sampler.py).
    plain_rows: tuple[bool, ...] = ()

    @property
    def no_penalties(self) -> bool:
        return self.repetition_penalties is None

    @property
    def no_top_k(self) -> bool:
        return self.top_k is None

    @property
    def no_top_p(self) -> bool:
        return self.top_p is None

    @property
    def no_min_p(self) -> bool:
        return self.min_p is None

    @classmethod
    def build(cls, requests: Sequence[Request], *, vocab_size: int, device: torch.device,
              generators_by_id: dict[str, torch.Generator] | None = None) -> "SamplingMetadata":
        """`generators_by_id`: the caller's per-request generators (created here on first use);
        None: fresh ones for this call only (seeded draws then restart every call)."""
        own = {} if generators_by_id is None else generators_by_id
        num_rows = len(requests)
        temps: list[float] = []
        top_ps: list[float] = []
        top_ks: list[int] = []
        min_ps: list[float] = []
        num_logprobs: list[int | None] = []
        generators: list[tuple[int, torch.Generator]] = []
        penalty_rows: list[int] = []
        allowed: list[tuple[int, list[int]]] = []
        banned_rows: list[int] = []
        banned_ids: list[int] = []
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_vals: list[float] = []
        num_greedy = 0
        use_top_p = use_top_k = use_min_p = False

        for i, req in enumerate(requests):
            sp = req.sampling_params
            if sp.temperature < _SAMPLING_EPS:
                num_greedy += 1
                temps.append(1.0)
            else:
                temps.append(sp.temperature)
                if sp.seed is not None:
                    gen = own.get(req.request_id)
                    if gen is None:
                        gen = own[req.request_id] = torch.Generator(device=device).manual_seed(sp.seed)
                    generators.append((i, gen))
            top_ps.append(sp.top_p)
            use_top_p |= sp.top_p < 1.0
            top_ks.append(sp.top_k if 0 < sp.top_k < vocab_size else vocab_size)
            use_top_k |= 0 < sp.top_k < vocab_size
            min_ps.append(sp.min_p)
            use_min_p |= sp.min_p > 0.0
            num_logprobs.append(sp.logprobs)
            if (sp.repetition_penalty != 1.0 or sp.frequency_penalty != 0.0
                    or sp.presence_penalty != 0.0):
                penalty_rows.append(i)
            if sp.allowed_token_ids is not None:
                allowed.append((i, sp.allowed_token_ids))
            if sp.logit_bias:
                for tok, bias in sp.logit_bias.items():
                    if tok >= vocab_size:
                        continue
                    bias_rows.append(i)
                    bias_ids.append(tok)
                    bias_vals.append(bias)
            if sp.min_tokens and req.num_output_tokens < sp.min_tokens:
                for tok in sp.all_stop_token_ids:
                    if tok < vocab_size:
                        banned_rows.append(i)
                        banned_ids.append(tok)
            if sp.bad_words_token_ids:
                for tok in _banned_by_bad_words(sp.bad_words_token_ids, req.output_token_ids):
                    if tok < vocab_size:
                        banned_rows.append(i)
                        banned_ids.append(tok)

        all_greedy = num_greedy == num_rows
        max_top_k = max(top_ks, default=vocab_size)
        all_random = num_greedy == 0
        f32, i64 = torch.float32, torch.int64

        def t(values: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=device)

        temperature = is_greedy = top_p = top_k = min_p = None
        if not all_greedy:
            temperature = t(temps, f32)
            if not all_random:
                is_greedy = t([x.sampling_params.temperature < _SAMPLING_EPS for x in requests],
                              torch.bool)
            # Truncation only matters for random rows; greedy rows were normalised to "off".
            top_p = t(top_ps, f32) if use_top_p else None
            top_k = t(top_ks, i64) if use_top_k else None
            min_p = t(min_ps, f32) if use_min_p else None

        rep = freq = pres = prompt_mask = out_counts = None
        if penalty_rows:
            rep = t([r.sampling_params.repetition_penalty for r in requests], f32)
            freq = t([r.sampling_params.frequency_penalty for r in requests], f32)
            pres = t([r.sampling_params.presence_penalty for r in requests], f32)
            prompt_mask, out_counts = _token_histograms(requests, penalty_rows, vocab_size, device)

        allowed_rows = allowed_mask = None
        if allowed:
            allowed_rows = t([i for i, _ in allowed], i64)
            allowed_mask = torch.zeros(len(allowed), vocab_size, dtype=torch.bool, device=device)
            for j, (_, ids) in enumerate(allowed):
                allowed_mask[j, t([x for x in ids if x < vocab_size], i64)] = True

        max_k = max((k for k in num_logprobs if k is not None), default=None)
        touched = set(penalty_rows) | set(banned_rows) | set(bias_rows) | {i for i, _ in allowed}
        plain = tuple(num_logprobs[i] is None and i not in touched and top_ps[i] >= 1.0 and top_ks[i] >= vocab_size
                      and min_ps[i] <= 0.0 for i in range(num_rows))
        return cls(
            temperature_all_one=all(x == 1.0 for x in temps), plain_rows=plain,
            num_rows=num_rows, all_greedy=all_greedy, all_random=all_random,
            temperature=temperature, is_greedy=is_greedy, top_p=top_p, top_k=top_k, max_top_k=max_top_k, min_p=min_p,
            generators=tuple(generators),
            repetition_penalties=rep, frequency_penalties=freq, presence_penalties=pres,
            prompt_token_mask=prompt_mask, output_token_counts=out_counts,
            allowed_rows=allowed_rows, allowed_mask=allowed_mask,
            banned_rows=t(banned_rows, i64) if banned_rows else None,
            banned_token_ids=t(banned_ids, i64) if banned_rows else None,
            bias_rows=t(bias_rows, i64) if bias_rows else None,
            bias_token_ids=t(bias_ids, i64) if bias_rows else None,
            bias_values=t(bias_vals, f32) if bias_rows else None,
            num_logprobs=tuple(num_logprobs), max_num_logprobs=max_k,
        )


def _banned_by_bad_words(bad_words: tuple[tuple[int, ...], ...], output_ids: list[int]) -> list[int]:
    """Last tokens of the bad words whose prefix the output currently ends with."""
    banned = []
    for word in bad_words:
        prefix_len = len(word) - 1
        if prefix_len > len(output_ids):
            continue
        if prefix_len == 0 or output_ids[-prefix_len:] == list(word[:prefix_len]):
            banned.append(word[-1])
    return banned


def _token_histograms(requests: Sequence[Request], rows: list[int], vocab_size: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompt-occurrence mask and output counts for the penalty rows (other rows stay zero)."""
    prompt_mask = torch.zeros(len(requests), vocab_size, dtype=torch.bool, device=device)
    out_counts = torch.zeros(len(requests), vocab_size, dtype=torch.float32, device=device)
    for i in rows:
        req = requests[i]
        if req.prompt_token_ids:
            prompt_mask[i, torch.tensor(req.prompt_token_ids, dtype=torch.int64, device=device)] = True
        if req.output_token_ids:
            out_ids = torch.tensor(req.output_token_ids, dtype=torch.int64, device=device)
            out_counts[i] = torch.bincount(out_ids, minlength=vocab_size)[:vocab_size].to(torch.float32)
    return prompt_mask, out_counts
