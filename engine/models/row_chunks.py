"""in_row_chunks: a row-wise block (an MLP) over a large step's rows, a chunk of rows at a time.

An MLP acts on each token row alone, so it may run over any split of the rows. A decoder calls it
through `in_row_chunks(block, hidden, ops.mlp_chunk_rows)`: with the ops' chunk size (CPU:
kernels/cpu_linear.py MLP_CHUNK_ROWS) each chunk's [rows, intermediate] product is read back from
cache instead of memory; with None (the references, CUDA) the block sees every row at once.
"""
from __future__ import annotations

from typing import Callable

import torch


def in_row_chunks(block: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                  chunk: int | None) -> torch.Tensor:
    """block(hidden) for a row-wise `block` mapping [T, H] to [T, H], `chunk` rows at a time."""
    if chunk is None or hidden.shape[0] <= chunk:
        return block(hidden)
    out = hidden.new_empty(hidden.shape)                     # [T, H]
    for r0 in range(0, hidden.shape[0], chunk):
        out[r0:r0 + chunk] = block(hidden[r0:r0 + chunk])
    return out
