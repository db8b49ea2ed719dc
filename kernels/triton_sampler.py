"""Triton batched sampler: the GPU version of `sampling_ref` (same signatures, same steps 1-6).

One program per row streams the row's logits in BLOCK_V chunks (the loop bounds are constexpr:
the vocabulary size is fixed per model). top-k and top-p need no sort: each finds its
threshold by bisection over the 32-bit order key of the scaled logits (32 passes over the
row, each counting kept tokens, or summing their mass, above the midpoint), then keeps the
tokens at or above it; that is exactly the reference's tie-inclusive rule. The race draws
Philox noise with `tl.philox` at the reference's counters, so the same (seed, offset) gives
the same token on any batch.

Called by nothing in the engine yet (see `sampling_ref`); tested against the reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .sampling_ref import GREEDY_EPS

BLOCK_V = 1024
_KEY_MIN, _KEY_MAX = -(2 ** 31), 2 ** 31 - 1


@triton.jit
def _order_key(x):
    """fp32 -> int64 with the same order (negative floats have their magnitude bits flipped)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)


@triton.jit
def _load_chunk(row_ptr, c, temperature, top, log_min_p, vocab, BLOCK_V: tl.constexpr):
    cols = c * BLOCK_V + tl.arange(0, BLOCK_V)
    valid = cols < vocab
    x = tl.load(row_ptr + cols, mask=valid, other=float("-inf")).to(tl.float32)
    scaled = tl.math.div_rn(x, temperature)
    kept = valid & (scaled > float("-inf")) & (scaled - top >= log_min_p)
    return cols, scaled, kept


@triton.jit
def _bisect(row_ptr, temperature, top, log_min_p, floor_key, target, vocab,
            USE_MASS: tl.constexpr, NUM_CHUNKS: tl.constexpr, BLOCK_V: tl.constexpr):
    """Smallest key K with (count, or exp-mass, of kept tokens keyed above K) < target."""
    lo = tl.full((), -2147483648, tl.int64)
    hi = tl.full((), 2147483647, tl.int64)
    for _ in range(32):
        mid = lo + (hi - lo) // 2
        total = tl.zeros((), tl.float32)
        for c in range(NUM_CHUNKS):
            cols, scaled, kept = _load_chunk(row_ptr, c, temperature, top, log_min_p, vocab, BLOCK_V)
            key = _order_key(scaled)
            above = kept & (key >= floor_key) & (key > mid)
            if USE_MASS:
                total += tl.sum(tl.where(above, tl.exp(scaled - top), 0.0), axis=0)
            else:
                total += tl.sum(above.to(tl.float32), axis=0)
        below = total < target
        hi = tl.where(below, mid, hi)
        lo = tl.where(below, lo, mid)
    return hi


@triton.jit
def _sampler_kernel(
    logits_ptr, temperature_ptr, top_k_ptr, top_p_ptr, min_p_ptr, seeds_ptr, offsets_ptr,
    out_tokens_ptr, out_logits_ptr, stride_row, vocab,
    WRITE_LOGITS: tl.constexpr, NUM_CHUNKS: tl.constexpr, BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    temperature = tl.load(temperature_ptr + row).to(tl.float32)
    is_greedy = temperature < 1e-5

    # Pass 1: raw max and its first index (greedy answer; max(x / t) = max(x) / t for t > 0).
    best_val = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.zeros((), tl.int64)
    for c in range(NUM_CHUNKS):
        cols = c * BLOCK_V + tl.arange(0, BLOCK_V)
        x = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        chunk_max = tl.max(x, axis=0)
        chunk_idx = tl.min(tl.where(x == chunk_max, cols, 2147483647), axis=0).to(tl.int64)
        better = chunk_max > best_val
        best_idx = tl.where(better, chunk_idx, best_idx)
        best_val = tl.where(better, chunk_max, best_val)
    if is_greedy:
        tl.store(out_tokens_ptr + row, best_idx)
        if WRITE_LOGITS:
            for c in range(NUM_CHUNKS):
                cols = c * BLOCK_V + tl.arange(0, BLOCK_V)
                x = tl.load(row_ptr + cols, mask=cols < vocab, other=0.0).to(tl.float32)
                tl.store(out_logits_ptr + row * vocab + cols, x, mask=cols < vocab)
        return

    top = tl.math.div_rn(best_val, temperature)
    min_p = tl.load(min_p_ptr + row).to(tl.float32)
    log_min_p = tl.where(min_p > 0.0, tl.log(tl.maximum(min_p, 1e-38)), float("-inf"))
    top_k = tl.load(top_k_ptr + row).to(tl.int64)
    top_p = tl.load(top_p_ptr + row).to(tl.float32)

    floor_key = tl.full((), -2147483648, tl.int64)
    if (top_k > 0) & (top_k < vocab):
        floor_key = _bisect(row_ptr, temperature, top, log_min_p, floor_key, top_k.to(tl.float32), vocab,
                            False, NUM_CHUNKS, BLOCK_V)
    if top_p < 1.0:
        kept_mass = tl.zeros((), tl.float32)
        for c in range(NUM_CHUNKS):
            cols, scaled, kept = _load_chunk(row_ptr, c, temperature, top, log_min_p, vocab, BLOCK_V)
            kept = kept & (_order_key(scaled) >= floor_key)
            kept_mass += tl.sum(tl.where(kept, tl.exp(scaled - top), 0.0), axis=0)
        floor_key = _bisect(row_ptr, temperature, top, log_min_p, floor_key, top_p * kept_mass, vocab,
                            True, NUM_CHUNKS, BLOCK_V)

    # The race: argmax of l - log(-log(u)) over the kept tokens, u from Philox(seed; id, offset).
    seed = tl.load(seeds_ptr + row)
    offset = tl.load(offsets_ptr + row).to(tl.int64)
    offset_lo = (offset & 0xFFFFFFFF).to(tl.uint32)
    offset_hi = ((offset >> 32) & 0xFFFFFFFF).to(tl.uint32)
    best_score = tl.full((), float("-inf"), tl.float32)
    best_idx = tl.zeros((), tl.int64)
    for c in range(NUM_CHUNKS):
        cols, scaled, kept = _load_chunk(row_ptr, c, temperature, top, log_min_p, vocab, BLOCK_V)
        kept = kept & (_order_key(scaled) >= floor_key)
        counter = cols.to(tl.uint32)
        zeros = counter * 0
        word, _, _, _ = tl.philox(seed, counter, zeros + offset_lo, zeros + offset_hi, zeros)
        u = ((word >> 9).to(tl.int32).to(tl.float32) + 0.5) * 1.1920928955078125e-07   # exact: 2**-23
        score = tl.where(kept, scaled - tl.log(-tl.log(u)), float("-inf"))
        chunk_max = tl.max(score, axis=0)
        chunk_idx = tl.min(tl.where(score == chunk_max, cols, 2147483647), axis=0).to(tl.int64)
        better = chunk_max > best_score
        best_idx = tl.where(better, chunk_idx, best_idx)
        best_score = tl.where(better, chunk_max, best_score)
        if WRITE_LOGITS:
            tl.store(out_logits_ptr + row * vocab + cols, tl.where(kept, scaled, float("-inf")),
                     mask=cols < vocab)
    tl.store(out_tokens_ptr + row, best_idx)


def _launch(logits, temperature, top_k, top_p, min_p, seeds, offsets, write_logits: bool):
    num_rows, vocab = logits.shape
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    tokens = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
    processed = torch.empty((num_rows, vocab) if write_logits else (1,), dtype=torch.float32,
                            device=logits.device)
    if num_rows == 0:
        return tokens, processed
    block_v = min(BLOCK_V, triton.next_power_of_2(vocab))
    _sampler_kernel[(num_rows,)](
        logits, temperature, top_k, top_p, min_p, seeds, offsets, tokens, processed,
        logits.stride(0), vocab,
        WRITE_LOGITS=write_logits, NUM_CHUNKS=triton.cdiv(vocab, block_v), BLOCK_V=block_v,
    )
    return tokens, processed


def apply_sampling_masks(
    logits: torch.Tensor,       # [num_rows, vocab] fp32
    temperature: torch.Tensor,  # [num_rows] fp32; < 1e-5: greedy
    top_k: torch.Tensor,        # [num_rows] int; <= 0 or >= vocab: off
    top_p: torch.Tensor,        # [num_rows] fp32; 1.0: off
    min_p: torch.Tensor,        # [num_rows] fp32; 0.0: off
) -> torch.Tensor:              # [num_rows, vocab] fp32: l with -inf where dropped (greedy rows: raw)
    zeros = torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)
    return _launch(logits, temperature, top_k, top_p, min_p, zeros, zeros, write_logits=True)[1]


def sample_tokens(
    logits: torch.Tensor,       # [num_rows, vocab] fp32
    temperature: torch.Tensor,  # [num_rows] fp32; < 1e-5: greedy
    top_k: torch.Tensor,        # [num_rows] int; <= 0 or >= vocab: off
    top_p: torch.Tensor,        # [num_rows] fp32; 1.0: off
    min_p: torch.Tensor,        # [num_rows] fp32; 0.0: off
    seeds: torch.Tensor,        # [num_rows] int64: Philox key of each row
    offsets: torch.Tensor,      # [num_rows] int64: Philox counter of each row (advance per step)
) -> torch.Tensor:              # [num_rows] int64
    return _launch(logits, temperature, top_k, top_p, min_p, seeds, offsets, write_logits=False)[0]


assert GREEDY_EPS == 1e-5, "the kernel hard-codes the greedy threshold"
