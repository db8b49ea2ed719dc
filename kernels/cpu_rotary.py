"""CPU rotary embedding with the cos/sin gather done once per step instead of once per layer.

Bound in `kernels/ops.py` for CPU bf16: `Ops.prepare_rotary` is called by the model once per
forward, and every layer's `Ops.apply_rotary` receives its result in place of the cos/sin cache.
Test oracle: `rotary_ref.apply_rotary` (bit-identical: the same fp32 table cast to the same dtype,
the same products; tests/test_cpu_kernels.py).

NOTE: why. The reference gathers the table rows, splits, repeats and casts them in every layer
(about 10 small ops; each costs 5-10 us of dispatch at decode sizes). Measured here (2 threads,
9/3 heads, head_dim 64, bf16): 70 -> 21 us per layer at 1 token, 114 -> 54 us at 64 tokens.
The sign of rotate_half is folded into the sin table, so a layer does a half swap, two multiplies
and an add per tensor.
"""
from __future__ import annotations

import torch

RotaryTables = tuple[torch.Tensor, torch.Tensor]  # cos, signed sin: [num_tokens, 1, head_dim]


# The expanded tables of a whole cos/sin cache are kept (on the cache tensor) up to this size; a
# longer cache (a 128k-position model) expands its rows step by step instead.
EXPANDED_MAX_BYTES = 64 * 2**20


def prepare_rotary(
    positions: torch.Tensor,      # [num_tokens] int64
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim] fp32: cos half, then sin half
    dtype: torch.dtype,
) -> RotaryTables:
    """The per-token tables every layer of one step shares: rows of the cache's expanded tables
    (made once per cache and dtype), or the cache's rows expanded when the whole would be too big.

    NOTE: why keep the expanded tables: gathering and expanding the rows took nine small ops per
    step; at batch 1 they run with cold caches (the weights just streamed through them) and cost
    about 70 us of a 10.6 ms step; two gathers cost a third of that (docs/performance/batch-1.md, session 19)."""
    positions = positions.to(torch.long)
    tables = _whole_tables(cos_sin_cache, dtype)
    if tables is None:
        return _expand(cos_sin_cache.index_select(0, positions), dtype)
    return tables[0].index_select(0, positions), tables[1].index_select(0, positions)


def position_tables(cos_sin_cache: torch.Tensor, low: int, high: int, dtype: torch.dtype) -> RotaryTables:
    """The expanded tables of positions low..high - 1 (2 x [high - low, 1, head_dim] contiguous, `dtype`):
    a view of the whole cache's kept tables, or those rows expanded when the whole is too big."""
    tables = _whole_tables(cos_sin_cache, dtype)
    if tables is None:
        return _expand(cos_sin_cache[low:high], dtype)
    return tables[0][low:high], tables[1][low:high]


def _expand(cos_sin: torch.Tensor, dtype: torch.dtype) -> RotaryTables:  # [N, head_dim] -> 2 x [N, 1, head_dim]
    half = cos_sin.shape[-1] // 2
    cos, sin = cos_sin[:, :half], cos_sin[:, half:]
    return (torch.cat((cos, cos), -1).unsqueeze(1).to(dtype),
            torch.cat((-sin, sin), -1).unsqueeze(1).to(dtype))


def _whole_tables(cos_sin_cache: torch.Tensor, dtype: torch.dtype) -> RotaryTables | None:
    """The whole cache expanded in `dtype`, made on first use and kept on the cache tensor; None above
    EXPANDED_MAX_BYTES."""
    kept = cos_sin_cache.__dict__.setdefault("_vb_rotary_tables", {})
    if dtype not in kept:
        positions, dim = cos_sin_cache.shape
        small = 2 * positions * dim * torch.empty((), dtype=dtype).element_size() <= EXPANDED_MAX_BYTES
        kept[dtype] = _expand(cos_sin_cache, dtype) if small else None
    return kept[dtype]


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((x[..., half:], x[..., :half]), -1) * signed_sin


def apply_rotary(
    positions: torch.Tensor,  # [num_tokens] int64 (unused: the tables are already per token)
    query: torch.Tensor,      # [num_tokens, num_q_heads, head_dim]
    key: torch.Tensor,        # [num_tokens, num_kv_heads, head_dim]
    tables: RotaryTables,     # from prepare_rotary(positions, ...)
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, signed_sin = tables
    if query.dtype != cos.dtype:  # the tables follow the model dtype; keep the reference's casts
        cos, signed_sin = cos.to(query.dtype), signed_sin.to(query.dtype)
    return _rotate(query, cos, signed_sin), _rotate(key, cos, signed_sin)
