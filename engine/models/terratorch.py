"""The "Terratorch" architecture: a terratorch / vLLM geospatial model folder served as a pooling model.

Registered for `architectures: ["Terratorch"]` (engine/models/registry.py). The folder's config.json
says which terratorch model it is (`pretrained_cfg.model.init_args.model_args`); the Prithvi-EO-2.0
segmentation models are supported (engine/models/prithvi.py), anything else is an
UnsupportedModelError naming the backbone. The model takes tensors, not tokens:

    prompt   {"multi_modal_data": {"pixel_values": [C, H, W], "location_coords": [2]?, "temporal_coords": [2]?}}
    cost     the tile's encoder tokens (patches + cls): what the scheduler budgets
    output   task "plugin": the logits [classes, H, W] (float32); `use_activation` gives class probabilities

Requests whose tensors have the same shapes run as one batch (engine/pooling_runner.py groups them
by `batch_key`).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ...kernels.ops import Ops
from ..errors import InputError
from .prithvi import PrithviSegmentation
from .prithvi_config import read_prithvi_config

TensorInputs = dict[str, torch.Tensor]


def _as_tensor(name: str, value: Any) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    try:
        return torch.from_numpy(np.asarray(value, dtype=np.float32))
    except (TypeError, ValueError):
        raise InputError(f"must be a tensor, an array or nested lists of numbers, got {type(value).__name__}",
                         field=f"multi_modal_data.{name}") from None


class TerratorchSegmentation(PrithviSegmentation):
    needs_kv_cache = False
    input_kind = "tensors"
    exact_on_cpu = True          # fp32 under dtype auto on CPU, as the encoders
    max_input_cost = 65536       # patches of one tile (the position table interpolates to any grid)
    default_pooling_type = "NONE"
    input_names = ("pixel_values", "location_coords", "temporal_coords")
    # Tiles per forward: the step's tiles go through in sub-batches of about this many tokens. One
    # 512 x 512 window (1,025 tokens) already fills the GEMMs; more rows only spill the caches
    # (measured here, fp32 [rows, 1024] x [1024, 4096], 2 threads: 1,025 rows 124 GFLOP/s, 2,050 111,
    # 4,100 106). Smaller tiles stack up to it.
    sub_batch_cost = 1100

    def __init__(self, hf_config: Any, dtype: torch.dtype, device: torch.device | str, ops: Ops) -> None:
        super().__init__(read_prithvi_config(hf_config), ops)
        self.to(dtype=dtype)
        self.dtype = dtype

    @property
    def hidden_size(self) -> int:
        return self.config.embed_dim

    def supported_tasks(self) -> tuple[str, ...]:
        return ("plugin",)

    # ------------------------------------------------------------------ requests
    def check_inputs(self, data: dict[str, Any]) -> tuple[TensorInputs, int]:
        """The request's tensors, checked and shaped ([C, H, W] float32; coords [2]), and their cost."""
        unknown = sorted(set(data) - set(self.input_names))
        if unknown:
            raise InputError(f"is not an input of this model (it takes {', '.join(self.input_names)})",
                             field=f"multi_modal_data.{unknown[0]}")
        if "pixel_values" not in data:
            raise InputError("is missing (the tile, [bands, height, width])", field="multi_modal_data.pixel_values")
        px = _as_tensor("pixel_values", data["pixel_values"]).float()
        c = self.config.in_chans
        if px.dim() == 4 and 1 in (px.shape[0], px.shape[1]):          # [1, C, H, W] or [C, T=1, H, W]
            px = px.reshape(px.shape[0] * px.shape[1], *px.shape[2:])
        if px.dim() != 3 or px.shape[0] != c or min(px.shape[1:]) < 1:
            raise InputError(f"must be [{c}, height, width] ({c} bands: {', '.join(self.config.bands)}), "
                             f"got shape {list(px.shape)}", field="multi_modal_data.pixel_values")
        if not torch.isfinite(px).all():
            raise InputError("holds NaN or infinite values (fill nodata pixels before sending the tile)",
                             field="multi_modal_data.pixel_values")
        inputs: TensorInputs = {"pixel_values": px.contiguous()}
        for name in ("location_coords", "temporal_coords"):
            if data.get(name) is not None:
                v = _as_tensor(name, data[name]).float().reshape(-1)
                if v.numel() != 2 or not torch.isfinite(v).all():
                    raise InputError("must be 2 finite numbers ((lat, lon) / (year, day of year))",
                                     field=f"multi_modal_data.{name}")
                inputs[name] = v
        return inputs, self.num_patches(px.shape[1], px.shape[2])

    @staticmethod
    def batch_key(inputs: TensorInputs) -> tuple:
        """Requests with equal keys stack into one batch."""
        return tuple((name, tuple(t.shape)) for name, t in sorted(inputs.items()))

    def forward_batch(self, batch: list[TensorInputs]) -> torch.Tensor:  # n x same-shaped inputs -> [n, classes, H, W]
        pixels = torch.stack([b["pixel_values"] for b in batch]).to(self.dtype)
        coords = {name: torch.stack([b[name] for b in batch]) for name in ("location_coords", "temporal_coords")
                  if name in batch[0]}
        return self(pixels, coords.get("temporal_coords"), coords.get("location_coords")).float()

    @staticmethod
    def pool(logits: torch.Tensor, use_activation: bool | None) -> torch.Tensor:  # [classes, H, W]
        return F.softmax(logits, dim=0) if use_activation else logits
