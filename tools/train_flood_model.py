"""Train a small Prithvi-shaped water / no-water segmentation model on synthetic flood scenes (CPU).

    python tools/train_flood_model.py --out sample_data/models/prithvi-flood-tiny --minutes 8 --seed 0

The scenes come from tools/flood_scenes.py (generated on the fly, random crops, flips and
rotations); the network is vbatch's own PrithviSegmentation (terratorch's names) with the plain
PyTorch reference ops (differentiable). Writes into --out: config.json (the terratorch / vLLM
layout, io_processor_plugin "prithvi"), model.safetensors (model.state_dict(), float16 floats)
and README.md (how it was made, held-out water IoU vs the NDWI > 0 baseline); then a few sample
GeoTIFF tiles from held-out seeds into --tiles.

Seeds: training scenes draw their seeds from [10**7, 2**31); the held-out scenes use seeds below
10**6 (final evaluation 100000.., sample tiles 200000.., periodic validation 300000..), so they
never coincide.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import flood_scenes as fs  # noqa: E402

from vbatch.engine.models.prithvi import PrithviSegmentation  # noqa: E402
from vbatch.engine.models.prithvi_config import read_prithvi_config  # noqa: E402
from vbatch.kernels.ops import get_ops  # noqa: E402

EVAL_SEED0, TILE_SEED0, VAL_SEED0 = 100_000, 200_000, 300_000
TRAIN_SEED_LOW = 10 ** 7
# (height, width, nodata strip) of the sample tiles: not multiples of 512, small enough that the
# whole sample_data addition stays a few MB (these tiles hardly compress: ~10 bytes per pixel).
TILES = ((140, 530, False), (520, 130, True), (200, 260, False), (240, 180, False))


def model_args(embed_dim: int, depth: int, heads: int, decoder_channels: int, img_size: int) -> dict:
    return {
        "backbone": "prithvi_eo_tiny",
        "backbone_pretrained": False,
        "backbone_embed_dim": embed_dim,
        "backbone_depth": depth,
        "backbone_num_heads": heads,
        "backbone_img_size": img_size,
        "backbone_bands": list(fs.BANDS),
        "backbone_coords_encoding": [],
        "necks": [{"name": "SelectIndices", "indices": list(range(depth - 4, depth))},
                  {"name": "ReshapeTokensToImage"}],
        "decoder": "UperNetDecoder",
        "decoder_channels": decoder_channels,
        "decoder_scale_modules": True,
        "num_classes": 2,
        "head_dropout": 0.0,
        "rescale": True,
    }


def full_config(args: dict) -> dict:
    return {
        "architectures": ["Terratorch"],
        "io_processor_plugin": "prithvi",
        "pretrained_cfg": {
            "model": {
                "class_path": "terratorch.tasks.SemanticSegmentationTask",
                "init_args": {"model_factory": "EncoderDecoderFactory", "model_args": args},
            },
            "input": {
                "target": "pixel_values",
                "data": {"pixel_values": {"type": "torch.Tensor", "shape": [6, 512, 512]}},
            },
        },
    }


def build_model(config: dict) -> PrithviSegmentation:
    return PrithviSegmentation(read_prithvi_config(config), ops=get_ops("cpu", None))


def init_weights(model: PrithviSegmentation, gen: torch.Generator) -> None:
    """ViT-style init (as Prithvi's MAE): xavier-uniform linears and patch projection, zero biases."""
    with torch.no_grad():
        for name, p in model.encoder.named_parameters():
            if p.dim() >= 2:
                fan_out, fan_in = p.shape[0], p[0].numel()
                bound = math.sqrt(6.0 / (fan_in + fan_out))
                p.uniform_(-bound, bound, generator=gen)
            elif name.endswith("bias"):
                p.zero_()
        model.encoder.cls_token.normal_(0, 0.02, generator=gen)


# ---------------------------------------------------------------------------- data
class ScenePool:
    """A pool of normalised training scenes; one is replaced every `refresh` steps."""

    def __init__(self, rng: np.random.Generator, size: int, scene_px: int, refresh: int) -> None:
        self.rng, self.scene_px, self.refresh = rng, scene_px, refresh
        self.scenes = [self._new() for _ in range(size)]
        self.steps = 0
        self.generated = size

    def _new(self) -> tuple[np.ndarray, np.ndarray]:
        seed = int(self.rng.integers(TRAIN_SEED_LOW, 2 ** 31 - 1))
        refl, water = fs.make_scene(self.scene_px, self.scene_px, seed)
        return fs.normalize(refl), water.astype(np.int64)

    def batch(self, crop: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.steps += 1
        if self.steps % self.refresh == 0:
            self.scenes[int(self.rng.integers(len(self.scenes)))] = self._new()
            self.generated += 1
        xs, ys = [], []
        for _ in range(n):
            x, y = self.scenes[int(self.rng.integers(len(self.scenes)))]
            i = int(self.rng.integers(0, x.shape[1] - crop + 1))
            j = int(self.rng.integers(0, x.shape[2] - crop + 1))
            x, y = x[:, i:i + crop, j:j + crop], y[i:i + crop, j:j + crop]
            k = int(self.rng.integers(4))
            x, y = np.rot90(x, k, axes=(1, 2)), np.rot90(y, k)
            if self.rng.random() < 0.5:
                x, y = x[:, :, ::-1], y[:, ::-1]
            xs.append(np.ascontiguousarray(x))
            ys.append(np.ascontiguousarray(y))
        return torch.from_numpy(np.stack(xs)), torch.from_numpy(np.stack(ys))


def held_out(seed0: int, n: int, px: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [fs.make_scene(px, px, seed0 + i) for i in range(n)]


@torch.no_grad()
def evaluate(model: PrithviSegmentation, scenes) -> dict:
    """Water IoU of the model (argmax) and of NDWI > 0, pooled over the scenes and per-scene mean."""
    was_training = model.training
    model.eval()
    inter = union = b_inter = b_union = 0
    per, per_b = [], []
    for refl, water in scenes:
        truth = water.astype(bool)
        logits = model(torch.from_numpy(fs.normalize(refl))[None])
        pred = logits[0].argmax(0).numpy().astype(bool)
        base = fs.ndwi_water(refl)
        inter += int((pred & truth).sum()); union += int((pred | truth).sum())
        b_inter += int((base & truth).sum()); b_union += int((base | truth).sum())
        per.append(fs.iou(pred, truth)); per_b.append(fs.iou(base, truth))
    model.train(was_training)
    return {"model_iou": inter / max(union, 1), "ndwi_iou": b_inter / max(b_union, 1),
            "model_iou_mean": float(np.mean(per)), "ndwi_iou_mean": float(np.mean(per_b))}


# ---------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, type=Path, help="model folder to write")
    ap.add_argument("--tiles", type=Path, default=Path("sample_data/tiles"), help="sample tiles folder ('' to skip)")
    ap.add_argument("--minutes", type=float, default=8.0, help="training time box (data generation included)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--embed-dim", type=int, default=128)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--decoder-channels", type=int, default=64)
    ap.add_argument("--img-size", type=int, default=512, help="backbone_img_size (the stored position table's grid x 16)")
    ap.add_argument("--eval-scenes", type=int, default=20)
    ap.add_argument("--eval-every", type=float, default=90.0, help="seconds between validation IoUs")
    args = ap.parse_args(argv)

    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    config = full_config(model_args(args.embed_dim, args.depth, args.heads, args.decoder_channels, args.img_size))
    model = build_model(config)
    init_weights(model, gen)
    model.requires_grad_(True)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.02}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.99))
    class_weight = torch.tensor([1.0, 1.5])
    print(f"model: {n_params:,} trainable parameters; training for {args.minutes} min, seed {args.seed}", flush=True)

    val = held_out(VAL_SEED0, 4, 512)
    budget = args.minutes * 60.0
    t0 = time.time()
    pool = ScenePool(rng, size=24, scene_px=384, refresh=2)
    crops = ((128, 8, 0.45), (192, 4, 0.25), (256, 2, 0.2), (320, 2, 0.1))  # (size, batch, probability); batch >= 2 for BatchNorm
    warmup = 40
    step, last_eval, ema = 0, time.time(), None
    while True:
        elapsed = time.time() - t0
        if elapsed >= budget:
            break
        frac = elapsed / budget
        lr = args.lr * min(1.0, (step + 1) / warmup) * max(0.02, 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        size, n, _ = crops[int(rng.choice(len(crops), p=[c[2] for c in crops]))]
        x, y = pool.batch(size, n)
        logits = model(x)
        loss = F.cross_entropy(logits, y, weight=class_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        if step % 25 == 0:
            print(f"step {step:5d}  {elapsed:6.0f}s  lr {lr:.2e}  loss {ema:.4f}  scenes {pool.generated}", flush=True)
        if time.time() - last_eval >= args.eval_every:
            r = evaluate(model, val)
            print(f"  validation (4 held-out 512x512): water IoU model {r['model_iou']:.3f}  ndwi {r['ndwi_iou']:.3f}",
                  flush=True)
            last_eval = time.time()
    train_s = time.time() - t0
    print(f"trained {step} steps in {train_s:.0f}s on {pool.generated} generated scenes", flush=True)

    # ---- save (float16 floats; integer buffers as they are)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    state = {k: (v.detach().to(torch.float16) if v.is_floating_point() else v.detach()).contiguous()
             for k, v in model.state_dict().items()}
    from safetensors.torch import load_file, save_file
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    # ---- check the round trip: a fresh model loads the saved keys strictly
    fresh = build_model(config)
    fresh.load_weights(load_file(str(out / "model.safetensors")).items())
    exact = build_model(config)
    exact.load_weights((k, v) for k, v in model.state_dict().items())
    probe = torch.from_numpy(fs.normalize(val[0][0][:, :200, :300]))[None]
    with torch.no_grad():
        ref = model(probe)
        same = torch.equal(exact(probe), ref)
        half_err = (fresh(probe) - ref).abs().max().item()
    print(f"round trip: fp32 state_dict identical outputs {same}; fp16 file max |logit diff| {half_err:.2e}", flush=True)
    if not same:
        raise SystemExit("state_dict round trip changed the outputs")

    # ---- final held-out evaluation, with the saved (fp16) weights
    t1 = time.time()
    res = evaluate(fresh, held_out(EVAL_SEED0, args.eval_scenes, 512))
    print(f"held-out ({args.eval_scenes} scenes 512x512, seeds {EVAL_SEED0}..{EVAL_SEED0 + args.eval_scenes - 1}): "
          f"water IoU model {res['model_iou']:.3f} (per-scene mean {res['model_iou_mean']:.3f})  "
          f"NDWI>0 {res['ndwi_iou']:.3f} (mean {res['ndwi_iou_mean']:.3f})  [{time.time() - t1:.0f}s]", flush=True)

    cmd = "python tools/train_flood_model.py " + " ".join(sys.argv[1:]) if argv is None else \
        "python tools/train_flood_model.py " + " ".join(argv)
    size_mb = os.path.getsize(out / "model.safetensors") / 1e6
    write_readme(out, config, args, res, step, train_s, n_params, size_mb, cmd, pool.generated)

    if str(args.tiles):
        write_tiles(args.tiles)
    return 0


def write_tiles(folder: Path) -> None:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    seed = TILE_SEED0
    for i, (h, w, nodata) in enumerate(TILES):
        while True:   # the next held-out seed whose scene shows some water (5-50 %)
            refl, water = fs.make_scene(h, w, seed)
            seed += 1
            if 0.05 <= water.mean() <= 0.5:
                break
        mask = None
        if nodata:
            mask = np.zeros((h, w), bool)
            mask[:, :37] = True          # a swath-edge strip of zeros on the left
        name = f"synthetic_flood_{i}_{h}x{w}{'_nodata' if nodata else ''}.tif"
        # tiles side by side, 10 m pixels, UTM 33N
        fs.write_geotiff(folder / name, refl, nodata_mask=mask, origin=(500000.0 + 6000.0 * i, 4600000.0))
        print(f"tile {folder / name}: seed {seed - 1}, water {water.mean():.3f}, NDWI IoU "
              f"{fs.iou(fs.ndwi_water(refl), water.astype(bool)):.3f}", flush=True)


def write_readme(out: Path, config: dict, args, res: dict, steps: int, train_s: float, n_params: int,
                 size_mb: float, cmd: str, scenes: int) -> None:
    ma = config["pretrained_cfg"]["model"]["init_args"]["model_args"]
    text = f"""# prithvi-flood-tiny (synthetic data)

A small Prithvi-EO-2.0-shaped water / no-water segmentation model, trained from scratch on
**synthetic** Sentinel-2-like scenes (tools/flood_scenes.py). It exists so the Prithvi code path
(model loading, the `prithvi` IO plugin, tiling and stitching) can be exercised end to end with
weights that give meaningful masks. **It has never seen real imagery: do not use it for any
decision about real floods.**

## Model

terratorch layout (`config.json`, `architectures: ["Terratorch"]`, `io_processor_plugin: "prithvi"`):
backbone `{ma['backbone']}` overridden to embed_dim {ma['backbone_embed_dim']}, depth {ma['backbone_depth']},
{ma['backbone_num_heads']} heads, patch 16, img_size {ma['backbone_img_size']}, no time / location encoding;
necks SelectIndices {ma['necks'][0]['indices']} + ReshapeTokensToImage; UperNetDecoder with
{ma['decoder_channels']} channels and scale modules; 2 classes (0 no water, 1 water).
{n_params:,} parameters. `model.safetensors` ({size_mb:.1f} MB) holds `model.state_dict()` under
terratorch's names (`encoder.*`, `decoder.*`, `head.head.2.*`, BatchNorm running statistics
included), floating tensors stored as float16.

Input: 6 bands Blue, Green, Red, NIR-narrow, SWIR1, SWIR2 as reflectance 0..1 (files: x 10000),
normalised per band with the Sen1Floods11 means / stds (what the `prithvi` plugin does).

## Training

    {cmd}

{steps} AdamW steps in {train_s / 60:.1f} min on one CPU thread (lr {args.lr}, cosine, class weight
water 1.5, cross-entropy), on random crops of 128-320 px from {scenes} generated 384x384 scenes
(rotations, flips). Training scene seeds are drawn from [10^7, 2^31); held-out seeds are below 10^6.

## Held-out evaluation

{args.eval_scenes} scenes of 512x512, seeds {EVAL_SEED0}..{EVAL_SEED0 + args.eval_scenes - 1}, water IoU pooled over
all pixels (per-scene mean in brackets), with the saved float16 weights:

| method | water IoU |
|---|---|
| this model (argmax) | {res['model_iou']:.3f} ({res['model_iou_mean']:.3f}) |
| NDWI = (G - NIR) / (G + NIR) > 0 | {res['ndwi_iou']:.3f} ({res['ndwi_iou_mean']:.3f}) |

The ground truth counts water under thick cloud (opacity >= 0.5) as no water (what a flood map
can see); the scenes contain NDWI confounders (mud, cloud shadow, asphalt, burnt ground, snow,
turbid water), which is why the baseline is low.

## Sample tiles

`sample_data/tiles/` holds {len(TILES)} 6-band uint16 GeoTIFFs (LZW, nodata 0, EPSG:32633, 10 m)
from held-out seeds (the first ones from {TILE_SEED0} on whose scene is 5-50 % water; sizes in the file
names, H x W, none a multiple of 512; the `_nodata` one has a 37 px strip of zeros on its left).
They are small on purpose: synthetic reflectance with sensor noise hardly compresses (~10 bytes
per pixel with LZW). Larger tiles for tests: `flood_scenes.make_scene(h, w, seed)` +
`flood_scenes.write_geotiff`.
"""
    (out / "README.md").write_text(text)


if __name__ == "__main__":
    raise SystemExit(main())
