"""PrithviConfig: the numbers of a Prithvi-EO-2.0 segmentation model, read from the folder users have.

The folder is vLLM / terratorch's (docs/design/prithvi.md section 6): a `config.json` with
`architectures: ["Terratorch"]` and `pretrained_cfg.model.init_args.model_args` (`backbone`, its
`backbone_*` overrides, `necks`, `decoder`, `decoder_channels`, `decoder_scale_modules`,
`num_classes`, `head_dropout`, `rescale`), and `pretrained_cfg.input` (tensor shapes). Called by
engine/models/prithvi.py. Anything we do not implement is an UnsupportedModelError naming it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..errors import UnsupportedModelError

# terratorch's backbone presets (terratorch/models/backbones/prithvi_vit.py prithvi_cfgs)
BACKBONES: dict[str, dict[str, Any]] = {
    "prithvi_eo_tiny": dict(embed_dim=256, depth=4, num_heads=4, coords_encoding=()),
    "prithvi_eo_v2_100_tl": dict(embed_dim=768, depth=12, num_heads=12, coords_encoding=("time", "location")),
    "prithvi_eo_v2_300": dict(embed_dim=1024, depth=24, num_heads=16, coords_encoding=()),
    "prithvi_eo_v2_300_tl": dict(embed_dim=1024, depth=24, num_heads=16, coords_encoding=("time", "location")),
    "prithvi_eo_v2_600": dict(embed_dim=1280, depth=32, num_heads=16, patch_size=(1, 14, 14), coords_encoding=()),
    "prithvi_eo_v2_600_tl": dict(embed_dim=1280, depth=32, num_heads=16, patch_size=(1, 14, 14),
                                 coords_encoding=("time", "location")),
}
SEN1FLOODS11_BANDS = ("BLUE", "GREEN", "RED", "NIR_NARROW", "SWIR_1", "SWIR_2")


@dataclass(frozen=True)
class PrithviConfig:
    embed_dim: int = 1024
    depth: int = 24
    num_heads: int = 16
    mlp_ratio: float = 4.0
    in_chans: int = 6
    patch_size: tuple[int, int, int] = (1, 16, 16)
    img_size: int = 224                    # the grid the stored position table was built for
    num_frames: int = 1
    coords_encoding: tuple[str, ...] = ("time", "location")
    bands: tuple[str, ...] = SEN1FLOODS11_BANDS
    feature_indices: tuple[int, ...] = (5, 11, 17, 23)
    scale_modules: bool = True             # fpn1..4 before the UperNet decoder
    decoder_channels: int = 256
    pool_scales: tuple[int, ...] = (1, 2, 3, 6)
    num_classes: int = 2
    rescale: bool = True
    layer_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.embed_dim // self.num_heads

    def validate(self) -> "PrithviConfig":
        if self.embed_dim % self.num_heads:
            raise UnsupportedModelError(f"embed_dim {self.embed_dim} is not a multiple of num_heads {self.num_heads}")
        if max(self.feature_indices) >= self.depth or len(self.feature_indices) != 4:
            raise UnsupportedModelError(f"the neck selects blocks {list(self.feature_indices)}: need 4 of "
                                        f"0..{self.depth - 1}")
        if self.num_frames != 1 or self.patch_size[0] != 1:
            raise UnsupportedModelError("only single-frame Prithvi models are supported (num_frames 1, patch depth 1)")
        return self


def _args(hf_config: Any) -> dict[str, Any]:
    cfg = hf_config if isinstance(hf_config, dict) else hf_config.to_dict()
    try:
        return dict(cfg["pretrained_cfg"]["model"]["init_args"]["model_args"])
    except (KeyError, TypeError):
        raise UnsupportedModelError("config.json has no pretrained_cfg.model.init_args.model_args "
                                    "(the terratorch / vLLM layout of a Prithvi model)") from None


def read_prithvi_config(hf_config: Any) -> PrithviConfig:
    args = _args(hf_config)
    backbone = args.get("backbone")
    if backbone not in BACKBONES:
        raise UnsupportedModelError(f"backbone {backbone!r} is not supported (supported: {', '.join(BACKBONES)})")
    values: dict[str, Any] = dict(BACKBONES[backbone])
    for key in ("embed_dim", "depth", "num_heads", "mlp_ratio", "img_size", "num_frames", "patch_size",
                "coords_encoding", "in_chans"):
        if f"backbone_{key}" in args:
            values[key] = args[f"backbone_{key}"]
    if "backbone_bands" in args:
        values["bands"] = tuple(args["backbone_bands"])
        values.setdefault("in_chans", len(values["bands"]))
    values["in_chans"] = int(values.get("in_chans", len(values.get("bands", SEN1FLOODS11_BANDS))))
    if args.get("decoder", "UperNetDecoder") != "UperNetDecoder":
        raise UnsupportedModelError(f"decoder {args.get('decoder')!r} is not supported (only UperNetDecoder)")
    necks = args.get("necks") or []
    names = [n.get("name") for n in necks]
    known = {"SelectIndices", "ReshapeTokensToImage", "LearnedInterpolateToPyramidal"}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise UnsupportedModelError(f"neck {unknown[0]!r} is not supported (supported: {', '.join(sorted(known))})")
    for n in necks:
        if n.get("name") == "SelectIndices":
            values["feature_indices"] = tuple(n.get("indices") or ())
    values["scale_modules"] = bool(args.get("decoder_scale_modules")) or "LearnedInterpolateToPyramidal" in names
    if not values["scale_modules"]:
        raise UnsupportedModelError("a UperNet decoder without scale modules is not supported")
    values["decoder_channels"] = int(args.get("decoder_channels", 256))
    values["num_classes"] = int(args.get("num_classes", 2))
    values["rescale"] = bool(args.get("rescale", True))
    values["patch_size"] = tuple(values.get("patch_size", (1, 16, 16)))
    values["coords_encoding"] = tuple(values.get("coords_encoding", ()))
    fields = {f.name for f in dataclasses.fields(PrithviConfig)}
    return PrithviConfig(**{k: v for k, v in values.items() if k in fields}).validate()
