"""The bundled default model (sample_data/models/prithvi-flood-tiny) maps water on held-out synthetic
scenes through the product path (`vbatch encode --plugin prithvi`, no --model), clearly better than
the NDWI > 0 baseline, and the sample tiles it ships with give maps."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import rasterio
from typer.testing import CliRunner

from vbatch.cli.main import app

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import flood_scenes as fs  # noqa: E402

runner = CliRunner()
SEEDS = range(400_000, 400_004)       # held out: training seeds are >= 10**7 (tools/train_flood_model.py)


@pytest.fixture(scope="module")
def scenes(tmp_path_factory):
    folder = tmp_path_factory.mktemp("scenes")
    out = {}
    for seed in SEEDS:
        reflectance, truth = fs.make_scene(512, 640, seed)
        path = folder / f"s{seed}.tif"
        fs.write_geotiff(path, reflectance)
        out[path] = (reflectance, truth.astype(bool))
    return folder, out


def pooled_iou(pairs):
    inter = sum(np.logical_and(p, t).sum() for p, t in pairs)
    union = sum(np.logical_or(p, t).sum() for p, t in pairs)
    return inter / union


@pytest.mark.parametrize("overlap", [0, 64])
def test_the_default_model_beats_ndwi_on_held_out_scenes(tmp_path, scenes, overlap):
    folder, data = scenes
    r = runner.invoke(app, ["encode", "--plugin", "prithvi", str(folder), "-o", str(tmp_path / "maps"),
                            "--overlap", str(overlap)])
    assert r.exit_code == 0, r.output
    model, ndwi = [], []
    for path, (reflectance, truth) in data.items():
        with rasterio.open(tmp_path / "maps" / path.name) as f:
            pred = f.read(1) == 255
        model.append((pred, truth))
        ndwi.append((fs.ndwi_water(reflectance), truth))
    ours, baseline = pooled_iou(model), pooled_iou(ndwi)
    print(f"overlap {overlap}: water IoU {ours:.3f}, NDWI > 0 {baseline:.3f}")
    assert ours >= 0.85 and ours >= baseline + 0.1


def test_the_sample_tiles_map(tmp_path):
    r = runner.invoke(app, ["encode", "--plugin", "prithvi", str(REPO / "sample_data" / "tiles"), "-o",
                            str(tmp_path / "flood"), "--preview"])
    assert r.exit_code == 0, r.output
    tiles = sorted((REPO / "sample_data" / "tiles").glob("*.tif"))
    assert len(tiles) >= 3
    for t in tiles:
        with rasterio.open(t) as src, rasterio.open(tmp_path / "flood" / t.name) as out:
            assert out.shape == src.shape and out.crs == src.crs
            water = (out.read(1) == 255).mean()
        assert 0.01 < water < 0.7, (t.name, water)
        assert (tmp_path / "flood" / t.name.replace(".tif", ".preview.png")).is_file()
