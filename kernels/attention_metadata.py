"""AttentionMetadata: what every attention/KV kernel needs to know about one flattened batch.

Built once per step by the model runner (engine/inputs.py), passed explicitly to the model's
forward and from there to the kernels (no module-global context). Requests are laid out one
after the other in the flat token dimension: request r owns tokens
[query_start_loc[r], query_start_loc[r+1]), which sit at absolute positions
[context_lens[r], seq_lens[r]) of its sequence.

KV cache of one layer: key_cache, value_cache each [num_blocks, block_size, num_kv_heads, head_dim];
token at absolute position p of request r lives in block block_tables[r, p // block_size],
offset p % block_size. slot = block * block_size + offset.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor      # [num_tokens] int64: cache slot of each new token
    query_start_loc: torch.Tensor   # [num_reqs + 1] int32: cumulative query lengths
    seq_lens: torch.Tensor          # [num_reqs] int32: context after this step (computed + new)
    context_lens: torch.Tensor      # [num_reqs] int32: tokens already in the cache before this step
    block_tables: torch.Tensor      # [num_reqs, max_num_blocks] int32, padded with 0
    block_size: int
    max_query_len: int
    max_seq_len: int
    # The same lengths as Python lists: CPU loops read them without a device sync.
    query_lens_list: tuple[int, ...]
    seq_lens_list: tuple[int, ...]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1
