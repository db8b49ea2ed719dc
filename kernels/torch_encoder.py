"""Fast encoder ops on torch's fused kernels (any device): LayerNorm, GELU, encoder attention.

Chosen by kernels/ops.py for CPU and CUDA; references beside them (layer_norm_ref.py,
activation_ref.py gelu, encoder_attention_ref.py) are the spec and the test oracle.

Encoder attention: the GEMMs around it run on the packed tokens (no padding at all), and only
attention pads. Sequences are sorted by length and cut into groups whose padding stays small;
each group is one `scaled_dot_product_attention` call over a padded [B, H, L, D] batch with a
key-padding mask (torch's fused CPU flash-attention kernel, fp32 softmax). Sequences of one
length (ViT tiles) take a single unmasked call.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

# A group grows while its padded size stays within this factor of its real tokens.
_MAX_PADDING = 1.25
_MAX_GROUP = 256


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def add_layer_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                   eps: float) -> torch.Tensor:
    x += residual              # x is the sublayer's fresh output: summing in place saves a [T, H] tensor
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    return F.gelu(x, approximate=approximate)


def length_groups(seq_lens: Sequence[int]) -> list[list[int]]:
    """Sequence indices grouped for padded attention: sorted by length, padding <= 25% per group."""
    order = sorted(range(len(seq_lens)), key=lambda i: seq_lens[i])
    groups: list[list[int]] = []
    current: list[int] = []
    real = 0
    for i in order:
        n = seq_lens[i]
        # sorted ascending: the newest member is the longest, so the padded size is n * (len + 1)
        if current and (len(current) >= _MAX_GROUP or n * (len(current) + 1) > _MAX_PADDING * (real + n)):
            groups.append(current)
            current, real = [], 0
        current.append(i)
        real += n
    if current:
        groups.append(current)
    return groups


def encoder_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seq_lens: Sequence[int],
                      scale: float) -> torch.Tensor:  # [T, H, D] each -> [T, H, D]
    num_tokens, num_heads, head_dim = q.shape
    enable_gqa = k.shape[1] != num_heads
    if len(set(seq_lens)) == 1:
        b, n = len(seq_lens), seq_lens[0]
        qb, kb, vb = (t.view(b, n, t.shape[1], head_dim).transpose(1, 2) for t in (q, k, v))    # [B, H, n, D]
        out = F.scaled_dot_product_attention(qb, kb, vb, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2).reshape(num_tokens, num_heads, head_dim)
    starts = [0]
    for n in seq_lens:
        starts.append(starts[-1] + n)
    out = torch.empty_like(q)
    for group in length_groups(seq_lens):
        width = max(seq_lens[i] for i in group)
        # Padding slots gather their sequence's first token (a real row, so nothing undefined is read)
        # and the mask keeps them out of every softmax; their query rows are never stored.
        idx = torch.empty((len(group), width), dtype=torch.long)                                # [B, L]
        valid = torch.zeros((len(group), width), dtype=torch.bool)
        for row, i in enumerate(group):
            n = seq_lens[i]
            idx[row, :n] = torch.arange(starts[i], starts[i + 1])
            idx[row, n:] = starts[i]
            valid[row, :n] = True
        idx, valid = idx.to(q.device), valid.to(q.device)
        flat = idx.reshape(-1)
        qb, kb, vb = (t.index_select(0, flat).view(len(group), width, t.shape[1], head_dim).transpose(1, 2)
                      for t in (q, k, v))                                                       # [B, H, L, D]
        mask = valid[:, None, None, :]                                                           # [B, 1, 1, L]
        ob = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale, enable_gqa=enable_gqa)
        out[idx[valid]] = ob.transpose(1, 2)[valid]
    return out
