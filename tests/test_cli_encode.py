"""`vbatch encode --plugin prithvi`: GeoTIFF tiles in, flood maps out, on a random-weight terratorch folder
(the model's numerics are checked in test_prithvi_model.py). The maps are checked against an oracle
written here: the model run directly (reference ops) on each window as the plugin's docs define them,
the logits blended by the stated weights. Also: georeference and format of the output, nodata,
overlap, batching across files, bad files, resume, shards, kill -9, plain `vbatch encode` records."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import rasterio
import torch
from rasterio.transform import from_origin
from typer.testing import CliRunner

from vbatch.cli.main import app
from vbatch.engine.models.prithvi import PrithviSegmentation
from vbatch.kernels.ops import get_ops

from test_prithvi_model import CFG, random_state  # noqa: E402  (tests/ is on sys.path)
from test_tensor_requests import write_terratorch_folder  # noqa: E402

runner = CliRunner()
MEANS = np.array([0.1412956, 0.13795798, 0.12353792, 0.30902815, 0.2044958, 0.11912015], np.float32)
STDS = np.array([0.07406382, 0.07370365, 0.08692279, 0.11798815, 0.09772074, 0.07659938], np.float32)
CRS = "EPSG:32633"


@pytest.fixture(scope="module")
def state():
    return random_state(seed=11)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, state):
    return write_terratorch_folder(tmp_path_factory.mktemp("prithvi") / "model", state)


@pytest.fixture(scope="module")
def oracle_model(state):
    m = PrithviSegmentation(CFG, get_ops("cpu", None))
    m.load_weights(state.items())
    return m


def write_tile(path, h, w, seed, *, bands=6, nodata_rows=0, dtype="uint16"):
    rng = np.random.default_rng(seed)
    data = (rng.random((bands, h, w)) * 4000 + 100).astype(dtype)
    if nodata_rows:
        data[:, :nodata_rows, :] = 0
    with rasterio.open(path, "w", driver="GTiff", width=w, height=h, count=bands, dtype=dtype, nodata=0, crs=CRS,
                       transform=from_origin(500000 + seed * 1000, 4600000, 10, 10)) as f:
        f.write(data)
    return path


def encode(*args):
    return runner.invoke(app, ["encode", "--plugin", "prithvi", *map(str, args)])


def oracle_probability(model, tile_path, window, overlap):
    """Water probability by the documented rules: windows every window-overlap pixels, the last moved back
    to the edge; weights min(1, (d+1)/(overlap+1)) by distance d to the window's nearer edge; mean logits."""
    with rasterio.open(tile_path) as f:
        raw = f.read().astype(np.float32)
    valid = (raw != 0).all(axis=0)
    x = raw / 10000.0
    x = np.where(valid[None], x, MEANS[:, None, None])
    x = (x - MEANS[:, None, None]) / STDS[:, None, None]
    _, h, w = x.shape

    def starts(n):
        if n <= window:
            return [0]
        s = list(range(0, n - window, window - overlap))
        return s + [n - window]

    def ramp(n):
        if overlap == 0:
            return np.ones(n)
        return np.array([min(1.0, (min(i, n - 1 - i) + 1) / (overlap + 1)) for i in range(n)])

    total, weight = np.zeros((2, h, w)), np.zeros((h, w))
    for r in starts(h):
        for c in starts(w):
            hh, ww = min(window, h), min(window, w)
            tile = torch.from_numpy(np.ascontiguousarray(x[:, r:r + hh, c:c + ww]))[None]
            with torch.no_grad():
                logits = model(tile)[0].double().numpy()
            wt = np.outer(ramp(hh), ramp(ww))
            total[:, r:r + hh, c:c + ww] += logits * wt
            weight[r:r + hh, c:c + ww] += wt
    mean = total / weight
    prob = 1 / (1 + np.exp(mean[0] - mean[1]))
    return prob, valid


def check_map(out_tif, tile_path, prob, valid):
    with rasterio.open(tile_path) as src, rasterio.open(out_tif) as out:
        assert (out.width, out.height, out.count) == (src.width, src.height, 1)
        assert out.crs == src.crs and out.transform == src.transform
        assert out.dtypes == ("uint8",) and out.nodata == 0 and out.compression.value == "LZW"
        got = out.read(1)
        mask = out.read_masks(1)
    assert set(np.unique(got)) <= {0, 255}
    assert (got[~valid] == 0).all() and (mask[~valid] == 0).all() and (mask[valid] == 255).all()
    want = np.where(prob > 0.5, 255, 0)
    clear = valid & (np.abs(prob - 0.5) > 1e-3)        # near-ties may fall either way at fp32
    assert (got[clear] == want[clear]).all()


@pytest.mark.parametrize("window, overlap", [(256, 0), (128, 32)])
def test_maps_match_the_oracle_with_and_without_overlap(tmp_path, model_dir, oracle_model, window, overlap):
    tiles = tmp_path / "tiles"
    tiles.mkdir()
    a = write_tile(tiles / "a.tif", 300, 410, 1, nodata_rows=17)     # not multiples of the window
    b = write_tile(tiles / "b.tif", 90, 70, 2)                       # smaller than a window
    r = encode("--model", model_dir, tiles, "-o", tmp_path / "out", "--window", window, "--overlap", overlap,
               "--probabilities")
    assert r.exit_code == 0, r.output
    for tile in (a, b):
        prob, valid = oracle_probability(oracle_model, tile, window, overlap)
        check_map(tmp_path / "out" / tile.name, tile, prob, valid)
        with rasterio.open(tmp_path / "out" / tile.name.replace(".tif", ".probabilities.tif")) as f:
            got = f.read(1)
            assert f.dtypes == ("float32",) and f.crs == rasterio.crs.CRS.from_string(CRS)
        assert np.isnan(got[~valid]).all()
        np.testing.assert_allclose(got[valid], prob[valid], atol=2e-3)


def test_one_by_one_equals_all_in_one_run(tmp_path, model_dir):
    tiles = tmp_path / "tiles"
    tiles.mkdir()
    paths = [write_tile(tiles / f"t{i}.tif", 130 + 37 * i, 150 + 11 * i, i) for i in range(4)]
    assert encode("--model", model_dir, tiles, "-o", tmp_path / "all", "--window", 128).exit_code == 0
    for p in paths:
        assert encode("--model", model_dir, p, "-o", tmp_path / "one", "--window", 128).exit_code == 0
    for p in paths:
        with rasterio.open(tmp_path / "all" / p.name) as x, rasterio.open(tmp_path / "one" / p.name) as y:
            assert (x.read() == y.read()).all()


def test_bad_files_are_reported_and_the_others_written(tmp_path, model_dir):
    from PIL import Image

    tiles = tmp_path / "tiles"
    tiles.mkdir()
    write_tile(tiles / "good.tif", 64, 80, 3)
    Image.new("RGB", (40, 40)).save(tiles / "photo.tif", format="PNG")          # a PNG renamed .tif
    write_tile(tiles / "rgb.tif", 40, 40, 4, bands=3)                            # too few bands
    (tiles / "empty.tif").write_bytes(b"")
    full = write_tile(tmp_path / "whole.tif", 300, 300, 5).read_bytes()
    (tiles / "cut.tif").write_bytes(full[: len(full) // 3])                      # truncated
    metrics = tmp_path / "m.json"
    r = encode("--model", model_dir, tiles, "-o", tmp_path / "out", "--metrics-json", metrics)
    assert r.exit_code == 1, r.output
    assert sorted(os.listdir(tmp_path / "out")) == [".vbatch-encode.json", "good.tif"]
    errors = {e["input"]: e["error"] for e in json.loads(metrics.read_text())["errors"]}
    assert set(errors) == {"photo.tif", "rgb.tif", "empty.tif", "cut.tif"}
    assert "not a GeoTIFF" in errors["photo.tif"] or "not a readable GeoTIFF" in errors["photo.tif"]
    assert "3 band(s)" in errors["rgb.tif"]
    assert "empty" in errors["empty.tif"]
    assert "truncated or damaged" in errors["cut.tif"] or "not a readable GeoTIFF" in errors["cut.tif"]
    for name in errors:
        assert f"error: {name}:" in r.output
    with rasterio.open(tmp_path / "out" / "good.tif") as f:
        assert f.shape == (64, 80)


def test_band_indices_pick_the_model_bands(tmp_path, model_dir):
    tiles = tmp_path / "tiles"
    tiles.mkdir()
    six = write_tile(tiles / "six.tif", 64, 64, 6)
    with rasterio.open(six) as f:
        data = f.read()
    rng = np.random.default_rng(0)
    thirteen = rng.integers(1, 9000, (13, 64, 64)).astype("uint16")
    order = [1, 2, 3, 8, 11, 12]
    thirteen[order] = data
    with rasterio.open(tiles / "s2.tif", "w", driver="GTiff", width=64, height=64, count=13, dtype="uint16",
                       nodata=0, crs=CRS, transform=from_origin(0, 0, 10, 10)) as f:
        f.write(thirteen)
    assert encode("--model", model_dir, six, "-o", tmp_path / "a").exit_code == 0
    assert encode("--model", model_dir, tiles / "s2.tif", "-o", tmp_path / "b", "--indices", "1,2,3,8,11,12"
                  ).exit_code == 0
    with rasterio.open(tmp_path / "a" / "six.tif") as x, rasterio.open(tmp_path / "b" / "s2.tif") as y:
        assert (x.read() == y.read()).all()


def tile_folder(tmp_path, n, size):
    tiles = tmp_path / "tiles"
    tiles.mkdir()
    for i in range(n):
        write_tile(tiles / f"t{i}.tif", size, size, i)
    return tiles, tmp_path / "out"


def test_rerun_skips_complete_outputs_and_other_options_are_refused(tmp_path, model_dir):
    tiles, out = tile_folder(tmp_path, 3, 64)
    assert encode("--model", model_dir, tiles, "-o", out).exit_code == 0
    stamp = (out / "t0.tif").stat().st_mtime_ns
    (out / "t1.tif").unlink()
    r = encode("--model", model_dir, tiles, "-o", out)
    assert r.exit_code == 0 and "2 outputs already complete" in r.output
    assert (out / "t0.tif").stat().st_mtime_ns == stamp and (out / "t1.tif").is_file()
    r = encode("--model", model_dir, tiles, "-o", out, "--overlap", 16)
    assert r.exit_code == 5 and "another run" in r.output and "options" in r.output
    assert encode("--model", model_dir, tiles, "-o", out, "--overlap", 16, "--overwrite").exit_code == 0
    assert (out / "t0.tif").stat().st_mtime_ns != stamp


def test_shards_split_the_files_and_share_the_folder(tmp_path, model_dir):
    tiles, out = tile_folder(tmp_path, 5, 40)
    assert encode("--model", model_dir, tiles, "-o", out, "--shard", "0/2").exit_code == 0
    assert sorted(p.name for p in out.glob("*.tif")) == ["t0.tif", "t2.tif", "t4.tif"]
    assert encode("--model", model_dir, tiles, "-o", out, "--shard", "1/2").exit_code == 0
    assert sorted(p.name for p in out.glob("*.tif")) == [f"t{i}.tif" for i in range(5)]


def test_preview_and_python_api_request_schema(tmp_path, model_dir, monkeypatch):
    import base64

    from PIL import Image

    from vbatch import LLM

    tile = write_tile(tmp_path / "t.tif", 70, 90, 8, nodata_rows=5)
    assert encode("--model", model_dir, tile, "-o", tmp_path / "out", "--preview").exit_code == 0
    with Image.open(tmp_path / "out" / "t.preview.png") as im:
        assert im.height == 70 and im.width > 2 * 90
    monkeypatch.chdir(tmp_path)
    llm = LLM(str(model_dir), io_processor_plugin="prithvi", quiet=True)
    out = llm.encode([{"data_format": "b64_json", "data": base64.b64encode(tile.read_bytes()).decode(),
                       "out_data_format": "b64_json"},
                      {"data_format": "path", "data": str(tile), "out_data_format": "path",
                       "out_path": str(tmp_path / "api.tif")}])
    assert out[0].outputs.type == "b64_json" and out[0].outputs.format == "tiff"
    with rasterio.io.MemoryFile(base64.b64decode(out[0].outputs.data)) as m, m.open() as a, \
            rasterio.open(tmp_path / "api.tif") as b, rasterio.open(tmp_path / "out" / "t.tif") as c:
        assert (a.read() == b.read()).all() and (b.read() == c.read()).all()
    assert out[1].outputs.nodata_pixels == 5 * 90
    from vbatch.engine.errors import InputError
    with pytest.raises(InputError, match="outside the allowed folders"):
        llm.encode({"data_format": "path", "data": "/etc/hostname"})
    with pytest.raises(InputError, match="fetching it is not allowed"):
        llm.encode({"data_format": "url", "data": "https://example.com/t.tif"})
    with pytest.raises(InputError, match="out_path"):
        llm.encode({"data": str(tile), "out_data_format": "path"})


def test_an_unknown_plugin_lists_the_installed_ones(tmp_path, model_dir):
    r = runner.invoke(app, ["encode", "--plugin", "nosuch", "--model", str(model_dir), str(tmp_path), "-o",
                            str(tmp_path / "o")])
    assert r.exit_code == 2 and "no IO processor plugin named 'nosuch'" in r.output and "prithvi" in r.output


def test_the_model_config_names_its_plugin(tmp_path, state):
    folder = write_terratorch_folder(tmp_path / "m", state, io_processor_plugin="prithvi")
    tile = write_tile(tmp_path / "t.tif", 40, 40, 1)
    r = runner.invoke(app, ["encode", "--model", str(folder), str(tile), "-o", str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "o" / "t.tif").is_file()


def test_kill_9_mid_folder_then_rerun_completes_every_output_once(tmp_path, model_dir):
    tiles = tmp_path / "tiles"
    tiles.mkdir()
    n = 16
    for i in range(n):
        write_tile(tiles / f"t{i:02d}.tif", 256, 256, i)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "vbatch.cli.main", "encode", "--plugin", "prithvi", "--model", str(model_dir),
           str(tiles), "-o", str(out), "--window", "128", "--max-in-flight", "4"]
    env = dict(os.environ, VBATCH_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list(out.glob("t*.tif"))) < 2:
        if proc.poll() is not None:
            pytest.fail(f"the run ended before the kill: {proc.stderr.read().decode()[-2000:]}")
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = sorted(p.name for p in out.glob("t*.tif"))
    assert 2 <= len(before) < n, before
    for name in before:                             # whatever exists under a final name is complete
        with rasterio.open(out / name) as f:
            assert f.read().shape == (1, 256, 256)
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{len(before)} outputs already complete" in done.stderr
    assert sorted(p.name for p in out.glob("t*.tif")) == [f"t{i:02d}.tif" for i in range(n)]
    assert not list(out.glob("*.partial"))
    for i in range(n):
        with rasterio.open(out / f"t{i:02d}.tif") as f:
            assert f.read().shape == (1, 256, 256)


def test_plain_encode_records_without_a_plugin(tmp_path, model_dir):
    rng = np.random.default_rng(0)
    px = rng.standard_normal((6, 32, 48)).astype(np.float32)
    lines = [{"id": "a", "multi_modal_data": {"pixel_values": px.tolist()}},
             {"id": "b", "multi_modal_data": {"pixel_values": [[1.0]]}},
             {"id": "c", "text": "no text for a tile model"}]
    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps(x) + "\n" for x in lines))
    r = runner.invoke(app, ["encode", "--model", str(model_dir), "--task", "plugin", str(inp), "-o",
                            str(tmp_path / "out.jsonl")])
    assert r.exit_code == 1, r.output
    got = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [g["id"] for g in got] == ["a", "b", "c"]
    from vbatch import LLM
    want = LLM(str(model_dir), quiet=True).encode({"multi_modal_data": {"pixel_values": torch.from_numpy(px)}},
                                                  pooling_task="plugin")[0].outputs.data
    np.testing.assert_allclose(np.array(got[0]["data"]), want.numpy(), atol=1e-5)
    assert got[0]["num_tokens"] == 2 * 4 + 1 and got[0]["error"] is None
    assert "pixel_values" in got[1]["error"] and "takes tensors" in got[2]["error"]


def test_a_jsonl_of_terratorch_requests(tmp_path, model_dir):
    import base64

    tiles = tmp_path / "tiles"
    tiles.mkdir()
    a = write_tile(tiles / "a.tif", 60, 70, 1)
    b = write_tile(tiles / "b.tif", 50, 40, 2)
    lines = [json.dumps({"data_format": "path", "data": "tiles/a.tif", "out_data_format": "path",
                         "out_path": "maps/a_flood.tif", "request_id": "first"}),
             json.dumps({"data_format": "b64_json", "data": base64.b64encode(b.read_bytes()).decode(),
                         "out_data_format": "b64_json"}),
             "not json",
             json.dumps({"data_format": "path", "data": "tiles/a.tif", "out_path": "../escape.tif"}),
             json.dumps({"data_format": "path", "data": "tiles/missing.tif", "out_data_format": "path"}),
             json.dumps({"data_format": "b64_json", "data": base64.b64encode(b.read_bytes()).decode(),
                         "out_data_format": "path"})]
    req = tmp_path / "requests.jsonl"
    req.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out"
    r = encode("--model", model_dir, req, a, "-o", out)
    assert r.exit_code == 1, r.output
    got = [json.loads(x) for x in (out / "requests.jsonl").read_text().splitlines()]
    assert [g["line"] for g in got] == [1, 2, 3, 4, 5, 6]
    assert got[5]["error"] is None and got[5]["data"] == str((out / "requests-line6.tif").resolve())
    assert got[0]["error"] is None and got[0]["request_id"] == "first" and got[0]["type"] == "path"
    assert got[0]["data"] == str((out / "maps" / "a_flood.tif").resolve())
    with rasterio.open(out / "maps" / "a_flood.tif") as x, rasterio.open(out / "a.tif") as y:
        assert (x.read() == y.read()).all()
    with rasterio.io.MemoryFile(base64.b64decode(got[1]["data"])) as m, m.open() as f:
        assert f.shape == (50, 40)
    assert "invalid JSON" in got[2]["error"] and "outside the output folder" in got[3]["error"]
    assert "no such file" in got[4]["error"]
    assert "error: requests.jsonl:3:" in r.output
    r = encode("--model", model_dir, req, a, "-o", out)       # the file is the unit of resume
    assert r.exit_code == 1 and "2 outputs already complete" in r.output
    assert "3 requests in complete request-file outputs failed earlier" in r.output


def test_an_output_folder_that_would_overwrite_its_inputs_is_refused(tmp_path, model_dir):
    tile = write_tile(tmp_path / "t.tif", 40, 40, 1)
    before = tile.read_bytes()
    r = encode("--model", model_dir, tile, "-o", tmp_path)
    assert r.exit_code == 2 and "would overwrite it" in r.output
    assert tile.read_bytes() == before


def test_a_second_run_on_the_same_shard_of_a_folder_is_refused(tmp_path, model_dir):
    from vbatch.batch.output_lock import output_lock

    tiles, out = tile_folder(tmp_path, 2, 40)
    out.mkdir()
    with output_lock(str(out / ".vbatch-encode.part-0-of-1")):
        r = encode("--model", model_dir, tiles, "-o", out)
        assert r.exit_code == 6 and "another run is writing this output folder" in r.output
        assert encode("--model", model_dir, tiles, "-o", out, "--shard", "1/2").exit_code == 0   # another shard
    assert encode("--model", model_dir, tiles, "-o", out).exit_code == 0
    assert sorted(p.name for p in out.glob("*.tif")) == ["t0.tif", "t1.tif"] and not list(out.glob(".*.lock"))
