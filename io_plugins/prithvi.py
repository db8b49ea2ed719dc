"""The `prithvi` IO processor plugin: GeoTIFF tiles in, flood-map GeoTIFFs out (Prithvi-EO-2.0 segmentation).

    vbatch encode --plugin prithvi --model DIR tiles/ -o flood/            # the CLI (cli/encode.py)
    LLM(DIR, io_processor_plugin="prithvi").encode({"data_format": "path", "data": "tile.tif", ...})

Input: a path (str / Path), or the request schema users know from terratorch's vLLM plugin:
`{"data_format": "path" | "url" | "b64_json", "data": ..., "out_data_format": "path" | "b64_json",
"out_path": file or folder, "indices": [0-based band indices] | null}`. Paths are read only under
the allowed folders (option `allowed_local_media_path`, default the working directory), URLs only
from `allowed_media_domains` (default none: no network).

Per input (io_plugins/geotiff.py, io_plugins/tiling.py):
    pre_process    open and check the file; choose bands (default the model's first N); reflectance
                   (/10000 for digital numbers); nodata filled with the band mean; Sen1Floods11
                   normalisation (or the model folder's means/stds); one prompt per window
                   (`window` 512, `overlap` 0), yielded lazily, a window read only when the engine has room
    post_process   blend the windows' logits, argmax, write the map (1 band uint8, water 255, LZW, the
                   input's CRS / transform / size, nodata kept out of the mask), optionally the water
                   probability (`probabilities`: `<name>.probabilities.tif`, float32) and a PNG
                   (`preview`: `<name>.preview.png`), side files first, the map last (its presence
                   means the input is complete)
State per input lives in the PluginContext (the open file, its windows, its nodata mask), never here.
"""
from __future__ import annotations

import base64
import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..engine.errors import ConfigError, InputError
from ..engine.pooling_params import PoolingParams
from ..batch.atomic_file import write_file_atomically
from .geotiff import WATER, Scene, class_map_bytes, open_scene, preview_png, probability_map_bytes
from .interface import IOProcessor, PluginConfig, PluginContext
from .tiling import LogitCanvas, window_grid

# Sen1Floods11 band statistics (reflectance 0..1; Blue, Green, Red, NIR narrow, SWIR 1, SWIR 2).
SEN1FLOODS11_MEANS = (0.1412956, 0.13795798, 0.12353792, 0.30902815, 0.2044958, 0.11912015)
SEN1FLOODS11_STDS = (0.07406382, 0.07370365, 0.08692279, 0.11798815, 0.09772074, 0.07659938)
DATA_FORMATS = ("path", "url", "b64_json")
OUT_FORMATS = ("path", "b64_json")


def register() -> str:
    return "vbatch.io_plugins.prithvi:PrithviFloodPlugin"


@dataclass(frozen=True)
class PrithviOptions:
    window: int = 512
    overlap: int = 0
    indices: tuple[int, ...] | None = None
    probabilities: bool = False
    preview: bool = False
    allowed_local_media_path: tuple[str, ...] = ()
    allowed_media_domains: tuple[str, ...] = ()

    @classmethod
    def from_dict(cls, options: dict[str, Any]) -> "PrithviOptions":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ConfigError(unknown[0], f"is not an option of the prithvi plugin (options: {', '.join(sorted(names))})")
        values = dict(options)
        for key in ("indices", "allowed_local_media_path", "allowed_media_domains"):
            if values.get(key) is not None:
                values[key] = tuple(values[key])
        o = cls(**values)
        if not isinstance(o.window, int) or o.window < 32:
            raise ConfigError("window", f"must be an integer >= 32 pixels, got {o.window!r}")
        if not isinstance(o.overlap, int) or not 0 <= o.overlap <= o.window // 2:
            raise ConfigError("overlap", f"must be an integer from 0 to half the window ({o.window // 2}), "
                              f"got {o.overlap!r}")
        if o.indices is not None:
            _check_indices(o.indices, "indices", ConfigError)
        return o


def _check_indices(indices: Any, field: str, error: type) -> tuple[int, ...]:
    if not isinstance(indices, (list, tuple)) or not indices or \
            not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in indices):
        message = f"must be a list of 0-based band indices, got {indices!r}"
        raise error(field, message) if error is ConfigError else error(message, field=field)
    return tuple(indices)


@dataclass(frozen=True)
class SegmentationRequest:
    """A parsed input (terratorch's schema)."""

    data_format: str
    data: str
    out_data_format: str = "b64_json"
    out_path: str | None = None
    indices: tuple[int, ...] | None = None

    @property
    def name(self) -> str:
        return self.data if self.data_format != "b64_json" else "<b64_json input>"


@dataclass(frozen=True)
class SegmentationOutput:
    """What post_process returns: the map's path, or its bytes in base64 (terratorch's `type`/`format`/`data`)."""

    type: str                       # "path" | "b64_json"
    data: str                       # the written path, or the GeoTIFF in base64
    format: str = "tiff"
    request_id: str | None = None
    height: int = 0
    width: int = 0
    num_windows: int = 0
    water_fraction: float = 0.0     # of the valid pixels
    nodata_pixels: int = 0
    probabilities: str | None = None   # path or base64 of the probability GeoTIFF
    preview: str | None = None         # path or base64 of the PNG


def _find_stats(tree: Any, key: str, n: int) -> tuple[float, ...] | None:
    """The first list of `n` numbers under `key` anywhere in the model config (terratorch data modules)."""
    if isinstance(tree, dict):
        value = tree.get(key)
        if isinstance(value, list) and len(value) == n and all(isinstance(v, (int, float)) for v in value):
            return tuple(float(v) for v in value)
        for v in tree.values():
            found = _find_stats(v, key, n)
            if found is not None:
                return found
    elif isinstance(tree, list):
        for v in tree:
            found = _find_stats(v, key, n)
            if found is not None:
                return found
    return None


class PrithviFloodPlugin(IOProcessor[SegmentationRequest, SegmentationOutput]):
    name = "prithvi"
    default_model = "prithvi-flood-tiny"          # the bundled synthetic-data model (sample_data/models)
    input_suffixes = (".tif", ".tiff")            # what `vbatch encode` looks for in folders

    def __init__(self, config: PluginConfig) -> None:
        super().__init__(config)
        from ..engine.models.prithvi_config import read_prithvi_config

        if config.hf_config is None:
            raise ConfigError("plugin", "the prithvi plugin needs a Prithvi model (a terratorch config.json)")
        model = read_prithvi_config(config.hf_config)
        self.num_bands, self.num_classes = model.in_chans, model.num_classes
        self.options = PrithviOptions.from_dict(dict(config.options))
        cfg = config.hf_config.to_dict() if hasattr(config.hf_config, "to_dict") else dict(config.hf_config)
        means = _find_stats(cfg.get("pretrained_cfg"), "means", self.num_bands)
        stds = _find_stats(cfg.get("pretrained_cfg"), "stds", self.num_bands)
        if means is None or stds is None:
            if self.num_bands != len(SEN1FLOODS11_MEANS):
                raise ConfigError("plugin", f"the model reads {self.num_bands} bands but its config.json has no "
                                  "means/stds to normalise them (Sen1Floods11's are for 6 bands)")
            means, stds = SEN1FLOODS11_MEANS, SEN1FLOODS11_STDS
        self.means = np.asarray(means, np.float32)[:, None, None]
        self.stds = np.asarray(stds, np.float32)[:, None, None]
        allowed = self.options.allowed_local_media_path or (os.getcwd(),)
        self.allowed_dirs = tuple(Path(p).resolve() for p in allowed)

    # ------------------------------------------------------------------ requests
    def parse_data(self, data: object) -> SegmentationRequest:
        if isinstance(data, (str, os.PathLike)):
            return SegmentationRequest("path", os.fspath(data))
        if not isinstance(data, dict):
            raise InputError(f"must be a path or a request object, got {type(data).__name__}", field="data")
        known = {"data_format", "data", "out_data_format", "out_path", "indices", "request_id"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InputError(f"is not a field of a prithvi request (fields: {', '.join(sorted(known))})",
                             field=unknown[0])
        fmt = data.get("data_format", "path")
        if fmt not in DATA_FORMATS:
            raise InputError(f"must be one of {', '.join(DATA_FORMATS)}, got {fmt!r}", field="data_format")
        if not isinstance(data.get("data"), str) or not data["data"]:
            raise InputError("must be a non-empty string (a path, a URL or base64 GeoTIFF bytes)", field="data")
        out = data.get("out_data_format", "b64_json")
        if out not in OUT_FORMATS:
            raise InputError(f"must be one of {', '.join(OUT_FORMATS)}, got {out!r}", field="out_data_format")
        out_path = data.get("out_path")
        if out == "path" and not (isinstance(out_path, str) and out_path):
            raise InputError("is needed with out_data_format 'path' (a file, or a folder to write into)",
                             field="out_path")
        indices = data.get("indices")
        if indices is not None:
            indices = _check_indices(indices, "indices", InputError)
        return SegmentationRequest(fmt, data["data"], out, out_path, indices)

    def merge_pooling_params(self, params: PoolingParams | None = None) -> PoolingParams:
        return params or PoolingParams(task="plugin")

    def _source(self, req: SegmentationRequest) -> str | bytes:
        if req.data_format == "b64_json":
            try:
                return base64.b64decode(req.data, validate=True)
            except ValueError:
                raise InputError("is not valid base64", field="data") from None
        if req.data_format == "url":
            return self._fetch(req.data)
        path = Path(req.data).resolve()
        if not any(path == d or d in path.parents for d in self.allowed_dirs):
            raise InputError(f"{req.data} is outside the allowed folders "
                             f"({', '.join(str(d) for d in self.allowed_dirs)})", field="data",
                             hint="allow its folder with --allowed-local-media-path / allowed_local_media_path")
        if not path.exists():
            raise InputError("no such file", file=req.data)
        return str(path)

    def _fetch(self, url: str) -> bytes:
        from urllib.parse import urlparse
        from urllib.request import urlopen

        host = urlparse(url).hostname or ""
        if urlparse(url).scheme not in ("http", "https") or host not in self.options.allowed_media_domains:
            raise InputError(f"{url}: fetching it is not allowed (allowed domains: "
                             f"{', '.join(self.options.allowed_media_domains) or 'none'})", field="data",
                             hint="allow the host with the allowed_media_domains option")
        try:
            with urlopen(url, timeout=60) as r:      # noqa: S310  (scheme and host checked above)
                return r.read()
        except OSError as e:
            raise InputError(f"cannot fetch {url}: {e}", field="data") from None

    def pre_process(self, prompt: SegmentationRequest, request_id: str | None = None, *,
                    context: PluginContext | None = None, **kwargs: Any) -> Iterator[dict]:
        indices = prompt.indices if prompt.indices is not None else self.options.indices
        scene = open_scene(self._source(prompt), indices, self.num_bands, prompt.name)
        context.add_closer(scene.close)
        windows = window_grid(scene.height, scene.width, self.options.window, self.options.overlap)
        context.state.update(request=prompt, scene=scene, windows=windows, valid=None)
        return self._prompts(scene, windows, context)

    def _prompts(self, scene: Scene, windows: list, context: PluginContext) -> Iterator[dict]:
        import torch

        for w in windows:
            data, valid = scene.read(w)                                                   # [C, h, w], [h, w]
            if not valid.all():
                full = context.state["valid"]
                if full is None:
                    full = context.state["valid"] = np.ones((scene.height, scene.width), bool)
                full[w.row:w.row + w.height, w.col:w.col + w.width] &= valid
                data = np.where(valid[None], data, self.means)       # nodata -> the band mean (0 once normalised)
            x = (data - self.means) / self.stds
            yield {"multi_modal_data": {"pixel_values": torch.from_numpy(np.ascontiguousarray(x, np.float32))}}

    # ------------------------------------------------------------------ outputs
    def post_process(self, model_output, request_id: str | None = None, *,
                     context: PluginContext | None = None, **kwargs: Any) -> SegmentationOutput:
        st = context.state
        scene, windows, req, valid = st["scene"], st["windows"], st["request"], st["valid"]
        canvas = LogitCanvas(self.num_classes, scene.height, scene.width, self.options.overlap)
        for w, out in zip(windows, model_output):
            canvas.add(w, out.outputs.data.numpy())
        logits = canvas.result()                                                          # [classes, H, W]
        best = logits.argmax(axis=0)
        classes = np.where(best == 1, WATER, 0).astype(np.uint8) if self.num_classes == 2 else best.astype(np.uint8)
        if valid is not None:
            classes[~valid] = 0
        n_valid = int(valid.sum()) if valid is not None else classes.size
        water = float((classes == WATER)[valid if valid is not None else slice(None)].sum()) / max(1, n_valid)

        side: dict[str, bytes] = {}
        if self.options.probabilities:
            shifted = logits - logits.max(axis=0, keepdims=True)
            prob = np.exp(shifted[1]) / np.exp(shifted).sum(axis=0)
            side["probabilities"] = probability_map_bytes(prob, scene.profile, valid)
        if self.options.preview:
            side["preview"] = self._preview(scene, classes, valid)
        main = class_map_bytes(classes, scene.profile, valid)

        result = dict(request_id=request_id, height=scene.height, width=scene.width, num_windows=len(windows),
                      water_fraction=water, nodata_pixels=classes.size - n_valid)
        if req.out_data_format == "b64_json":
            extra = {k: base64.b64encode(v).decode() for k, v in side.items()}
            return SegmentationOutput("b64_json", base64.b64encode(main).decode(), **result, **extra)
        target = self.output_path(req)
        if req.data_format == "path" and target.resolve() == Path(req.data).resolve():
            raise InputError(f"the output {target} would overwrite the input", field="out_path",
                             hint="write the maps into another folder")
        stem = target.with_suffix("") if target.suffix.lower() in (".tif", ".tiff") else target
        written: dict[str, str] = {}
        for key, data in side.items():         # side files first: the map's presence means all are done
            path = f"{stem}.{key}.tif" if key == "probabilities" else f"{stem}.preview.png"
            write_file_atomically(path, data)
            written[key] = path
        write_file_atomically(str(target), main)
        return SegmentationOutput("path", str(target), **result, **written)

    @staticmethod
    def output_path(req: SegmentationRequest) -> Path:
        out = Path(req.out_path)
        if req.out_path.endswith(os.sep) or out.is_dir():
            name = Path(req.data).name if req.data_format == "path" else "output.tif"
            return out / name
        return out

    def _preview(self, scene: Scene, classes: np.ndarray, valid: np.ndarray | None) -> bytes:
        """RGB (the selected Red, Green, Blue: bands 2, 1, 0 of the model's order) read decimated."""
        step = max(1, -(-max(scene.height, scene.width) // 1024))
        h, w = -(-scene.height // step), -(-scene.width // step)
        bands = [scene.indices[i] + 1 for i in (2, 1, 0)]
        rgb = scene.dataset.read(bands, out_shape=(3, h, w), out_dtype="float32") * scene.scale
        small = classes[::step, ::step][:h, :w]
        small_valid = None if valid is None else valid[::step, ::step][:h, :w]
        return preview_png(rgb, small, small_valid)
