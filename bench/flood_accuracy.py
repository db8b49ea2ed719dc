"""Water IoU of a Prithvi flood model through the product path, next to the NDWI > 0 baseline.

    python bench/flood_accuracy.py [--model prithvi-flood-tiny] [--scenes 20] [--size 512] [--no-docs]

Held-out synthetic scenes (tools/flood_scenes.py, seeds 100000.. as the bundled model's README:
training never used seeds below 10**7) are written as GeoTIFFs and mapped by `vbatch encode
--plugin prithvi` (in process: the plugin driver), with and without overlapping windows; the
maps' water (255) is compared with the ground truth, pooled over all pixels (per-scene mean in
brackets). Written to docs/benchmarks.md (section "Flood maps").
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO / "tools"))

from peers_report import machine_facts, write_section  # noqa: E402

SECTION = "## Flood maps: the bundled Prithvi model's water IoU vs NDWI > 0"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="prithvi-flood-tiny")
    ap.add_argument("--scenes", type=int, default=20)
    ap.add_argument("--size", type=int, default=800)
    ap.add_argument("--no-docs", action="store_true")
    args = ap.parse_args(argv)

    import numpy as np
    import rasterio

    import flood_scenes as fs
    from vbatch import LLM
    from vbatch.io_plugins.driver import PluginInput, run_plugin

    work = Path(tempfile.mkdtemp(prefix="vbatch-flood-"))
    truth, ndwi, paths = {}, {}, []
    for i in range(args.scenes):
        reflectance, water = fs.make_scene(args.size, args.size, 100_000 + i)
        path = work / f"scene{i:03d}.tif"
        fs.write_geotiff(path, reflectance)
        truth[path.name], ndwi[path.name] = water.astype(bool), fs.ndwi_water(reflectance)
        paths.append(path)

    def scores(pred: dict) -> tuple[float, float]:
        inter = sum(np.logical_and(pred[k], truth[k]).sum() for k in truth)
        union = sum(np.logical_or(pred[k], truth[k]).sum() for k in truth)
        return inter / union, float(np.mean([fs.iou(pred[k], truth[k]) for k in truth]))

    rows = [("NDWI = (G - NIR) / (G + NIR) > 0", *scores(ndwi))]
    for overlap in (0, 64):
        llm = LLM(args.model, io_processor_plugin="prithvi", quiet=True,
                  io_processor_options={"overlap": overlap, "allowed_local_media_path": [str(work)]})
        out = work / f"maps-{overlap}"
        out.mkdir()
        inputs = [PluginInput(p.name, {"data": str(p), "out_data_format": "path", "out_path": str(out / p.name)})
                  for p in paths]
        for r in run_plugin(llm, llm.io_processor, inputs):
            assert r.ok, r.error
        pred = {}
        for p in paths:
            with rasterio.open(out / p.name) as f:
                pred[p.name] = f.read(1) == 255
        rows.append((f"{args.model}, vbatch encode --plugin prithvi --overlap {overlap}", *scores(pred)))
    lines = ["| method | water IoU, pooled (per-scene mean) |", "|---|---:|"]
    lines += [f"| {name} | {pooled:.3f} ({mean:.3f}) |" for name, pooled, mean in rows]
    table = "\n".join(lines)
    print(table)
    if not args.no_docs:
        facts = machine_facts(REPO)
        body = (f"{SECTION}\n\nCommand: `python bench/flood_accuracy.py {' '.join(argv or sys.argv[1:])}`; commit "
                f"{facts['commit']}; {facts['date']}.\n{args.scenes} held-out synthetic scenes of "
                f"{args.size}x{args.size} (tools/flood_scenes.py, seeds 100000..; clouds, cloud shadow, mud, "
                f"asphalt, burnt ground, snow and turbid water as confounders), mapped through the prithvi "
                f"plugin; the model has never seen real imagery.\n\n{table}\n")
        write_section(REPO / "docs" / "benchmarks.md", SECTION, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
