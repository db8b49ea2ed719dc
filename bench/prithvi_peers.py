"""Prithvi flood mapping: vbatch's plugin path against the same model run eagerly, one tile at a time, in fp32.

    python bench/prithvi_peers.py [--size 300m|tiny] [--tiles 6] [--tile-size 1024] [--repeats 3]
                                  [--threads 2] [--no-docs]

Both systems go from GeoTIFF files to flood-map GeoTIFFs on the same tiles, threads and model weights,
alternating in one process:
  vbatch   the prithvi plugin over all files in one engine run (`run_plugin`, what `vbatch encode`
           does): windows batched across files, packed GEMMs, the Ops' LayerNorm / attention / GELU
  eager    what vLLM's plugin path does per call: read the file, reflect-pad to a multiple of 512,
           each 512 x 512 window one forward of the model with plain torch modules (nn.Linear,
           F.layer_norm, SDPA, exact GELU; terratorch's layers), argmax, stitch, write
The model: `--size 300m` is Prithvi-EO-2.0-300M-TL-Sen1Floods11's exact shape with random weights
(the released weights cannot be downloaded here; speed does not depend on the values), `tiny` the
bundled prithvi-flood-tiny. Tiles come from tools/flood_scenes.py (synthetic Sentinel-2-like scenes).

Also printed: the encoder's rate (GFLOP/s from its analytic FLOPs, timed on one batch of windows)
as a fraction of this machine's fp32 GEMM rate (bench/ceilings.py's measurement, at the encoder's
own GEMM shape). Results go to docs/benchmarks.md (section "Prithvi <size>").
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tools"))

from peers_report import machine_facts, write_section  # noqa: E402

SECTION = "## Prithvi {size}: vbatch encode --plugin prithvi vs the same model eagerly, one tile at a time"

MODEL_300M = {"backbone": "prithvi_eo_v2_300_tl", "backbone_pretrained": False,
              "backbone_bands": ["BLUE", "GREEN", "RED", "NIR_NARROW", "SWIR_1", "SWIR_2"],
              "necks": [{"name": "SelectIndices", "indices": [5, 11, 17, 23]}, {"name": "ReshapeTokensToImage"}],
              "decoder": "UperNetDecoder", "decoder_channels": 256, "decoder_scale_modules": True,
              "num_classes": 2, "head_dropout": 0.1, "rescale": True}


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def model_folder(size: str, work: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    from vbatch.engine.models.prithvi import PrithviSegmentation
    from vbatch.engine.models.prithvi_config import read_prithvi_config
    from vbatch.engine.models.resolve import resolve_model
    from vbatch.kernels.ops import get_ops

    if size == "tiny":
        return resolve_model("prithvi-flood-tiny").path
    folder = work / "prithvi-300m-random"
    folder.mkdir()
    config = {"architectures": ["Terratorch"],
              "pretrained_cfg": {"model": {"class_path": "terratorch.tasks.SemanticSegmentationTask",
                                           "init_args": {"model_args": MODEL_300M}}}}
    (folder / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    with torch.no_grad():
        m = PrithviSegmentation(read_prithvi_config(config), get_ops("cpu", None))
        for p in m.parameters():
            p.normal_(0, 0.02)
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(folder / "model.safetensors"))
    return folder


def write_tiles(folder: Path, n: int, size: int) -> list[Path]:
    from flood_scenes import make_scene, write_geotiff

    folder.mkdir()
    paths = []
    for i in range(n):
        reflectance, _ = make_scene(size, size, seed=9000 + i)
        paths.append(folder / f"tile{i:02d}.tif")
        write_geotiff(paths[-1], reflectance)
    return paths


class EagerPipeline:
    """vLLM's per-call path, in plain torch: pad to 512, one window per forward, fp32, argmax, stitch."""

    def __init__(self, folder: Path) -> None:
        from vbatch.engine.models.hf_config import load_hf_config
        from vbatch.engine.models.prithvi import PrithviSegmentation
        from vbatch.engine.models.prithvi_config import read_prithvi_config
        from vbatch.engine.models.weights import iter_weights
        from vbatch.kernels.ops import _ENCODER_FAST, REFERENCE_OPS

        eager = dataclasses.replace(REFERENCE_OPS, name="torch-eager", **_ENCODER_FAST)
        self.model = PrithviSegmentation(read_prithvi_config(load_hf_config(folder)), eager)
        self.model.load_weights(iter_weights(folder))          # nn.Linear kept as it is: no packing

    def run(self, tiles: list[Path], out: Path) -> int:
        import numpy as np
        import rasterio
        import torch
        import torch.nn.functional as F

        from vbatch.io_plugins.prithvi import SEN1FLOODS11_MEANS, SEN1FLOODS11_STDS

        means = torch.tensor(SEN1FLOODS11_MEANS)[:, None, None]
        stds = torch.tensor(SEN1FLOODS11_STDS)[:, None, None]
        windows = 0
        for path in tiles:
            with rasterio.open(path) as src:
                x = torch.from_numpy(src.read(list(range(1, 7))).astype(np.float32)) / 10000.0
                profile = src.profile
            x = (x - means) / stds
            h, w = x.shape[1:]
            ph, pw = (-h) % 512, (-w) % 512
            x = F.pad(x[None], (0, pw, 0, ph), mode="reflect")[0]
            pred = torch.zeros(x.shape[1:], dtype=torch.uint8)
            with torch.inference_mode():
                for r in range(0, x.shape[1], 512):
                    for c in range(0, x.shape[2], 512):
                        logits = self.model(x[None, :, r:r + 512, c:c + 512])
                        pred[r:r + 512, c:c + 512] = logits[0].argmax(0).to(torch.uint8)
                        windows += 1
            mask = (pred[:h, :w].numpy() * 255).astype(np.uint8)
            profile.update(count=1, dtype="uint8", nodata=0, compress="lzw")
            with rasterio.open(out / path.name, "w", **profile) as dst:
                dst.write(mask, 1)
        return windows


def encoder_fraction(llm, threads: int, rows: int) -> tuple[float, float, float]:
    """(encoder GFLOP/s, GEMM GFLOP/s at the encoder's shape, fraction) on one batch of 512 x 512 windows."""
    import torch

    from vbatch.cli.bench_ceilings import measure_gemm_gflops

    model = llm.engine.runner.model
    c = model.config
    n = model.num_patches(512, 512)
    batch = max(1, rows // n)
    x = torch.randn(batch, c.in_chans, 512, 512)
    with torch.inference_mode():
        model.encoder(x)
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            model.encoder(x)
            times.append(time.perf_counter() - t0)
    depth = max(c.feature_indices) + 1
    d = c.embed_dim
    hidden = int(d * c.mlp_ratio)
    flops = batch * depth * (2 * n * d * (3 * d + d + 2 * hidden) + 4 * n * n * d)
    rate = flops / min(times) / 1e9
    torch.set_num_threads(threads)
    # The best of three measurements: on a shared machine interference only ever slows one down.
    gemm = max(measure_gemm_gflops("float32", (batch * n, d, hidden)) for _ in range(3))
    return rate, gemm, rate / gemm


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=("300m", "tiny"), default="300m")
    ap.add_argument("--tiles", type=int, default=6)
    ap.add_argument("--tile-size", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-docs", action="store_true")
    args = ap.parse_args(argv)

    import numpy as np
    import rasterio
    import torch

    from vbatch import LLM
    from vbatch.io_plugins.driver import PluginInput, run_plugin

    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="vbatch-prithvi-bench-"))
    folder = model_folder(args.size, work)
    tiles = write_tiles(work / "tiles", args.tiles, args.tile_size)
    llm = LLM(str(folder), io_processor_plugin="prithvi", num_threads=args.threads, quiet=True,
              io_processor_options={"allowed_local_media_path": [str(work)]})
    eager = EagerPipeline(folder)
    say(f"model {args.size} ({folder}); ops {llm.engine.runner.ops.name}; {args.tiles} tiles of "
        f"{args.tile_size}x{args.tile_size}; {args.threads} threads")

    def run_vbatch(out: Path) -> int:
        before = llm.stats.num_requests
        inputs = [PluginInput(t.name, {"data": str(t), "out_data_format": "path", "out_path": str(out / t.name)})
                  for t in tiles]
        for r in run_plugin(llm, llm.io_processor, inputs):
            assert r.ok, r.error
        return llm.stats.num_requests - before

    systems = {"vbatch": run_vbatch, "eager fp32, one window per call": lambda out: eager.run(tiles, out)}
    times: dict[str, list[float]] = {k: [] for k in systems}
    windows: dict[str, int] = {}
    for rep in range(args.repeats):
        order = list(systems) if rep % 2 == 0 else list(systems)[::-1]
        for name in order:
            out = work / f"out-{rep}-{name.split()[0]}"
            out.mkdir()
            torch.set_num_threads(args.threads)
            t0 = time.perf_counter()
            windows[name] = systems[name](out)
            dt = time.perf_counter() - t0
            times[name].append(dt)
            say(f"rep {rep + 1} {name}: {args.tiles / dt:.3f} tiles/s ({windows[name]} windows)")
    agree = []
    for t in tiles:
        with rasterio.open(work / "out-0-vbatch" / t.name) as a, rasterio.open(work / "out-0-eager" / t.name) as b:
            agree.append(float(np.mean(a.read(1) == b.read(1))))
    rate = {k: args.tiles / statistics.median(v) for k, v in times.items()}
    ratio = rate["vbatch"] / rate["eager fp32, one window per call"]
    enc, gemm, frac = encoder_fraction(llm, args.threads, rows=llm.engine.runner.model.sub_batch_cost)
    lines = ["| system | tiles/s (median) | windows per tile | vbatch ÷ it |", "|---|---:|---:|---:|"]
    for k in sorted(rate, key=rate.get, reverse=True):
        lines.append(f"| {k} | {rate[k]:.3f} | {windows[k] / args.tiles:.1f} | {rate['vbatch'] / rate[k]:.2f}x |")
    table = "\n".join(lines)
    print(table)
    print(f"vbatch / eager: {ratio:.2f}x; encoder {enc:.1f} GFLOP/s = {frac:.0%} of the fp32 GEMM rate "
          f"({gemm:.1f} GFLOP/s); maps agree on {min(agree):.4%} of pixels (min over tiles)")
    if not args.no_docs:
        facts = machine_facts(REPO)
        section = SECTION.format(size=args.size)
        body = (f"{section}\n\nCommand: `python bench/prithvi_peers.py {' '.join(argv or sys.argv[1:])}`; commit "
                f"{facts['commit']}; {facts['date']}; {facts['cpu']} ({facts['isa']}), {args.threads} threads; "
                f"ops {llm.engine.runner.ops.name}.\nModel: {args.size} "
                f"({'Prithvi-EO-2.0-300M-TL-Sen1Floods11 shape, random weights' if args.size == '300m' else 'bundled'})"
                f"; {args.tiles} synthetic tiles of {args.tile_size}x{args.tile_size} (tools/flood_scenes.py), "
                f"GeoTIFF in, flood-map GeoTIFF out; {args.repeats} repetitions, systems alternating. vbatch windows "
                f"are placed inside the scene (none padded), the eager path pads the scene to a multiple of 512 "
                f"as vLLM's does; the maps agree on {min(agree):.2%} of pixels or more.\n\n{table}\n\n"
                f"**vbatch ÷ eager fp32: {ratio:.2f}x.** Encoder: {enc:.1f} GFLOP/s = **{frac:.0%} of this "
                f"machine's fp32 GEMM rate** ({gemm:.1f} GFLOP/s at the encoder's shape; target 50%).\n")
        write_section(REPO / "docs" / "benchmarks.md", section, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
