"""Prithvi segmentation model: terratorch's key names load strictly, and the forward equals an
independent implementation of the same equations written here with plain torch functions
(docs/design/prithvi.md), on a small random-weight configuration (no public small weights exist)."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vbatch.engine.errors import ModelLoadError, UnsupportedModelError
from vbatch.engine.models.prithvi import PrithviSegmentation, canonical_name, sincos_3d
from vbatch.engine.models.prithvi_config import PrithviConfig, read_prithvi_config
from vbatch.kernels.ops import get_ops

D, HEADS, DEPTH, CH, C, CLASSES, IMG = 64, 4, 4, 32, 6, 2, 64
CFG = PrithviConfig(embed_dim=D, depth=DEPTH, num_heads=HEADS, in_chans=C, img_size=IMG, feature_indices=(0, 1, 2, 3),
                    decoder_channels=CH, num_classes=CLASSES)


def keys_and_shapes(prefix="model."):
    """The checkpoint's (name, shape) list for CFG, written from terratorch's layout (not from our modules)."""
    g = IMG // 16
    out = [("encoder.cls_token", (1, 1, D)), ("encoder.pos_embed", (1, 1 + g * g, D)),
           ("encoder.patch_embed.proj.weight", (D, C, 1, 16, 16)), ("encoder.patch_embed.proj.bias", (D,)),
           ("encoder.temporal_embed_enc.scale", (1,)), ("encoder.location_embed_enc.scale", (1,))]
    for i in range(DEPTH):
        b = f"encoder.blocks.{i}."
        out += [(b + "norm1.weight", (D,)), (b + "norm1.bias", (D,)), (b + "attn.qkv.weight", (3 * D, D)),
                (b + "attn.qkv.bias", (3 * D,)), (b + "attn.proj.weight", (D, D)), (b + "attn.proj.bias", (D,)),
                (b + "norm2.weight", (D,)), (b + "norm2.bias", (D,)), (b + "mlp.fc1.weight", (4 * D, D)),
                (b + "mlp.fc1.bias", (4 * D,)), (b + "mlp.fc2.weight", (D, 4 * D)), (b + "mlp.fc2.bias", (D,))]
    out += [("encoder.norm.weight", (D,)), ("encoder.norm.bias", (D,))]

    def bn(name, n):
        return [(f"{name}.weight", (n,)), (f"{name}.bias", (n,)), (f"{name}.running_mean", (n,)),
                (f"{name}.running_var", (n,)), (f"{name}.num_batches_tracked", ())]

    def conv_module(name, cin, k):
        return [(f"{name}.conv.weight", (CH, cin, k, k))] + bn(f"{name}.norm", CH)
    out += [("decoder.fpn1.0.weight", (D, D // 2, 2, 2)), ("decoder.fpn1.0.bias", (D // 2,))] + bn("decoder.fpn1.1", D // 2)
    out += [("decoder.fpn1.3.weight", (D // 2, D // 4, 2, 2)), ("decoder.fpn1.3.bias", (D // 4,)),
            ("decoder.fpn2.0.weight", (D, D // 2, 2, 2)), ("decoder.fpn2.0.bias", (D // 2,))]
    for i in range(4):
        out += conv_module(f"decoder.psp_modules.{i}.1", D, 1)
    out += conv_module("decoder.bottleneck", D + 4 * CH, 3)
    for i, w in enumerate((D // 4, D // 2, D)):
        out += conv_module(f"decoder.lateral_convs.{i}", w, 1)
    for i in range(3):
        out += conv_module(f"decoder.fpn_convs.{i}", CH, 3)
    out += conv_module("decoder.fpn_bottleneck", 4 * CH, 3)
    out += [("head.head.2.weight", (CLASSES, CH, 1, 1)), ("head.head.2.bias", (CLASSES,))]
    return [(prefix + k, s) for k, s in out]


def random_state(seed=0, prefix="model."):
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in keys_and_shapes(prefix):
        if name.endswith("num_batches_tracked"):
            state[name] = torch.tensor(7)
        elif name.endswith("running_var"):
            state[name] = torch.rand(shape, generator=g) + 0.5
        elif name.endswith("pos_embed"):
            state[name] = sincos_table_by_hand(D, IMG // 16)
        elif name.endswith(("norm1.weight", "norm2.weight", "norm.weight")) and "decoder" not in name:
            state[name] = 1 + 0.1 * torch.randn(shape, generator=g)
        else:
            fan_in = math.prod(shape[1:]) if len(shape) > 1 else 16
            state[name] = torch.randn(shape, generator=g) / math.sqrt(fan_in)
    return state


def sincos_table_by_hand(dim, g):
    """The 3-D sin-cos table from its definition, one entry at a time (an oracle for sincos_3d)."""
    dw = dh = 6 * dim // 16
    dt = dim - dw - dh
    rows = [[0.0] * dim]
    for i in range(g):
        for j in range(g):
            row = []
            for width, p in ((dw, j), (dh, i), (dt, 0)):
                half = width // 2
                row += [math.sin(p / 10000 ** (k / half)) for k in range(half)]
                row += [math.cos(p / 10000 ** (k / half)) for k in range(half)]
            rows.append(row)
    return torch.tensor(rows, dtype=torch.float32)[None]


# ---------------------------------------------------------------------------- the independent forward
def reference_forward(s, pixels, location=None):
    """Prithvi segmentation from the equations (docs/design/prithvi.md), plain torch functions only."""
    e = lambda k: s["model.encoder." + k]
    d = lambda k: s["model.decoder." + k]
    b, _, h, w = pixels.shape
    ph, pw = (-h) % 32, (-w) % 32
    x = F.pad(pixels, (0, pw, 0, ph), mode="reflect") if ph or pw else pixels
    H, W = x.shape[-2:]
    hp, wp = H // 16, W // 16
    t = F.conv3d(x[:, :, None], e("patch_embed.proj.weight"), e("patch_embed.proj.bias"), stride=(1, 16, 16))
    t = t.flatten(2).transpose(1, 2)                                                     # [B, L, D]
    pos = e("pos_embed")
    g = int(math.isqrt(pos.shape[1] - 1))
    if (hp, wp) != (g, g):
        grid = pos[:, 1:].reshape(1, g, g, D).permute(0, 3, 1, 2)
        grid = F.interpolate(grid, size=(hp, wp), mode="bicubic", align_corners=True)
        pos = torch.cat([pos[:, :1], grid.permute(0, 2, 3, 1).reshape(1, hp * wp, D)], 1)
    t = t + pos[:, 1:]
    if location is not None:
        def enc(v, dim):
            om = 1.0 / 10000 ** (torch.arange(dim // 2, dtype=torch.float64) / (dim / 2))
            a = v.double()[:, None] * om
            return torch.cat([a.sin(), a.cos()], 1).float()
        t = t + e("location_embed_enc.scale") * torch.cat([enc(location[:, 0], D // 2), enc(location[:, 1], D // 2)], 1)[:, None]
    t = torch.cat([e("cls_token").expand(b, -1, -1) + pos[:, :1], t], 1)
    feats = []
    for i in range(DEPTH):
        p = f"blocks.{i}."
        y = F.layer_norm(t, (D,), e(p + "norm1.weight"), e(p + "norm1.bias"), 1e-5)
        qkv = F.linear(y, e(p + "attn.qkv.weight"), e(p + "attn.qkv.bias")).reshape(b, -1, 3, HEADS, D // HEADS)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(D // HEADS), -1) @ v
        t = t + F.linear(a.transpose(1, 2).reshape(b, -1, D), e(p + "attn.proj.weight"), e(p + "attn.proj.bias"))
        y = F.layer_norm(t, (D,), e(p + "norm2.weight"), e(p + "norm2.bias"), 1e-5)
        y = F.linear(F.gelu(F.linear(y, e(p + "mlp.fc1.weight"), e(p + "mlp.fc1.bias"))), e(p + "mlp.fc2.weight"),
                     e(p + "mlp.fc2.bias"))
        t = t + y
        feats.append(F.layer_norm(t, (D,), e("norm.weight"), e("norm.bias"), 1e-5) if i == DEPTH - 1 else t)
    imgs = [f[:, 1:].transpose(1, 2).reshape(b, D, hp, wp) for f in feats]

    def bn(z, name):
        return F.batch_norm(z, s[name + ".running_mean"], s[name + ".running_var"], s[name + ".weight"],
                            s[name + ".bias"], False, 0.0, 1e-5)

    def cm(z, name, pad=0):
        return F.relu(bn(F.conv2d(z, s[name + ".conv.weight"], padding=pad), name + ".norm"))
    dec = "model.decoder."
    f1 = F.conv_transpose2d(imgs[0], d("fpn1.0.weight"), d("fpn1.0.bias"), stride=2)
    f1 = F.conv_transpose2d(F.gelu(bn(f1, dec + "fpn1.1")), d("fpn1.3.weight"), d("fpn1.3.bias"), stride=2)
    f2 = F.conv_transpose2d(imgs[1], d("fpn2.0.weight"), d("fpn2.0.bias"), stride=2)
    f3, f4 = imgs[2], F.max_pool2d(imgs[3], 2)
    up = lambda z, size: F.interpolate(z, size=size, mode="bilinear", align_corners=True)
    ppm = [f4] + [up(cm(F.adaptive_avg_pool2d(f4, sc), dec + f"psp_modules.{i}.1"), f4.shape[2:])
                  for i, sc in enumerate((1, 2, 3, 6))]
    lat = [cm(z, dec + f"lateral_convs.{i}") for i, z in enumerate((f1, f2, f3))] + [cm(torch.cat(ppm, 1), dec + "bottleneck", 1)]
    for i in (3, 2, 1):
        lat[i - 1] = lat[i - 1] + up(lat[i], lat[i - 1].shape[2:])
    outs = [cm(lat[i], dec + f"fpn_convs.{i}", 1) for i in range(3)] + [lat[3]]
    fused = cm(torch.cat([outs[0]] + [up(o, outs[0].shape[2:]) for o in outs[1:]], 1), dec + "fpn_bottleneck", 1)
    logits = F.conv2d(fused, s["model.head.head.2.weight"], s["model.head.head.2.bias"])
    logits = F.interpolate(logits, size=(H, W), mode="bilinear", align_corners=False)
    return logits[..., :h, :w]


@pytest.fixture(scope="module")
def state():
    return random_state()


@pytest.fixture(scope="module", params=["reference", "cpu"])
def model(request, state):
    ops = get_ops("cpu", None) if request.param == "reference" else get_ops("cpu", torch.float32)
    m = PrithviSegmentation(CFG, ops)
    m.load_weights(state.items())
    m.finalize_weights()
    return m


def test_the_position_table_is_the_sincos_definition():
    torch.testing.assert_close(sincos_3d(D, (1, 4, 4)), sincos_table_by_hand(D, 4), atol=1e-6, rtol=0)


@pytest.mark.parametrize("size", [(64, 64), (96, 128), (70, 45)])
def test_forward_equals_the_independent_implementation(model, state, size):
    g = torch.Generator().manual_seed(1)
    pixels = torch.randn(2, C, *size, generator=g)
    with torch.inference_mode():
        got = model(pixels)
    want = reference_forward(state, pixels)
    assert got.shape == (2, CLASSES, *size)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


def test_location_coordinates_enter_as_the_encoder_reads_them(model, state):
    pixels = torch.randn(1, C, 64, 64, generator=torch.Generator().manual_seed(2))
    loc = torch.tensor([[45.5, -73.6]])
    with torch.inference_mode():
        got = model(pixels, location_coords=loc)
    torch.testing.assert_close(got, reference_forward(state, pixels, location=loc), atol=2e-4, rtol=2e-4)
    assert not torch.allclose(got, model(pixels))


def test_checkpoint_layouts_all_load_strictly(state):
    bare = {k.removeprefix("model."): v for k, v in state.items()}
    newer = {k.replace("model.decoder.fpn", "model.neck.2.fpn"): v for k, v in state.items()}
    no_pos = {k: v for k, v in state.items() if not k.endswith("pos_embed")}
    timm = {k.replace("encoder.blocks", "encoder._timm_module.blocks"): v for k, v in state.items()}
    outputs = []
    pixels = torch.randn(1, C, 64, 64, generator=torch.Generator().manual_seed(3))
    for layout in (state, bare, newer, no_pos, timm):
        m = PrithviSegmentation(CFG, get_ops("cpu", None))
        m.load_weights(layout.items())
        outputs.append(m(pixels))
    for o in outputs[1:]:
        torch.testing.assert_close(o, outputs[0])
    assert canonical_name("model.neck.2.fpn1.0.weight") == "decoder.fpn1.0.weight"


def test_strict_loading_names_what_does_not_fit(state):
    m = PrithviSegmentation(CFG, get_ops("cpu", None))
    missing = {k: v for k, v in state.items() if "fpn_convs.1.conv" not in k}
    with pytest.raises(ModelLoadError, match="missing from the checkpoint: decoder.fpn_convs.1.conv.weight"):
        m.load_weights(missing.items())
    extra = dict(state, **{"model.aux_heads.0.weight": torch.zeros(1)})
    with pytest.raises(ModelLoadError, match="unexpected tensors in the checkpoint: model.aux_heads.0.weight"):
        m.load_weights(extra.items())
    wrong = dict(state, **{"model.head.head.2.weight": torch.zeros(3, CH, 1, 1)})
    with pytest.raises(ModelLoadError, match=r"model.head.head.2.weight has shape \(3, 32, 1, 1\), expected \(2, 32, 1, 1\)"):
        m.load_weights(wrong.items())


def test_config_from_the_terratorch_model_args():
    args = {"backbone": "prithvi_eo_v2_300_tl", "backbone_bands": ["BLUE", "GREEN", "RED", "NIR_NARROW", "SWIR_1", "SWIR_2"],
            "decoder": "UperNetDecoder", "decoder_channels": 256, "decoder_scale_modules": True, "num_classes": 2,
            "rescale": True, "head_dropout": 0.1,
            "necks": [{"name": "SelectIndices", "indices": [5, 11, 17, 23]}, {"name": "ReshapeTokensToImage"}]}
    cfg = read_prithvi_config({"architectures": ["Terratorch"], "pretrained_cfg": {"model": {"init_args": {"model_args": args}}}})
    assert (cfg.embed_dim, cfg.depth, cfg.num_heads, cfg.in_chans, cfg.feature_indices) == (1024, 24, 16, 6, (5, 11, 17, 23))
    small = dict(args, backbone_embed_dim=64, backbone_depth=4, backbone_num_heads=4,
                 necks=[{"name": "SelectIndices", "indices": [0, 1, 2, 3]}, {"name": "ReshapeTokensToImage"},
                        {"name": "LearnedInterpolateToPyramidal"}], decoder_scale_modules=False)
    cfg = read_prithvi_config({"pretrained_cfg": {"model": {"init_args": {"model_args": small}}}})
    assert (cfg.embed_dim, cfg.depth, cfg.scale_modules) == (64, 4, True)
    with pytest.raises(UnsupportedModelError, match="backbone 'resnet50' is not supported"):
        read_prithvi_config({"pretrained_cfg": {"model": {"init_args": {"model_args": dict(args, backbone="resnet50")}}}})
    with pytest.raises(UnsupportedModelError, match="neck 'Foo' is not supported"):
        read_prithvi_config({"pretrained_cfg": {"model": {"init_args": {"model_args": dict(args, necks=[{"name": "Foo"}])}}}})


def test_full_size_key_count_matches_the_released_checkpoint():
    """The 300M TL Sen1Floods11 layout: 381 tensors, 319,177,489 elements (docs/design/prithvi.md)."""
    with torch.device("meta"):
        m = PrithviSegmentation(PrithviConfig(), get_ops("cpu", None))
    state = m.state_dict()
    assert len(state) == 381
    assert sum(t.numel() for t in state.values()) == 319_177_489


class _NotATensor:
    """A pickled object a weights_only load must refuse (it could have run code)."""


def test_checkpoint_files_load_safely(tmp_path, state):
    from safetensors.torch import save_file
    from vbatch.engine.models.prithvi import checkpoint_weights
    torch.save({"state_dict": state, "epoch": 41, "hyper_parameters": {"lr": 1e-3, "bands": ["BLUE"]}},
               tmp_path / "lightning.ckpt")
    torch.save({k.removeprefix("model."): v for k, v in state.items()}, tmp_path / "bare.pt")
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "w.safetensors"))
    pixels = torch.randn(1, C, 64, 64, generator=torch.Generator().manual_seed(4))
    outs = []
    for name in ("lightning.ckpt", "bare.pt", "w.safetensors"):
        m = PrithviSegmentation(CFG, get_ops("cpu", None))
        m.load_weights(checkpoint_weights(tmp_path / name))
        outs.append(m(pixels))
    torch.testing.assert_close(outs[0], outs[1])
    torch.testing.assert_close(outs[0], outs[2])
    torch.save({"state_dict": state, "evil": _NotATensor()}, tmp_path / "unsafe.ckpt")
    with pytest.raises(ModelLoadError, match=r"holds Python objects besides tensors \(Unsupported global: GLOBAL "
                                             r"test_prithvi_model._NotATensor\), and checkpoints load with weights_only"):
        list(checkpoint_weights(tmp_path / "unsafe.ckpt"))
