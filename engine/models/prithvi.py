"""Prithvi-EO-2.0 semantic segmentation (flood mapping): ViT encoder, neck, UperNet decoder, head.

Our own code with terratorch's module and parameter names (docs/design/prithvi.md), so its
checkpoints load with strict key matching: `encoder.*` (PrithviViT), `decoder.*` (UperNet with
its scale modules `fpn1`/`fpn2`), `head.head.2.*`. Built from a `PrithviConfig`
(engine/models/prithvi_config.py). `forward(pixels [B, C, H, W]) -> logits [B, classes, H, W]`:

    pad (reflect, bottom/right) to a multiple of 2 x patch
    encoder:  Conv3d patches + position table (bicubic to the grid) [+ time, location] ; cls ;
              24 pre-norm blocks (LayerNorm, MHSA, GELU MLP through the Ops) ; blocks 5/11/17/23 kept,
              the last one normed
    neck:     drop cls, tokens -> (B, D, h, w) ; fpn1 (x4) / fpn2 (x2) / identity / maxpool (x1/2)
    decoder:  UperNet: laterals, pyramid pooling on the coarsest, top-down sum, 3x3 convs, fuse (stride 4)
    head:     1x1 conv -> classes ; bilinear (align_corners=False) to the padded size ; crop

The ViT blocks go through the Ops (LayerNorm, encoder attention, GELU, packed GEMMs); the
convolutions are torch's (oneDNN on CPU).
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ...kernels.ops import Ops, get_ops
from ..errors import ModelLoadError
from .norm_params import NormParams as _Norm
from .prithvi_config import PrithviConfig
from .weights import check_complete, pickled_tensors


# ---------------------------------------------------------------------------- sin-cos tables
def sincos_1d(dim: int, positions: np.ndarray) -> np.ndarray:
    """[n] positions -> [n, dim]: [sin(p w_k) for k] + [cos(p w_k) for k], w_k = 10000^(-k / (dim/2))."""
    omega = 1.0 / 10000 ** (np.arange(dim // 2, dtype=np.float64) / (dim / 2.0))
    out = np.einsum("m,d->md", positions.reshape(-1).astype(np.float64), omega)
    return np.concatenate([np.sin(out), np.cos(out)], axis=1)


def sincos_3d(dim: int, grid: tuple[int, int, int]) -> torch.Tensor:
    """[1, 1 + t*h*w, dim] float32: a zero cls row, then per token (t, i, j) [E_w(j) | E_h(i) | E_t(t)]
    with widths 6/16, 6/16 and 4/16 of dim."""
    t, h, w = grid
    dw = dh = 6 * dim // 16
    dt = dim - dw - dh
    tt, ii, jj = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
    table = np.concatenate([sincos_1d(dw, jj), sincos_1d(dh, ii), sincos_1d(dt, tt)], axis=1)
    table = np.concatenate([np.zeros((1, dim)), table], axis=0)
    return torch.from_numpy(table).float()[None]


def sincos_coords(dim: int, values: torch.Tensor) -> torch.Tensor:
    """[B] -> [B, dim] in torch (the time / location encoders)."""
    omega = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2.0))
    out = values.double().reshape(-1, 1) * omega
    return torch.cat([torch.sin(out), torch.cos(out)], dim=1).float()


# ---------------------------------------------------------------------------- encoder
class _Scale(nn.Module):
    """A learned scalar (terratorch's TemporalEncoder / LocationEncoder `scale`)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.full((1,), 0.1), requires_grad=False)


class _Attention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)


class _Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)


class _Block(nn.Module):
    def __init__(self, c: PrithviConfig, ops: Ops) -> None:
        super().__init__()
        self.c, self.ops = c, ops
        self.norm1 = _Norm(c.embed_dim)
        self.attn = _Attention(c.embed_dim)
        self.norm2 = _Norm(c.embed_dim)
        self.mlp = _Mlp(c.embed_dim, int(c.embed_dim * c.mlp_ratio))

    def forward(self, x: torch.Tensor, seq_lens: tuple[int, ...]) -> torch.Tensor:  # [B*N, D] -> [B*N, D]
        c, ops, eps = self.c, self.ops, self.c.layer_norm_eps
        t = x.shape[0]
        h = ops.layer_norm(x, self.norm1.weight, self.norm1.bias, eps)
        qkv = self.attn.qkv(h).view(t, 3, c.num_heads, c.head_dim)                           # [T, 3, heads, hd]
        a = ops.encoder_attention(qkv[:, 0], qkv[:, 1], qkv[:, 2], seq_lens, c.head_dim ** -0.5)
        x = x + self.attn.proj(a.reshape(t, c.embed_dim))
        h = ops.layer_norm(x, self.norm2.weight, self.norm2.bias, eps)
        fused = getattr(self.mlp.fc1, "linear_gelu", None)
        inner = fused(h) if fused is not None else ops.gelu(self.mlp.fc1(h))
        return x + self.mlp.fc2(inner)


class _PatchEmbed(nn.Module):
    def __init__(self, c: PrithviConfig) -> None:
        super().__init__()
        self.proj = nn.Conv3d(c.in_chans, c.embed_dim, kernel_size=c.patch_size, stride=c.patch_size)


class PrithviViT(nn.Module):
    def __init__(self, c: PrithviConfig, ops: Ops) -> None:
        super().__init__()
        self.c = c
        p = c.patch_size
        self.grid = (c.num_frames // p[0], c.img_size // p[1], c.img_size // p[2])
        self.cls_token = nn.Parameter(torch.zeros(1, 1, c.embed_dim), requires_grad=False)
        self.register_buffer("pos_embed", sincos_3d(c.embed_dim, self.grid))
        self.patch_embed = _PatchEmbed(c)
        if "time" in c.coords_encoding:
            self.temporal_embed_enc = _Scale()
        if "location" in c.coords_encoding:
            self.location_embed_enc = _Scale()
        self.blocks = nn.ModuleList(_Block(c, ops) for _ in range(c.depth))
        self.norm = _Norm(c.embed_dim)
        self.ops = ops

    def position_table(self, hp: int, wp: int) -> torch.Tensor:  # -> [1, 1 + hp*wp, D]
        _, gh, gw = self.grid
        if (hp, wp) == (gh, gw):
            return self.pos_embed
        d = self.c.embed_dim
        patches = self.pos_embed[:, 1:].reshape(1, gh, gw, d).permute(0, 3, 1, 2)           # [1, D, gh, gw]
        patches = F.interpolate(patches.float(), size=(hp, wp), mode="bicubic", align_corners=True)
        patches = patches.permute(0, 2, 3, 1).reshape(1, hp * wp, d).to(self.pos_embed.dtype)
        return torch.cat([self.pos_embed[:, :1], patches], dim=1)

    def forward(self, pixels: torch.Tensor, temporal_coords: torch.Tensor | None = None,
                location_coords: torch.Tensor | None = None) -> list[torch.Tensor]:
        """[B, C, H, W] -> the selected blocks' outputs, each [B, 1 + L, D]."""
        c = self.c
        b = pixels.shape[0]
        x = self.patch_embed.proj(pixels.unsqueeze(2))                                       # [B, D, 1, hp, wp]
        hp, wp = x.shape[-2:]
        x = x.flatten(2).transpose(1, 2)                                                     # [B, L, D]
        pos = self.position_table(hp, wp)
        x = x + pos[:, 1:]
        half = c.embed_dim // 2
        if temporal_coords is not None and hasattr(self, "temporal_embed_enc"):
            t = temporal_coords.reshape(b, -1, 2)[:, 0]                                      # one frame: (year, doy)
            enc = torch.cat([sincos_coords(half, t[:, 0]), sincos_coords(half, t[:, 1])], dim=1)
            x = x + self.temporal_embed_enc.scale * enc.to(x.dtype)[:, None]
        if location_coords is not None and hasattr(self, "location_embed_enc"):
            loc = location_coords.reshape(b, 2)
            enc = torch.cat([sincos_coords(half, loc[:, 0]), sincos_coords(half, loc[:, 1])], dim=1)
            x = x + self.location_embed_enc.scale * enc.to(x.dtype)[:, None]
        cls = (self.cls_token + pos[:, :1]).expand(b, -1, -1)
        x = torch.cat([cls, x], dim=1)                                                       # [B, 1 + L, D]
        n = x.shape[1]
        flat = x.reshape(b * n, c.embed_dim)
        seq_lens = (n,) * b
        keep = set(c.feature_indices)
        features = []
        for i, block in enumerate(self.blocks):
            flat = block(flat, seq_lens)
            if i in keep:
                out = flat
                if i == c.depth - 1:      # terratorch norms the last block's output only
                    out = self.ops.layer_norm(flat, self.norm.weight, self.norm.bias, c.layer_norm_eps)
                features.append(out.reshape(b, n, c.embed_dim))
            if i >= max(keep):
                break
        return features


# ---------------------------------------------------------------------------- decoder and head
class _ConvModule(nn.Module):
    """Conv2d (no bias) -> BatchNorm2d -> ReLU, named {conv, norm} as terratorch's."""

    def __init__(self, cin: int, cout: int, k: int, padding: int = 0) -> None:
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, k, padding=padding, bias=False)
        self.norm = nn.BatchNorm2d(cout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.norm(self.conv(x)))


def _resize(x: torch.Tensor, size: tuple[int, int], align_corners: bool = True) -> torch.Tensor:
    return F.interpolate(x, size=size, mode="bilinear", align_corners=align_corners)


class UperNetDecoder(nn.Module):
    def __init__(self, c: PrithviConfig) -> None:
        super().__init__()
        d, ch = c.embed_dim, c.decoder_channels
        self.fpn1 = nn.Sequential(nn.ConvTranspose2d(d, d // 2, 2, 2), nn.BatchNorm2d(d // 2), nn.GELU(),
                                  nn.ConvTranspose2d(d // 2, d // 4, 2, 2))
        self.fpn2 = nn.Sequential(nn.ConvTranspose2d(d, d // 2, 2, 2))
        self.fpn3, self.fpn4 = nn.Identity(), nn.MaxPool2d(2, 2)
        widths = [d // 4, d // 2, d, d]
        self.pool_scales = c.pool_scales
        self.psp_modules = nn.ModuleList(nn.Sequential(nn.AdaptiveAvgPool2d(s), _ConvModule(widths[-1], ch, 1))
                                         for s in c.pool_scales)
        self.bottleneck = _ConvModule(widths[-1] + len(c.pool_scales) * ch, ch, 3, padding=1)
        self.lateral_convs = nn.ModuleList(_ConvModule(w, ch, 1) for w in widths[:-1])
        self.fpn_convs = nn.ModuleList(_ConvModule(ch, ch, 3, padding=1) for _ in widths[:-1])
        self.fpn_bottleneck = _ConvModule(len(widths) * ch, ch, 3, padding=1)

    def forward(self, feats: list[torch.Tensor]) -> torch.Tensor:  # 4 x [B, D, h, w] -> [B, ch, 4h, 4w]
        x = [self.fpn1(feats[0]), self.fpn2(feats[1]), self.fpn3(feats[2]), self.fpn4(feats[3])]
        top = x[3]
        pooled = [top] + [_resize(m(top), top.shape[2:]) for m in self.psp_modules]
        laterals = [conv(x[i]) for i, conv in enumerate(self.lateral_convs)] + [self.bottleneck(torch.cat(pooled, 1))]
        for i in range(len(laterals) - 1, 0, -1):
            laterals[i - 1] = laterals[i - 1] + _resize(laterals[i], laterals[i - 1].shape[2:])
        outs = [conv(laterals[i]) for i, conv in enumerate(self.fpn_convs)] + [laterals[-1]]
        size = outs[0].shape[2:]
        outs = [outs[0]] + [_resize(o, size) for o in outs[1:]]
        return self.fpn_bottleneck(torch.cat(outs, 1))


class SegmentationHead(nn.Module):
    def __init__(self, c: PrithviConfig) -> None:
        super().__init__()
        self.head = nn.Sequential(nn.Identity(), nn.Dropout(0.0), nn.Conv2d(c.decoder_channels, c.num_classes, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


class PrithviSegmentation(nn.Module):
    def __init__(self, config: PrithviConfig, ops: Ops | None = None) -> None:
        super().__init__()
        self.config = config
        self.ops = ops if ops is not None else get_ops("cpu", torch.float32)
        self.encoder = PrithviViT(config, self.ops)
        self.decoder = UperNetDecoder(config)
        self.head = SegmentationHead(config)
        self.channels_last = False       # the decoder's layout (finalize_weights picks it)
        self.requires_grad_(False)
        self.eval()

    @property
    def pad_multiple(self) -> int:
        return 2 * self.config.patch_size[1]

    def num_patches(self, height: int, width: int) -> int:
        """The scheduling cost of one tile: its tokens through the encoder (patches + cls)."""
        m, p = self.pad_multiple, self.config.patch_size[1]
        return (math.ceil(height / m) * m // p) * (math.ceil(width / m) * m // p) + 1

    def forward(self, pixels: torch.Tensor, temporal_coords: torch.Tensor | None = None,
                location_coords: torch.Tensor | None = None) -> torch.Tensor:  # [B, C, H, W] -> [B, classes, H, W]
        h, w = pixels.shape[-2:]
        m = self.pad_multiple
        ph, pw = (m - h % m) % m, (m - w % m) % m
        # Reflect as terratorch does; a tile smaller than its padding repeats its edge instead.
        mode = "reflect" if ph < h and pw < w else "replicate"
        padded = F.pad(pixels, (0, pw, 0, ph), mode=mode) if ph or pw else pixels
        feats = self.encoder(padded, temporal_coords, location_coords)
        grid = (padded.shape[-2] // self.config.patch_size[1], padded.shape[-1] // self.config.patch_size[2])
        images = [f[:, 1:].transpose(1, 2).reshape(f.shape[0], f.shape[2], *grid) for f in feats]  # [B, D, h, w]
        if self.channels_last:
            images = [x.contiguous(memory_format=torch.channels_last) for x in images]
        logits = self.head(self.decoder(images))
        if self.config.rescale and logits.shape[-2:] != padded.shape[-2:]:
            logits = _resize(logits, padded.shape[-2:], align_corners=False)
        return logits[..., :h, :w]

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """terratorch's names, strictly: every parameter and buffer exactly once (pos_embed may be
        absent: ours is the same table); `model.` prefixes and `_timm_module.` are dropped, and the
        scale modules load from `decoder.fpn*` or, in newer checkpoints, `neck.2.fpn*`."""
        expected = dict(self.state_dict(keep_vars=True))
        loaded: set[str] = set()
        unexpected: list[str] = []
        for raw, tensor in weights:
            name = canonical_name(raw)
            if name not in expected:
                unexpected.append(raw)
                continue
            target = expected[name]
            if tuple(tensor.shape) != tuple(target.shape):
                raise ModelLoadError(f"tensor {raw} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
            target.copy_(tensor.to(target.dtype))
            loaded.add(name)
        check_complete(unexpected, set(expected) - loaded - {"encoder.pos_embed"})

    @torch.no_grad()
    def finalize_weights(self) -> None:
        # oneDNN's convolutions run ~25% faster on NHWC (measured here: the 300M decoder, 2 threads).
        if next(self.decoder.parameters()).device.type == "cpu":
            self.decoder.to(memory_format=torch.channels_last)
            self.head.to(memory_format=torch.channels_last)
            self.channels_last = True
        for block in self.encoder.blocks:
            block.attn.qkv = self.ops.pack_linear(block.attn.qkv)
            block.attn.proj = self.ops.pack_linear(block.attn.proj)
            block.mlp.fc1 = self.ops.pack_linear(block.mlp.fc1)
            block.mlp.fc2 = self.ops.pack_linear(block.mlp.fc2)


def canonical_name(name: str) -> str:
    name = name.replace("_timm_module.", "")
    name = name.removeprefix("model.")
    if name.startswith("neck.2.fpn"):
        name = "decoder." + name[len("neck.2."):]
    return name


def checkpoint_weights(path: Path) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) of a Lightning .ckpt/.pt (its `state_dict`), a bare state dict, or safetensors;
    pickles only through `torch.load(weights_only=True)` (never arbitrary code)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file
        yield from load_file(str(path)).items()
        return
    yield from pickled_tensors(path)
