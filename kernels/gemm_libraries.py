"""The GEMM libraries the CPU path multiplies 5+ rows with, and which one it uses.

`gemm_backend(dtype, tier=None) -> GemmBackend` (oneDNN, MKL, zentorch or vbatch's own fp32 GEMM): a
library's prepack and its linear, decided once per process and native tier; kernels/cpu_linear.py's
packed layers run through it.

NOTE: the GEMM library (`gemm_backend`), chosen from the CPU (kernels/cpu_features.py), each
choice measured by bench/gemm_backends.py on the model's shapes:
  - bf16 on an AMD CPU: AMD's ZenDNN plugin (`pip install -c constraints-cpu.txt ".[zen]"`, a
    wheel per torch release) when it loads, 2-8% faster than oneDNN on Zen 4 with weights rotating
    out of cache as in a model step (M = 64: 330-386 vs 307-365 GFLOP/s, M = 256: 414-438 vs
    401-423), one engine step 2-8% faster.
  - bf16 on any other CPU: oneDNN, which runs AMX tiles where the CPU has them. On an Intel Xeon with
    amx_bf16 (2 threads) zentorch's bf16 GEMM ran at 173-209 GFLOP/s against oneDNN's 721 / 1,483 /
    1,898 at 64 / 256 / 2,048 rows (0.10-0.24x): ZenDNN has no AMX path.
  - fp32 on the other tiers: oneDNN, ahead of zentorch's fp32 GEMM on Zen 3 (118 vs 112 GFLOP/s at
    64 rows, 131 vs 104 at 256) and on the Intel Xeon (206 vs 186 at 64, 289 vs 273 at 256; MKL
    within 5% there).
  - fp32 on the avx2 tier (CpuTier.native_gemm): vbatch's own (`native`, kernels/csrc/cpu_gemm.c:
    AVX2 + FMA, 6 x 16 micro tiles over panels packed once), reading the tier's fp16-stored weights
    as they are, so no fp32 copy of the model is kept (4 bytes per weight with the small-rows
    kernel's copy, not 6). Since session 26. On Zen 4 held to AVX2 (2 threads, SmolLM2-135M's 121
    matrices in turn, one process alternating; docs/performance/avx2-on-zen4.md "vbatch's own GEMM over fp16
    panels") it ran 1.45x oneDNN's fp32 GEMM at 16 rows, 1.08x at 32, 1.28-1.32x at 48-64,
    1.03-1.08x at 128-256 and 0.99-1.04x at 512-8,192 (three layers); the 256-prompt run went 1.04x
    (ABBA: 190.1 / 182.1 against 178.1 / 181.2 output tok/s, prefill phase 1.05x). Before it, on
    Zen 3 (session 14, 2 threads, the same process alternating with oneDNN, two runs) it ran
    1.13-1.2x oneDNN at 16 rows, 0.92-0.99x at 256 and 0.87-0.99x at 1,024-2,048 (oneDNN 109-151
    GFLOP/s there, the cores' multiply-add peak 176): the library was close to what a hand-written
    kernel got. Session 24 sized its k block to the L2 (kernels/csrc/vb_blocking.h; 256 before): on
    Zen 4 held to AVX2 it then ran 0.95-0.98x oneDNN's time at 256-8,192 rows, and the 256-prompt
    run went 196.5 / 180.9 output tok/s against oneDNN's 186.7 / 165.1 (ABBA, VBATCH_GEMM=native).
    On Zen 3 itself (session 32, docs/performance/avx2-zen3.md "Zen 3 a third time") it ran 1.44x /
    1.25x / 1.18x / 1.09x oneDNN's GFLOP/s at 16 / 64 / 256 / 2,048 rows, the fastest library there
    up to 256 rows, and the 256-prompt run went 1.02x (ABBA against VBATCH_GEMM=onednn, a tie within
    the noise); the memory it saves holds on any CPU.
    It also has a gated GEMM (`GemmBackend.gated`, cpu_gemm.c gemm_gated): a gated MLP's gate and up
    projections in one pass, SiLU-and-mul in its epilogue (cpu_linear.PackedGateUp), since session 27.
VBATCH_GEMM=onednn|zentorch|mkl|native overrides the choice (VBATCH_ZENTORCH=0 keeps zentorch out; it
is never loaded on a CPU that is not AMD's);
`vbatch bench` prints the library in use.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Callable

import torch
import torch.nn.functional as F

from . import cpu_features

logger = logging.getLogger(__name__)

_PACK_BATCH_HINT = 64  # oneDNN wants a batch-size hint for the reorder; any size runs on the result


@dataclasses.dataclass(frozen=True)
class GemmBackend:
    """One library's prepacked bf16 GEMM: pack a [out, in] weight once, then run rows through it."""

    name: str
    pack: Callable[[torch.Tensor], torch.Tensor]                                    # [out, in] -> packed
    # (rows [M, in], packed, bias [out] | None, activation "none" | "silu"; oneDNN also "gelu" | "gelu_tanh")
    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, str], torch.Tensor]
    # (rows [M, in], packed, bias, other [M, out]) -> (rows W^T + bias) * other, [M, out]
    linear_mul: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16)  # what it multiplies
    # narrower stored weights it packs as they are and widens in its kernel (no fp32 copy is made)
    stored_dtypes: tuple[torch.dtype, ...] = ()
    # A gated MLP's gate and up projections in one GEMM, where the library has one (vbatch's own):
    # (gate [inter, in], up [inter, in]) -> one packed weight, and (rows [M, in], that weight, bias
    # [2 * inter] | None, fuse) -> silu(gate) * up [M, inter] (fuse) or gate | up [M, 2 * inter].
    pack_gated: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
    gated: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, bool], torch.Tensor] | None = None


# activation -> (oneDNN post-op, its algorithm): applied to the fp32 accumulator inside the GEMM
_ONEDNN_ACTIVATION = {"none": ("none", ""), "silu": ("swish", ""), "gelu": ("gelu", "none"),
                      "gelu_tanh": ("gelu", "tanh")}


ONEDNN = GemmBackend(
    name="onednn",
    pack=lambda w: torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), _PACK_BATCH_HINT),
    linear=lambda rows, packed, bias, act: torch.ops.mkldnn._linear_pointwise(
        rows, packed, bias, _ONEDNN_ACTIVATION[act][0], [], _ONEDNN_ACTIVATION[act][1]),
    linear_mul=lambda rows, packed, bias, other: torch.ops.mkldnn._linear_pointwise.binary(
        rows, other, packed, bias, "mul"),
)


def _mkl_linear(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: str) -> torch.Tensor:
    out = F.linear(rows, weight, bias)
    return F.silu(out) if act == "silu" else out


# torch's own F.linear (MKL's sgemm for fp32 on x86): no packing; a peer for bench/gemm_backends.py
MKL = GemmBackend(
    name="mkl",
    pack=lambda w: w.detach().contiguous(),
    linear=_mkl_linear,
    linear_mul=lambda rows, weight, bias, other: F.linear(rows, weight, bias) * other,
)


def _zentorch() -> GemmBackend | None:
    """AMD's ZenDNN GEMMs where its wheel loads, on an AMD CPU only: on the Intel Xeon it ran 0.10-0.24x
    oneDNN in bf16 and behind it in fp32 (the NOTE above), and it is not even imported there (its
    libxsmm installs process-wide signal handlers: one deadlocked in free() while a glibc abort was
    being reported, turning a crash into a hang)."""
    if os.environ.get("VBATCH_ZENTORCH", "1") == "0":
        return None
    cpu = cpu_features.detect()
    if not cpu.is_amd:
        logger.debug("zentorch not used: this %s CPU is not AMD's", cpu.vendor or "non-x86")
        return None
    try:
        import zentorch  # noqa: F401  (registers torch.ops.zentorch)
        z = torch.ops.zentorch
        z.zentorch_weight_prepack_for_linear, z.zentorch_linear_unary, z.zentorch_linear_unary_binary  # noqa: B018
    except (ImportError, AttributeError, RuntimeError, OSError) as exc:  # not installed / another torch
        logger.debug("zentorch not used: %s", exc)
        return None
    return GemmBackend(
        name="zentorch",
        pack=lambda w: z.zentorch_weight_prepack_for_linear(w.detach().contiguous()),
        linear=lambda rows, packed, bias, act: z.zentorch_linear_unary(
            rows, packed, bias, is_weight_prepacked=True, post_op=act),
        linear_mul=lambda rows, packed, bias, other: z.zentorch_linear_unary_binary(
            rows, packed, other, bias, is_weight_prepacked=True, post_op_1="none", post_op_2="mul"),
    )


def pack_panels(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32 or fp16 -> the same N x K values in cpu_gemm.c's layout, kept in shape and dtype: the
    outputs in panels of 16, each [K][16] (k-major), a last panel of N % 16 outputs [K][N % 16]."""
    n, k = weight.shape
    whole = n // 16 * 16
    panels = weight[:whole].reshape(-1, 16, k).transpose(1, 2).reshape(-1)   # [N // 16, K, 16]
    tail = weight[whole:].t().reshape(-1)                                     # [K, N % 16]
    return torch.cat([panels, tail]).view(n, k)


def pack_gated_panels(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [inter, K] (one dtype, fp32 or fp16) -> cpu_gemm.c's gated layout, [2 * inter, K]: for
    each panel of 16 outputs (a last one of inter % 16), the gate's panel then the up projection's,
    each laid out as pack_panels lays it ([K][16], k-major)."""
    inter, k = gate.shape
    whole = inter // 16 * 16
    g, u = pack_panels(gate).reshape(-1), pack_panels(up).reshape(-1)
    pairs = torch.stack([g[:whole * k].view(-1, 16 * k), u[:whole * k].view(-1, 16 * k)], dim=1)  # [P, 2, 16 K]
    return torch.cat([pairs.reshape(-1), g[whole * k:], u[whole * k:]]).view(2 * inter, k)


_ACTIVATIONS = {"none": lambda y: y, "silu": F.silu, "gelu": F.gelu,
                "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


def _native(tier: cpu_features.CpuTier | None = None) -> GemmBackend | None:
    """vbatch's own fp32 GEMM (kernels/csrc/cpu_gemm.c, AVX2 + FMA), where the native kernels of `tier`
    (None: the selected one) load."""
    from . import cpu_native
    kernels = cpu_native.load(tier)
    return native_backend(kernels) if kernels is not None and kernels.has_gemm else None


def native_backend(kernels) -> GemmBackend:
    """The GEMM of one native build (cpu_native.NativeKernels with has_gemm) as a backend."""

    def linear(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, act: str) -> torch.Tensor:
        return _ACTIVATIONS[act](kernels.gemm(rows, packed, bias, torch.get_num_threads()))

    def panels(weight: torch.Tensor) -> torch.Tensor:   # fp16 panels stay fp16 (cpu_gemm.c widens them)
        weight = weight.detach()
        return (weight if weight.dtype == torch.float16 else weight.float()).contiguous()

    def gated(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, fuse: bool) -> torch.Tensor:
        return kernels.gemm_gated(rows, packed, bias, fuse, torch.get_num_threads())

    return GemmBackend(name="native", pack=lambda weight: pack_panels(panels(weight)), linear=linear,
                       linear_mul=lambda rows, packed, bias, other: linear(rows, packed, bias, "none") * other,
                       dtypes=(torch.float32,), stored_dtypes=(torch.float16,),
                       pack_gated=lambda gate, up: pack_gated_panels(panels(gate), panels(up)), gated=gated)


BACKEND_NAMES = ("onednn", "mkl", "zentorch", "native")


def backend_named(name: str) -> GemmBackend | None:
    """onednn | mkl | zentorch | native (None where zentorch, or the native kernels' GEMM, does not load)."""
    return {"onednn": lambda: ONEDNN, "mkl": lambda: MKL, "zentorch": _zentorch, "native": _native}[name]()


def default_backend(dtype: torch.dtype, cpu: cpu_features.CpuFeatures, tier: cpu_features.CpuTier) -> GemmBackend:
    """The library measured fastest for `dtype` GEMMs on `cpu` running the native kernels of `tier`
    (see the NOTE above): vbatch's own for fp32 where the tier says so (CpuTier.native_gemm: avx2) and
    it loads, zentorch for bf16 on an AMD CPU where its wheel loads, oneDNN otherwise."""
    native = _native(tier) if dtype == torch.float32 and tier.native_gemm else None
    zen = _zentorch() if dtype == torch.bfloat16 and cpu.is_amd else None
    return native or zen or ONEDNN


@functools.cache
def gemm_backend(dtype: torch.dtype = torch.bfloat16, tier: cpu_features.CpuTier | None = None) -> GemmBackend:
    """The GEMM library for `dtype` beside the native kernels of `tier` (None: the selected tier),
    decided once per process: VBATCH_GEMM if it names one that loads, else `default_backend` for this
    CPU and tier."""
    wanted = os.environ.get("VBATCH_GEMM", "").strip().lower()
    backend = None
    if wanted:
        if wanted not in BACKEND_NAMES:
            logger.warning("VBATCH_GEMM=%s is not one of %s; using the default", wanted, ", ".join(BACKEND_NAMES))
        else:
            backend = backend_named(wanted)
            if backend is None:
                logger.warning("VBATCH_GEMM=%s does not load on this machine (zentorch: an AMD CPU and the `zen` "
                               "extra; native: the native kernels on AVX2); using the default", wanted)
            elif dtype not in backend.dtypes:
                logger.warning("VBATCH_GEMM=%s has no %s GEMM; using the default", wanted, dtype)
                backend = None
    if backend is None:
        backend = default_backend(dtype, cpu_features.detect(), tier or cpu_features.selected_tier())
    logger.info("CPU %s GEMMs: %s", str(dtype).removeprefix("torch."), backend.name)
    return backend


def can_pack(dtype: torch.dtype) -> bool:
    """True when this torch build runs prepacked oneDNN linears in `dtype` on this CPU (bf16: only
    where oneDNN has native bf16, avx512_bf16 or AMX; fp32: wherever oneDNN is built in)."""
    if dtype not in (torch.bfloat16, torch.float32) or not torch.backends.mkldnn.is_available():
        return False
    try:
        if not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
            return False
        return dtype == torch.float32 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False
