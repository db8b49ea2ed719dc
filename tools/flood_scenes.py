"""Synthetic Sentinel-2-like flood scenes: 6-band reflectance and a water ground truth.

Used by tools/train_flood_model.py (training data for the small synthetic flood model in
sample_data/models/) and by tests (sample tiles, a known answer). numpy only; rasterio is
imported inside `write_geotiff` alone.

Bands (Sen1Floods11 / Prithvi order): Blue, Green, Red, NIR-narrow, SWIR1, SWIR2, reflectance 0..1.

A scene (`make_scene`) is built from:
- land cover zones (argmax of smooth noise fields): agriculture (Voronoi parcels mixing green
  crops, dry soil, wet soil and mud), forest, urban (roofs, dark asphalt, parks), barren (sand,
  dry soil), burnt areas, snow / rock;
- water: lakes and ponds (blobs from thresholded smooth noise), meandering rivers (2-15 px wide)
  and floods spreading from the rivers over low ground; clear, turbid and shallow (bottom-showing)
  water spectra; mixed pixels at the shores;
- spatially correlated texture, a per-scene atmosphere (path radiance, gain) and sensor noise;
- clouds (soft edged, bright in all bands) with their shadows (darkened, blue-rich skylight).

Ground truth (`water`, uint8 0/1) is what a flood map should say: 1 where the pixel is mostly
open water (shore pixels with water fraction >= 0.5) AND not hidden by thick cloud. Where the
cloud opacity is >= 0.5 the water is not visible and the label is 0 (no water): a flood map
cannot claim water it cannot see. Under thin cloud (opacity < 0.5) and in cloud shadow the water
stays labelled 1.

Confounders that fool NDWI = (G - NIR) / (G + NIR) > 0: mud and saturated soil next to floods,
cloud shadows (the blue-rich skylight lifts green over NIR), dark asphalt and burnt ground (G ~
NIR), snow (G > NIR), thick cloud over water; and turbid or shallow water whose NIR approaches
green (missed water). The SWIR bands separate most of them: water absorbs SWIR, mud / asphalt /
burnt ground do not, snow is bright in the visible.
"""
from __future__ import annotations

import numpy as np

BANDS = ("BLUE", "GREEN", "RED", "NIR_NARROW", "SWIR_1", "SWIR_2")
# The Sen1Floods11 statistics the inference plugin normalises with (reflectance 0..1).
MEANS = (0.1412956, 0.13795798, 0.12353792, 0.30902815, 0.2044958, 0.11912015)
STDS = (0.07406382, 0.07370365, 0.08692279, 0.11798815, 0.09772074, 0.07659938)

#                         Blue   Green  Red    NIR    SWIR1  SWIR2
SPECTRA = {
    "forest":       (0.025, 0.045, 0.025, 0.32, 0.15, 0.07),
    "crop":         (0.035, 0.075, 0.045, 0.40, 0.21, 0.10),
    "grass":        (0.045, 0.080, 0.070, 0.28, 0.24, 0.14),
    "soil_dry":     (0.090, 0.120, 0.160, 0.22, 0.30, 0.25),
    "soil_wet":     (0.060, 0.080, 0.100, 0.12, 0.15, 0.11),
    "mud":          (0.070, 0.085, 0.090, 0.08, 0.07, 0.05),
    "urban":        (0.120, 0.125, 0.135, 0.17, 0.21, 0.19),
    "roof_red":     (0.080, 0.090, 0.180, 0.24, 0.28, 0.22),
    "asphalt":      (0.062, 0.066, 0.070, 0.072, 0.085, 0.075),
    "sand":         (0.200, 0.250, 0.300, 0.35, 0.45, 0.38),
    "burnt":        (0.040, 0.050, 0.055, 0.055, 0.13, 0.12),
    "snow":         (0.800, 0.790, 0.770, 0.70, 0.09, 0.07),
    "rock":         (0.150, 0.160, 0.170, 0.20, 0.25, 0.21),
    "water_clear":  (0.065, 0.050, 0.030, 0.015, 0.008, 0.005),
    "water_turbid": (0.090, 0.110, 0.100, 0.060, 0.020, 0.010),
    "water_silty":  (0.110, 0.140, 0.150, 0.115, 0.035, 0.018),
    "cloud":        (0.460, 0.450, 0.460, 0.500, 0.380, 0.260),
    "skylight":     (0.050, 0.035, 0.020, 0.010, 0.004, 0.002),
}
PATH_RADIANCE = np.array([0.020, 0.012, 0.006, 0.003, 0.001, 0.0005], np.float32)


def _spec(name: str) -> np.ndarray:
    return np.asarray(SPECTRA[name], dtype=np.float32)


# ---------------------------------------------------------------------------- noise fields
def _blur_direct(field: np.ndarray, sigma: float) -> np.ndarray:
    """Separable Gaussian blur with a truncated kernel (3 sigma), reflect padding."""
    r = max(1, int(3.0 * sigma + 0.5))
    k = np.exp(-0.5 * (np.arange(-r, r + 1) / sigma) ** 2)
    k = (k / k.sum()).astype(np.float32)
    h, w = field.shape
    p = np.pad(field, ((r, r), (0, 0)), mode="symmetric")
    out = sum(k[i] * p[i:i + h] for i in range(2 * r + 1))
    p = np.pad(out, ((0, 0), (r, r)), mode="symmetric")
    return sum(k[i] * p[:, i:i + w] for i in range(2 * r + 1))


def _resize(a: np.ndarray, h: int, w: int) -> np.ndarray:
    """Bilinear resize of [sh, sw] to [h, w] (corners aligned)."""
    sh, sw = a.shape
    ys = np.linspace(0, sh - 1, h)
    xs = np.linspace(0, sw - 1, w)
    y0 = np.minimum(ys.astype(int), sh - 2) if sh > 1 else np.zeros(h, int)
    x0 = np.minimum(xs.astype(int), sw - 2) if sw > 1 else np.zeros(w, int)
    wy = (ys - y0)[:, None]
    wx = (xs - x0)[None, :]
    y1 = np.minimum(y0 + 1, sh - 1)
    x1 = np.minimum(x0 + 1, sw - 1)
    rows = a[y0] * (1 - wy) + a[y1] * wy
    return rows[:, x0] * (1 - wx) + rows[:, x1] * wx


def _gauss_blur(field: np.ndarray, sigma: float) -> np.ndarray:
    """Gaussian blur (approximate for large sigma: block-mean down, blur, bilinear up)."""
    if sigma <= 0:
        return field
    if sigma <= 3.0:
        return _blur_direct(field, sigma)
    f = int(sigma / 1.5)
    h, w = field.shape
    ph, pw = -h % f, -w % f
    p = np.pad(field, ((0, ph), (0, pw)), mode="symmetric")
    small = p.reshape(p.shape[0] // f, f, p.shape[1] // f, f).mean(axis=(1, 3))
    small = _blur_direct(small, sigma / f)
    # block centres sit at (i + 0.5) f - 0.5 in full-resolution pixels
    up = _resize(small, small.shape[0] * f, small.shape[1] * f)
    return up[:h, :w]


def _noise(rng: np.random.Generator, h: int, w: int, sigma: float) -> np.ndarray:
    """Smooth Gaussian noise with correlation length ~sigma px, normalised to mean 0, std 1."""
    if sigma <= 3.0:
        out = _blur_direct(rng.standard_normal((h, w), dtype=np.float32), sigma)
    else:
        f = sigma / 2.0
        sh, sw = int(np.ceil(h / f)) + 2, int(np.ceil(w / f)) + 2
        out = _resize(_blur_direct(rng.standard_normal((sh, sw), dtype=np.float32), 2.0), h, w)
    out = out - out.mean()
    return out / (out.std() + 1e-12)


def _fractal(rng: np.random.Generator, h: int, w: int, sigma: float, octaves: int = 3,
             gain: float = 0.5) -> np.ndarray:
    out = np.zeros((h, w), np.float32)
    amp = 1.0
    for k in range(octaves):
        out += amp * _noise(rng, h, w, max(sigma / 2 ** k, 0.7))
        amp *= gain
    out -= out.mean()
    return out / (out.std() + 1e-12)


def _quantile_threshold(field: np.ndarray, fraction: float) -> float:
    """The value above which `fraction` of the field lies."""
    return float(np.quantile(field, 1.0 - np.clip(fraction, 0.0, 1.0)))


# ---------------------------------------------------------------------------- shapes
def _shift(a: np.ndarray, dy: int, dx: int) -> np.ndarray:
    """a moved by (dy, dx) px, zeros where nothing moved in (no wrap-around)."""
    h, w = a.shape
    out = np.zeros_like(a)
    if abs(dy) >= h or abs(dx) >= w:
        return out
    out[max(dy, 0):h + min(dy, 0), max(dx, 0):w + min(dx, 0)] = a[max(-dy, 0):h + min(-dy, 0), max(-dx, 0):w + min(-dx, 0)]
    return out


def _voronoi(rng: np.random.Generator, h: int, w: int, cell: float) -> np.ndarray:
    """Parcel ids [H, W] (Voronoi cells ~cell px across), computed on a 1/4 grid with jittered edges."""
    n = max(4, int(h * w / cell ** 2))
    pts = rng.uniform(0, 1, (n, 2)) * (h, w)
    sh, sw = (h + 3) // 4, (w + 3) // 4
    yy, xx = np.meshgrid(np.arange(sh) * 4.0 + 2, np.arange(sw) * 4.0 + 2, indexing="ij")
    yy = yy + 3.0 * _noise(rng, sh, sw, 2.0)
    xx = xx + 3.0 * _noise(rng, sh, sw, 2.0)
    best = np.full((sh, sw), np.inf)
    ids = np.zeros((sh, sw), dtype=np.int32)
    for i, (py, px) in enumerate(pts):
        d = (yy - py) ** 2 + (xx - px) ** 2
        closer = d < best
        best[closer] = d[closer]
        ids[closer] = i
    return np.repeat(np.repeat(ids, 4, 0), 4, 1)[:h, :w]


def _river(rng: np.random.Generator, h: int, w: int, mask: np.ndarray, base_width: float) -> None:
    """Stamps one meandering river (width varying 2..15 px around base_width) into `mask`."""
    edge = rng.integers(4)
    if edge == 0:
        y, x, heading = 0.0, rng.uniform(0, w), np.pi / 2
    elif edge == 1:
        y, x, heading = float(h - 1), rng.uniform(0, w), -np.pi / 2
    elif edge == 2:
        y, x, heading = rng.uniform(0, h), 0.0, 0.0
    else:
        y, x, heading = rng.uniform(0, h), float(w - 1), np.pi
    heading += rng.uniform(-0.6, 0.6)
    dev, turn = 0.0, 0.0
    width = base_width
    steps = int(4 * (h + w))
    yy_all, xx_all = np.ogrid[:h, :w]
    for _ in range(steps):
        turn = 0.9 * turn + rng.normal(0, 0.05) - 0.02 * dev
        dev = float(np.clip(dev + turn, -1.4, 1.4))
        width = float(np.clip(width + rng.normal(0, 0.15) + 0.01 * (base_width - width), 2.0, 15.0))
        r = width / 2.0
        step = max(1.0, 0.5 * r)
        y += step * np.sin(heading + dev)
        x += step * np.cos(heading + dev)
        if not (-20 <= y <= h + 20 and -20 <= x <= w + 20):
            break
        y0, y1 = int(max(0, np.floor(y - r))), int(min(h, np.ceil(y + r) + 1))
        x0, x1 = int(max(0, np.floor(x - r))), int(min(w, np.ceil(x + r) + 1))
        if y0 >= y1 or x0 >= x1:
            continue
        dy = yy_all[y0:y1] - y
        dx = xx_all[:, x0:x1] - x
        mask[y0:y1, x0:x1] |= (dy ** 2 + dx ** 2) <= r ** 2 + 0.25


# ---------------------------------------------------------------------------- land covers
def _col(name: str) -> np.ndarray:
    return _spec(name)[:, None, None]


def _agri(rng, h, w, scale, fine, mid):
    """Parcels mixing crop / grass / soils, a few wet or muddy, hedges on the boundaries."""
    ids = _voronoi(rng, h, w, rng.uniform(25, 60) * scale)
    n = int(ids.max()) + 1
    vigor = rng.beta(1.2, 1.0, n)[:, None]
    kind = rng.choice(4, n, p=[0.45, 0.25, 0.22, 0.08])[:, None]   # crop, grass, dry soil, wet soil / mud
    m_dry = rng.uniform(0, 0.6, (n, 1))
    m_wet = rng.uniform(0, 1, (n, 1))
    soil_dry, soil_wet = _spec("soil_dry"), _spec("soil_wet")
    parcel = np.select(
        [kind == 0, kind == 1, kind == 2],
        [vigor * _spec("crop") + (1 - vigor) * soil_dry,
         (0.5 + 0.5 * vigor) * _spec("grass") + (0.5 - 0.5 * vigor) * soil_dry,
         (1 - m_dry) * soil_dry + m_dry * soil_wet],
        (1 - m_wet) * soil_wet + m_wet * _spec("mud"))
    parcel = (parcel * rng.uniform(0.85, 1.15, (n, 1))).astype(np.float32)
    out = parcel[ids].transpose(2, 0, 1) * (1 + 0.06 * mid + 0.03 * fine)
    edge = np.zeros((h, w), bool)
    edge[1:] |= ids[1:] != ids[:-1]
    edge[:, 1:] |= ids[:, 1:] != ids[:, :-1]
    out[:, edge] = 0.5 * out[:, edge] + 0.5 * _spec("forest")[:, None]
    return out


def _forest(rng, h, w, scale, fine, mid):
    out = _col("forest") * (1 + 0.12 * _fractal(rng, h, w, 3 * scale, 2) + 0.05 * fine)
    clearing = 0.3 * np.clip(_noise(rng, h, w, 10 * scale) - 1.5, 0, None)
    return out + clearing * (_col("grass") - _col("forest"))


def _urban(rng, h, w, scale, fine, mid):
    asphalt = np.clip(0.35 + 0.6 * _noise(rng, h, w, 2.0), 0, 1)
    roofs = np.where(_noise(rng, h, w, 1.2) > 0.8, _col("roof_red"), _col("urban"))
    out = asphalt * _col("asphalt") + (1 - asphalt) * roofs
    out = np.where(_noise(rng, h, w, 8) > 1.0, _col("grass"), out)
    return out * (1 + 0.05 * fine)


def _barren(rng, h, w, scale, fine, mid):
    s = np.clip(0.5 + 0.5 * _fractal(rng, h, w, 15 * scale, 3), 0, 1)
    return (s * _col("sand") + (1 - s) * _col("soil_dry")) * (1 + 0.05 * fine)


def _burnt(rng, h, w, scale, fine, mid):
    b = np.clip(0.7 + 0.4 * _fractal(rng, h, w, 8 * scale, 2), 0, 1)
    return (b * _col("burnt") + (1 - b) * _col("grass")) * (1 + 0.05 * fine)


def _snow(rng, h, w, scale, fine, mid):
    s = np.clip(0.6 + 0.5 * _fractal(rng, h, w, 6 * scale, 3), 0, 1)
    return (s * _col("snow") + (1 - s) * _col("rock")) * (1 + 0.04 * fine)


# ---------------------------------------------------------------------------- the scene
def make_scene(height: int, width: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A synthetic scene: (reflectance float32 [6, H, W] in 0..1, water uint8 [H, W] 0/1).

    Deterministic for a seed. The water label is 1 for visible open water only (see the module
    docstring: thick cloud, opacity >= 0.5, hides the water and is labelled 0)."""
    rng = np.random.default_rng(seed)
    h, w = int(height), int(width)
    scale = rng.uniform(0.7, 1.4)          # how coarse the landscape is

    # ---- land cover zones
    zones = ["agri", "forest", "urban", "barren", "burnt", "snow"]
    present = np.array([rng.random() < p for p in (0.85, 0.6, 0.45, 0.3, 0.15, 0.12)])
    if not present.any():
        present[0] = True
    bias = np.where(present, rng.normal(0, 0.5, len(zones)), -np.inf)
    zone_fields = np.stack([_fractal(rng, h, w, 60 * scale, 3) + b if np.isfinite(b)
                            else np.full((h, w), -np.inf, np.float32) for b in bias])
    zone = np.argmax(zone_fields, axis=0)

    fine = _noise(rng, h, w, 1.5)
    mid = _noise(rng, h, w, 6 * scale)
    covers = (_agri, _forest, _urban, _barren, _burnt, _snow)
    land = np.zeros((6, h, w), np.float32)
    for k, make in enumerate(covers):
        sel = zone == k
        if sel.any():
            land[:, sel] = make(rng, h, w, scale, fine, mid)[:, sel]

    # ---- water
    water = np.zeros((h, w), bool)
    rivers = np.zeros((h, w), bool)
    for _ in range(rng.choice(4, p=[0.2, 0.45, 0.25, 0.1])):
        _river(rng, h, w, rivers, rng.uniform(2.0, 13.0))
    water |= rivers
    flood_level = rng.choice([0.0, rng.uniform(0.1, 0.9)], p=[0.25, 0.75])
    if rivers.any() and flood_level > 0:
        prox = _gauss_blur(rivers.astype(np.float32), 20 * scale)
        prox = prox / (prox.max() + 1e-9)
        ground = 0.55 * _fractal(rng, h, w, 18 * scale, 3) - 2.2 * prox
        flood = ground < np.quantile(ground, 0.02 + 0.3 * flood_level)
        water |= flood & (prox > 0.05)
    n_lakes = rng.choice(4, p=[0.3, 0.35, 0.25, 0.1])
    if n_lakes:
        lakes = _fractal(rng, h, w, rng.uniform(15, 40) * scale, 3)
        water |= lakes > _quantile_threshold(lakes, rng.uniform(0.01, 0.12) * n_lakes)
    if rng.random() < 0.5:
        ponds = _noise(rng, h, w, 3.0 * scale)
        water |= ponds > 3.0
    # no water on snowy ground (it would be ice)
    water &= zone != 5

    # wet fringe around water: soil turns wet / muddy (NDWI confounder next to real water)
    near = _gauss_blur(water.astype(np.float32), rng.uniform(4, 12) * scale)
    wet = np.clip((near - 0.03) * 4.0, 0, 1) * (~water) * rng.uniform(0.3, 1.0)
    wet = wet * np.clip(0.6 + 0.5 * mid, 0, 1)
    wet_target = np.where(_noise(rng, h, w, 5)[None] > 0, _spec("mud")[:, None, None],
                          _spec("soil_wet")[:, None, None])
    land = (1 - wet[None]) * land + wet[None] * wet_target

    # water spectra: clear -> turbid -> silty, floods more turbid, shallow shores show the bottom
    turb = np.clip(0.35 + 0.35 * _fractal(rng, h, w, 25 * scale, 3) + rng.uniform(-0.3, 0.5), 0, 1.0)
    t1 = np.clip(turb * 2, 0, 1)[None]
    t2 = np.clip(turb * 2 - 1, 0, 1)[None]
    wspec = ((1 - t1) * _spec("water_clear")[:, None, None] + t1 * _spec("water_turbid")[:, None, None])
    wspec = (1 - t2) * wspec + t2 * _spec("water_silty")[:, None, None]
    wspec = wspec * (1 + 0.04 * mid)
    inner = _gauss_blur(water.astype(np.float32), 2.0)
    shallow = np.clip(1 - inner, 0, 1) * rng.uniform(0.1, 0.5)
    wspec = (1 - shallow[None]) * wspec + shallow[None] * _spec("soil_wet")[:, None, None]
    frac = np.clip(_gauss_blur(water.astype(np.float32), 0.7), 0, 1)[None]
    refl = (1 - frac) * land + frac * wspec
    truth_water = frac[0] >= 0.5

    # ---- clouds and shadows
    cover = rng.choice([0.0, rng.uniform(0.02, 0.15), rng.uniform(0.15, 0.5)], p=[0.35, 0.35, 0.3])
    cloud_alpha = np.zeros((h, w))
    if cover > 0:
        field = _fractal(rng, h, w, rng.uniform(20, 60) * scale, 4, 0.55)
        thr = _quantile_threshold(field, cover)
        cloud_alpha = np.clip((field - thr) * rng.uniform(1.0, 3.0) + 0.5, 0, 1) ** 1.2
        cloud_alpha[field < thr - 0.8] = 0
        # shadow: the cloud displaced along the sun direction
        ang, dist = rng.uniform(0, 2 * np.pi), rng.uniform(10, 40) * scale
        dy, dx = int(round(dist * np.sin(ang))), int(round(dist * np.cos(ang)))
        shadow = _shift(cloud_alpha, dy, dx)
        shadow = _gauss_blur(shadow, 2.0) * rng.uniform(0.6, 0.9)
        refl = refl * (1 - shadow[None]) + shadow[None] * _spec("skylight")[:, None, None] * rng.uniform(0.6, 1.5)
        ctex = 1 + 0.1 * _fractal(rng, h, w, 6, 3)
        cloud = _spec("cloud")[:, None, None] * ctex[None] * rng.uniform(0.8, 1.3)
        refl = (1 - cloud_alpha[None]) * refl + cloud_alpha[None] * cloud
    if rng.random() < 0.3:   # haze: thin, visible-heavy
        haze = np.clip(0.5 + 0.3 * _noise(rng, h, w, 50 * scale), 0, 1)[None] * rng.uniform(0.02, 0.12)
        refl = refl + haze * np.array([1.0, 0.85, 0.7, 0.5, 0.25, 0.15], np.float32)[:, None, None]

    # ---- atmosphere and sensor
    refl = refl * (rng.uniform(0.9, 1.1) * rng.uniform(0.96, 1.04, (6, 1, 1))).astype(np.float32)
    refl = refl + PATH_RADIANCE[:, None, None] * rng.uniform(0.2, 1.0)
    refl = refl + rng.standard_normal(refl.shape, dtype=np.float32) * (0.003 + 0.01 * refl)
    refl = np.clip(refl, 0.0001, 1.0).astype(np.float32)

    label = truth_water & (cloud_alpha < 0.5)
    return refl, label.astype(np.uint8)


# ---------------------------------------------------------------------------- baseline, metric, files
def ndwi_water(reflectance: np.ndarray) -> np.ndarray:
    """McFeeters NDWI = (G - NIR) / (G + NIR) > 0 on a [6, H, W] reflectance: bool [H, W]."""
    g = reflectance[1].astype(np.float64)
    nir = reflectance[3].astype(np.float64)
    return (g - nir) / np.maximum(g + nir, 1e-9) > 0


def iou(pred_bool: np.ndarray, truth_bool: np.ndarray) -> float:
    """Intersection over union of two boolean masks (1.0 when both are empty)."""
    p, t = np.asarray(pred_bool, bool), np.asarray(truth_bool, bool)
    union = np.logical_or(p, t).sum()
    return 1.0 if union == 0 else float(np.logical_and(p, t).sum() / union)


def normalize(reflectance: np.ndarray) -> np.ndarray:
    """The inference plugin's normalisation: per band (x - mean) / std, float32 [6, H, W]."""
    m = np.asarray(MEANS, np.float32)[:, None, None]
    s = np.asarray(STDS, np.float32)[:, None, None]
    return ((reflectance.astype(np.float32) - m) / s).astype(np.float32)


def write_geotiff(path, reflectance: np.ndarray, *, nodata_mask: np.ndarray | None = None,
                  crs: str = "EPSG:32633", origin: tuple[float, float] = (500000.0, 4600000.0),
                  pixel_size: float = 10.0) -> None:
    """A 6-band uint16 GeoTIFF of reflectance * 10000 (rounded; 1..10000 where data), nodata 0
    where `nodata_mask` is True (all bands 0 there), LZW compressed, north-up at `origin` (the
    top-left corner) with square `pixel_size` pixels."""
    import rasterio
    from rasterio.transform import from_origin

    refl = np.asarray(reflectance, dtype=np.float64)
    if refl.ndim != 3:
        raise ValueError(f"reflectance must be [bands, H, W], got shape {refl.shape}")
    data = np.clip(np.rint(refl * 10000.0), 1, 65535).astype(np.uint16)
    if nodata_mask is not None:
        data[:, np.asarray(nodata_mask, bool)] = 0
    count, h, w = data.shape
    profile = dict(driver="GTiff", width=w, height=h, count=count, dtype="uint16", crs=crs,
                   transform=from_origin(origin[0], origin[1], pixel_size, pixel_size), nodata=0,
                   compress="lzw", predictor=2, interleave="band", tiled=False)
    with rasterio.open(path, "w", **profile) as dst:
        dst.write(data)
        for i, name in enumerate(BANDS[:count], start=1):
            dst.set_band_description(i, name)
