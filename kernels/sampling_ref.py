"""Reference batched sampling with per-row parameters and counter-based (Philox) noise.

The specification and test oracle of `triton_sampler` (identical signatures). Plain PyTorch
with sorts (and numpy for Philox), written for clarity, not speed. Not yet wired into the
engine: `engine/sampler.py` keeps its torch.Generator-based sampling; a GPU sampler step can
call these ops once per-request seeds/offsets are plumbed through SamplingMetadata.

Per row, in order:
1. Greedy rows (temperature < 1e-5): the argmax of the raw logits (lowest id on ties); their
   processed logits are the raw logits.
2. Temperature: l = logits / temperature; m = max(l).
3. min_p: drop tokens with l - m < log(min_p) (probability below min_p times the top one).
4. top_k (0 < k < vocab): keep a token when fewer than k kept tokens have a strictly larger l.
5. top_p (< 1): with e = exp(l - m) over the kept tokens, keep a token when the kept tokens
   strictly better than it hold less than top_p of the kept mass.
6. Sample by the exponential race (Gumbel-max): token = argmax over kept tokens of
   l - log(-log(u)), u in (0, 1) from Philox4x32-10 keyed by the row's seed at counter
   (token id, offset low 32 bits, offset high 32 bits, 0). The noise depends only on
   (seed, offset, token id), so a row's draw does not depend on its batch or position in it;
   callers advance `offsets` each step (e.g. the number of tokens generated so far).

NOTE: ties in steps 4-5 keep every tied token (a threshold, not a positional cut), which a
GPU kernel can compute without sorting; `engine/sampler.py` cuts ties positionally.
"""
from __future__ import annotations

import numpy as np
import torch

GREEDY_EPS = 1e-5
_PHILOX_ROUND_A, _PHILOX_ROUND_B = 0xD2511F53, 0xCD9E8D57
_PHILOX_KEY_A, _PHILOX_KEY_B = 0x9E3779B9, 0xBB67AE85
_MASK32 = np.uint64(0xFFFFFFFF)


def philox4x32(counters: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray],
               key: tuple[np.ndarray, np.ndarray], rounds: int = 10) -> tuple[np.ndarray, ...]:
    """Philox4x32 (Salmon et al. 2011) on uint64 arrays holding 32-bit words."""
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & _MASK32 for c in counters)
    k0, k1 = (np.asarray(k, dtype=np.uint64) & _MASK32 for k in key)
    for _ in range(rounds):
        prod_a = np.uint64(_PHILOX_ROUND_A) * c0   # < 2**64: exact in uint64
        prod_b = np.uint64(_PHILOX_ROUND_B) * c2
        c0, c1, c2, c3 = ((prod_b >> np.uint64(32)) ^ c1 ^ k0, prod_b & _MASK32,
                          (prod_a >> np.uint64(32)) ^ c3 ^ k1, prod_a & _MASK32)
        k0 = (k0 + np.uint64(_PHILOX_KEY_A)) & _MASK32
        k1 = (k1 + np.uint64(_PHILOX_KEY_B)) & _MASK32
    return c0, c1, c2, c3


def philox_uniform(seeds: torch.Tensor, offsets: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """u in (0, 1), [rows, vocab] fp32: 23 random bits + 1/2, scaled exactly by 2**-23."""
    seed = seeds.cpu().numpy().astype(np.int64).view(np.uint64)[:, None]
    offset = offsets.cpu().numpy().astype(np.int64).view(np.uint64)[:, None]
    token = np.arange(vocab_size, dtype=np.uint64)[None, :]
    zeros = np.zeros_like(token)
    word, _, _, _ = philox4x32((token, offset & _MASK32, offset >> np.uint64(32), zeros),
                               (seed & _MASK32, seed >> np.uint64(32)))
    bits = (word >> np.uint64(9)).astype(np.float32)
    return torch.from_numpy((bits + np.float32(0.5)) * np.float32(2.0 ** -23)).to(seeds.device)


def _mass_before(values: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per entry: the total weight of entries in its row with a strictly larger value."""
    order = values.argsort(dim=-1, descending=True, stable=True)
    sorted_values = values.gather(-1, order)
    sorted_weights = weights.gather(-1, order)
    inclusive = sorted_weights.cumsum(dim=-1)
    # The first entry of each run of equal values fixes the run's "strictly larger" mass.
    is_run_start = torch.ones_like(sorted_values, dtype=torch.bool)
    is_run_start[:, 1:] = sorted_values[:, 1:] != sorted_values[:, :-1]
    positions = torch.arange(values.shape[-1], device=values.device).expand_as(values)
    run_start = torch.where(is_run_start, positions, 0).cummax(dim=-1).values
    exclusive = inclusive - sorted_weights
    before_sorted = exclusive.gather(-1, run_start)
    return torch.empty_like(before_sorted).scatter_(-1, order, before_sorted)


def apply_sampling_masks(
    logits: torch.Tensor,       # [num_rows, vocab] fp32
    temperature: torch.Tensor,  # [num_rows] fp32; < 1e-5: greedy
    top_k: torch.Tensor,        # [num_rows] int; <= 0 or >= vocab: off
    top_p: torch.Tensor,        # [num_rows] fp32; 1.0: off
    min_p: torch.Tensor,        # [num_rows] fp32; 0.0: off
) -> torch.Tensor:              # [num_rows, vocab] fp32: l with -inf where dropped (greedy rows: raw)
    """Steps 1-5: the temperature-scaled logits of the tokens a row may sample, -inf elsewhere."""
    logits = logits.float()
    vocab = logits.shape[-1]
    is_greedy = (temperature < GREEDY_EPS)[:, None]
    scaled = logits / torch.where(is_greedy[:, 0], 1.0, temperature.float())[:, None]
    top = scaled.amax(dim=-1, keepdim=True)
    kept = (scaled - top) >= torch.log(min_p.float())[:, None]       # log(0) = -inf keeps all
    kept &= scaled > float("-inf")
    use_top_k = ((top_k > 0) & (top_k < vocab))[:, None]
    num_better = _mass_before(torch.where(kept, scaled, float("-inf")), kept.float())
    kept &= ~use_top_k | (num_better < top_k[:, None].to(num_better.dtype))
    mass = torch.where(kept, torch.exp(scaled - top), 0.0)
    mass_better = _mass_before(torch.where(kept, scaled, float("-inf")), mass)
    use_top_p = (top_p < 1.0)[:, None]
    kept &= ~use_top_p | (mass_better < top_p.float()[:, None] * mass.sum(dim=-1, keepdim=True))
    return torch.where(is_greedy, logits, torch.where(kept, scaled, float("-inf")))


def sample_tokens(
    logits: torch.Tensor,       # [num_rows, vocab] fp32
    temperature: torch.Tensor,  # [num_rows] fp32; < 1e-5: greedy
    top_k: torch.Tensor,        # [num_rows] int; <= 0 or >= vocab: off
    top_p: torch.Tensor,        # [num_rows] fp32; 1.0: off
    min_p: torch.Tensor,        # [num_rows] fp32; 0.0: off
    seeds: torch.Tensor,        # [num_rows] int64: Philox key of each row
    offsets: torch.Tensor,      # [num_rows] int64: Philox counter of each row (advance per step)
) -> torch.Tensor:              # [num_rows] int64
    """Steps 1-6: one token per row."""
    processed = apply_sampling_masks(logits, temperature, top_k, top_p, min_p)
    u = philox_uniform(seeds, offsets, logits.shape[-1])
    scores = processed - torch.log(-torch.log(u))
    greedy = logits.float().argmax(dim=-1)
    return torch.where(temperature < GREEDY_EPS, greedy, scores.argmax(dim=-1))
