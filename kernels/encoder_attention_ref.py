"""Reference encoder attention (plain PyTorch): bidirectional attention within each sequence.

Called by encoder layers (BERT, ViT) through `kernels.ops`. The step's sequences lie one after
another in the token dimension (no padding, as the decoder path lays them); every token attends
to every token of its own sequence and to nothing else (what a padding mask does in a padded
batch). Softmax in fp32, written out; the fast path is kernels/torch_encoder.py.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


def encoder_attention(
    q: torch.Tensor,            # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,            # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,            # [num_tokens, num_kv_heads, head_dim]
    seq_lens: Sequence[int],    # tokens of each sequence, in order; sum == num_tokens
    scale: float,
) -> torch.Tensor:              # [num_tokens, num_heads, head_dim], dtype of q
    assert sum(seq_lens) == q.shape[0], (sum(seq_lens), q.shape)
    group = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    start = 0
    for n in seq_lens:
        qs = q[start:start + n].float().transpose(0, 1)                                  # [H, n, D]
        ks = k[start:start + n].float().transpose(0, 1).repeat_interleave(group, 0)      # [H, n, D]
        vs = v[start:start + n].float().transpose(0, 1).repeat_interleave(group, 0)      # [H, n, D]
        scores = (qs @ ks.transpose(1, 2)) * scale                                       # [H, n, n]
        probs = torch.exp(scores - scores.amax(-1, keepdim=True))
        probs = probs / probs.sum(-1, keepdim=True)
        out[start:start + n] = (probs @ vs).transpose(0, 1).to(q.dtype)                 # [n, H, D]
        start += n
    return out
