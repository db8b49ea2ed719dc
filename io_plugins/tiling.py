"""Windows over a scene and the blend that stitches their logits back into one map.

    windows = window_grid(height, width, size=512, overlap=0)
    canvas = LogitCanvas(num_classes, height, width, overlap)
    canvas.add(window, logits)           # [classes, h, w] of that window
    logits = canvas.result()             # [classes, H, W]: the weighted mean of every window covering a pixel

Layout: windows start every `size - overlap` pixels; the last one in each direction is moved back
to end at the scene's edge (a window never hangs outside the image, so nothing is padded with
invented pixels except inside the model's own multiple-of-32 padding). A scene smaller than the
window is one window of its own size. Where windows overlap (always near the far edges, and
everywhere with `overlap > 0`), logits are averaged with weights that fall linearly towards a
window's edges over `overlap` pixels: a pixel is decided mostly by the window that sees it with the
most context. `overlap = 0` weighs every pixel of every window alike.

NOTE: vLLM's pipeline instead reflect-pads the scene to a multiple of the window and ignores any
stride; the far windows there see mirrored pixels.
"""
from __future__ import annotations

import numpy as np

from .geotiff import Window


def _starts(length: int, size: int, stride: int) -> list[int]:
    if length <= size:
        return [0]
    starts = list(range(0, length - size, stride))
    starts.append(length - size)
    return starts


def window_grid(height: int, width: int, size: int, overlap: int) -> list[Window]:
    if size < 1 or not 0 <= overlap < size:
        raise ValueError(f"window {size} with overlap {overlap}: need window >= 1 and 0 <= overlap < window")
    stride = size - overlap
    return [Window(r, c, min(size, height), min(size, width))
            for r in _starts(height, size, stride) for c in _starts(width, size, stride)]


def _ramp(n: int, overlap: int) -> np.ndarray:
    if overlap == 0:
        return np.ones(n, np.float32)
    d = np.minimum(np.arange(n), np.arange(n)[::-1]).astype(np.float32)     # distance to the nearer edge
    return np.minimum(1.0, (d + 1.0) / (overlap + 1.0))


class LogitCanvas:
    def __init__(self, num_classes: int, height: int, width: int, overlap: int) -> None:
        self.overlap = overlap
        self.sum = np.zeros((num_classes, height, width), np.float32)
        self.weight = np.zeros((height, width), np.float32)

    def add(self, w: Window, logits: np.ndarray) -> None:
        weight = np.outer(_ramp(w.height, self.overlap), _ramp(w.width, self.overlap))
        rows, cols = slice(w.row, w.row + w.height), slice(w.col, w.col + w.width)
        self.sum[:, rows, cols] += logits * weight
        self.weight[rows, cols] += weight

    def result(self) -> np.ndarray:
        assert (self.weight > 0).all(), "every pixel lies in some window"
        return self.sum / self.weight
