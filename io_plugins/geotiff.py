"""GeoTIFF in and out for the segmentation plugins (rasterio): open and check a tile, read windows of
its bands as reflectance, write flood maps as vLLM's pipeline does, and a preview picture.

    scene = open_scene(source, indices, name)      # checks: a raster, enough bands, not empty
    block, valid = scene.read(window)              # [bands, h, w] float32 reflectance, [h, w] bool
    class_map_bytes(classes, scene.profile, valid)              # 1 band uint8, LZW, same georeference
    probability_map_bytes(prob, scene.profile, valid)           # 1 band float32, NaN where nodata
    preview_png(rgb, classes, valid)                            # PNG: RGB | mask, side by side

Reflectance: integer files (Sentinel-2 L1C/L2A digital numbers) and float files whose mean is
above 1 hold reflectance x 10000 and are divided by 10000; float files in 0..1 are used as they
are. The decision is made once per file (from a decimated read), never per window, so every
window of a file is scaled the same way.

Nodata: a pixel is nodata when any selected band is masked (the file's nodata value or its mask
band). The output map writes 0 there, like no-water (vLLM's format, nodata tag 0), and every map
carries an internal mask that is 0 only there, so GIS tools (and `read_masks`, for which the mask
wins over the tag) tell nodata from dry land.
Outputs are built in memory; the plugin writes them with `batch/atomic_file.write_file_atomically`
(`.partial`, then renamed): a crash never leaves a half-written map under its final name.
"""
from __future__ import annotations

import io
import os
import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..engine.errors import InputError

WATER = 255


@dataclass(frozen=True)
class Window:
    row: int
    col: int
    height: int
    width: int


class Scene:
    """An open raster with its selected bands (0-based `indices`); close() when done."""

    def __init__(self, dataset: Any, indices: tuple[int, ...], name: str, scale: float,
                 keep_open: Any = None) -> None:
        self.dataset, self.indices, self.name, self.scale = dataset, indices, name, scale
        self._keep_open = keep_open          # a MemoryFile behind a b64 input
        d = dataset
        self.height, self.width = d.height, d.width
        self.profile = {"crs": d.crs, "transform": d.transform, "width": d.width, "height": d.height}

    def read(self, w: Window) -> tuple[np.ndarray, np.ndarray]:
        """([bands, h, w] float32 reflectance, [h, w] bool valid) of one window."""
        from rasterio.windows import Window as RWindow

        bands = [i + 1 for i in self.indices]
        win = RWindow(w.col, w.row, w.width, w.height)
        try:
            data = self.dataset.read(bands, window=win, out_dtype="float32")
            masks = self.dataset.read_masks(bands, window=win)
        except Exception as e:  # noqa: BLE001  rasterio/GDAL read errors (a truncated file)
            cause = e.__cause__ if e.__cause__ is not None else e
            raise InputError(f"the file is truncated or damaged: reading its pixels at row {w.row}, column "
                             f"{w.col} failed ({str(cause).splitlines()[0] if str(cause) else type(cause).__name__})",
                             file=self.name) from None
        valid = np.all(masks > 0, axis=0) & np.all(np.isfinite(data), axis=0)
        if self.scale != 1.0:
            data *= self.scale
        return data, valid

    def close(self) -> None:
        self.dataset.close()
        if self._keep_open is not None:
            self._keep_open.close()


def open_scene(source: str | bytes, indices: tuple[int, ...] | None, num_bands: int, name: str) -> Scene:
    """Open a GeoTIFF (a path, or its bytes) and check it can feed a `num_bands`-band model."""
    import rasterio
    from rasterio.errors import NotGeoreferencedWarning, RasterioIOError

    memfile = None
    try:
        if isinstance(source, bytes):
            from rasterio.io import MemoryFile
            memfile = MemoryFile(source)
            dataset = memfile.open()
        else:
            if os.path.isfile(source) and os.path.getsize(source) == 0:
                raise InputError("the file is empty (0 bytes)", file=name)
            with warnings.catch_warnings():      # a tile without georeference is still a tile
                warnings.simplefilter("ignore", NotGeoreferencedWarning)
                dataset = rasterio.open(source)
    except InputError:
        raise
    except (RasterioIOError, OSError, ValueError) as e:
        if memfile is not None:
            memfile.close()
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise InputError(f"not a readable GeoTIFF: {why}", file=name) from None
    try:
        if dataset.driver != "GTiff":
            raise InputError(f"not a GeoTIFF (GDAL reads it as {dataset.driver})", file=name)
        if dataset.width < 1 or dataset.height < 1:
            raise InputError("the raster is empty (0 pixels)", file=name)
        chosen = tuple(range(num_bands)) if indices is None else tuple(indices)
        if len(chosen) != num_bands:
            raise InputError(f"indices selects {len(chosen)} bands; the model reads {num_bands}",
                             file=name, field="indices")
        if dataset.count <= max(chosen):
            need = "the first " + str(num_bands) if indices is None else f"band index {max(chosen)} (0-based)"
            raise InputError(f"has {dataset.count} band(s); the model needs {need}", file=name, field="indices",
                             hint="select bands with --indices / 'indices' (0-based)")
        scale = _reflectance_scale(dataset, chosen, name)
    except BaseException:
        dataset.close()
        if memfile is not None:
            memfile.close()
        raise
    return Scene(dataset, chosen, name, scale, keep_open=memfile)


def _reflectance_scale(dataset: Any, indices: tuple[int, ...], name: str) -> float:
    if all(np.issubdtype(np.dtype(dataset.dtypes[i]), np.integer) for i in indices):
        return 1e-4
    h, w = min(dataset.height, 256), min(dataset.width, 256)
    try:                                         # a decimated look at the whole file
        sample = dataset.read([i + 1 for i in indices], out_shape=(len(indices), h, w), masked=True)
    except Exception as e:  # noqa: BLE001
        raise InputError(f"cannot read pixels: {e}", file=name) from None
    values = sample.compressed()
    values = values[np.isfinite(values)]
    return 1e-4 if values.size and float(values.mean()) > 1.0 else 1.0


# ---------------------------------------------------------------------------- outputs
def _geotiff_bytes(array: np.ndarray, profile: dict, valid: np.ndarray | None, nodata: float) -> bytes:
    """[h, w] -> the bytes of a 1-band LZW GeoTIFF with `profile`'s georeference and an internal mask."""
    from rasterio.io import MemoryFile

    meta = dict(driver="GTiff", count=1, dtype=array.dtype.name, nodata=nodata, compress="lzw",
                height=array.shape[0], width=array.shape[1], crs=profile["crs"], transform=profile["transform"])
    if array.shape[0] >= 256 and array.shape[1] >= 256:
        meta.update(tiled=True, blockxsize=256, blockysize=256)
    with MemoryFile() as mem:
        with mem.open(**meta) as out:
            out.write(array, 1)
            # Always a mask: with the nodata tag 0 alone, a GIS would hide every no-water pixel too.
            out.write_mask(np.full(array.shape, 255, np.uint8) if valid is None
                           else np.where(valid, 255, 0).astype(np.uint8))
        return mem.read()


def class_map_bytes(classes: np.ndarray, profile: dict, valid: np.ndarray | None) -> bytes:
    """uint8 [h, w] (0 no water, 255 water; other class maps as their indices), nodata 0."""
    return _geotiff_bytes(classes.astype(np.uint8), profile, valid, nodata=0)


def probability_map_bytes(prob: np.ndarray, profile: dict, valid: np.ndarray | None) -> bytes:
    """float32 [h, w] water probability, NaN (the nodata value) where the input had no data."""
    prob = prob.astype(np.float32)
    if valid is not None:
        prob = np.where(valid, prob, np.float32(np.nan))
    return _geotiff_bytes(prob, profile, valid, nodata=float("nan"))


def preview_png(rgb: np.ndarray, classes: np.ndarray, valid: np.ndarray | None, max_side: int = 1024) -> bytes:
    """The picture people look at: true colour (2-98% stretch) beside the map (water blue, nodata grey)."""
    from PIL import Image

    h, w = classes.shape
    lo, hi = np.nanpercentile(rgb, 2), np.nanpercentile(rgb, 98)
    colour = np.clip((rgb - lo) / max(hi - lo, 1e-6), 0, 1)
    colour = (np.nan_to_num(colour).transpose(1, 2, 0) * 255).astype(np.uint8)          # [h, w, 3]
    mask = np.full((h, w, 3), 235, np.uint8)
    mask[classes == WATER] = (20, 90, 200)
    if valid is not None:
        mask[~valid] = (128, 128, 128)
        colour[~valid] = (128, 128, 128)
    gap = np.full((h, max(4, w // 64), 3), 255, np.uint8)
    image = Image.fromarray(np.concatenate([colour, gap, mask], axis=1))
    if max(image.size) > max_side:
        factor = max_side / max(image.size)
        image = image.resize((max(1, int(image.width * factor)), max(1, int(image.height * factor))),
                             Image.Resampling.NEAREST)
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()
