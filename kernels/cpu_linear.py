"""Prepacked linear layers for the CPU model's GEMMs (fp32 or bf16), with a small-rows native path.

`pack_linear(linear, native, weight_dtype) -> PackedLinear` is bound as `Ops.pack_linear` on CPU
(kernels/ops.py); the model calls it once per Linear after its weights are loaded
(`LlamaForCausalLM.finalize_weights`). The oracle is `F.linear` on the same tensors.

NOTE: why prepack. A plain `F.linear` on CPU either reorders the weight into oneDNN's blocked
layout on every call (bf16) or goes through MKL's sgemm (fp32): measured here (2 threads, SmolLM2
layer shapes), a bf16 weight packed once makes the per-layer GEMMs 2.5x faster at batch 1 (0.33 ->
0.13 ms) and 1.4x at batch 64 (1.6 -> 1.1 ms) on Zen 4; on Zen 3 (AVX2, fp32) oneDNN's packed
fp32 GEMM ran the model's shapes at 87 / 118 / 131 / 137 GFLOP/s for 16 / 64 / 256 / 1,024 rows
against MKL's F.linear at 39 / 68 / 103 / 130 (bench/gemm_backends.py). The packed layout is only
a weight layout: one packed tensor serves every batch size. Accumulation is fp32 inside the
library; a bf16 output is rounded to bf16, exactly as `F.linear` does.

NOTE: the GEMM library (`gemm_backend`), chosen from the CPU (kernels/cpu_features.py), each
choice measured by bench/gemm_backends.py on the model's shapes:
  - bf16 on an AMD CPU: AMD's ZenDNN plugin (`pip install -c constraints-cpu.txt ".[zen]"`, a
    wheel per torch release) when it loads, 2-8% faster than oneDNN on Zen 4 with weights rotating
    out of cache as in a model step (M = 64: 330-386 vs 307-365 GFLOP/s, M = 256: 414-438 vs
    401-423), one engine step 2-8% faster.
  - bf16 on any other CPU: oneDNN, which runs AMX tiles where the CPU has them. On an Intel Xeon with
    amx_bf16 (2 threads) zentorch's bf16 GEMM ran at 173-209 GFLOP/s against oneDNN's 721 / 1,483 /
    1,898 at 64 / 256 / 2,048 rows (0.10-0.24x): ZenDNN has no AMX path.
  - fp32: oneDNN, ahead of zentorch's fp32 GEMM on Zen 3 (118 vs 112 GFLOP/s at 64 rows, 131 vs 104
    at 256) and on the Intel Xeon (206 vs 186 at 64, 289 vs 273 at 256; MKL within 5% there).
  - fp32, vbatch's own (`native`, kernels/csrc/cpu_gemm.c: AVX2 + FMA, 6 x 16 micro tiles over
    panels packed once): not the default anywhere. On Zen 3 (session 14, 2 threads, the same process
    alternating with oneDNN, two runs) it ran 1.13-1.2x oneDNN at 16 rows, 0.92-0.99x at 256 and
    0.87-0.99x at 1,024-2,048 (oneDNN 109-151 GFLOP/s there, the cores' multiply-add peak 176): the
    library is close to what a hand-written kernel gets, so it stays the choice.
VBATCH_GEMM=onednn|zentorch|mkl|native overrides the choice (VBATCH_ZENTORCH=0 keeps zentorch out; it
is never loaded on a CPU that is not AMD's);
`vbatch bench` prints the library in use.

NOTE: half-precision weights. With `weight_dtype` below the model's dtype (an fp32 model on a CPU
without fast bf16: dtype auto streams its weights as fp16, cpu_features.CpuTier.half_dtype)
the weight is rounded to it once here, and both paths compute with the rounded values: the packed
GEMM holds them widened back to fp32, the small-rows kernel streams them in half precision. So the
layer is one well-defined function (fp16 weights, fp32 arithmetic) whatever the batch size, and
the decode steps read half the bytes.

NOTE: Q8_0 weights (`quantization="q8_0"`, an fp32 model, explicit opt-in): the same rule one step
further. The weight is quantized once (kernels/q8_0.py: int8 and an fp16 scale per 32); the
small-rows kernel streams those bytes (53% of fp16's), the packed GEMM holds their dequantized fp32
values, so every batch size computes with the same weights q * d. A linear whose input width is not
a whole number of 32-blocks keeps `weight_dtype` (logged). On the avx2 tier the 5+-row GEMMs run
in integers instead (kernels/cpu_q8_0_linear.py: the same q * d, the rows rounded to int16).
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_features, q8_0

logger = logging.getLogger(__name__)

_PACK_BATCH_HINT = 64  # oneDNN wants a batch-size hint for the reorder; any size runs on the result

MLP_CHUNK_ROWS = 2048
"""Rows of a gated MLP computed together in a large step (Ops.mlp_chunk_rows): gate/up, SiLU-and-mul
and down over 2,048 rows at a time, not the step's 8,192, so the intermediate product is read back
from cache rather than memory and no allocation is large enough to be mapped and zeroed afresh.
NOTE: measured on the Intel Xeon with AMX (2 threads, SmolLM2's 30 MLPs over 8,192 rows,
/tmp-style loop over PackedGateUp + PackedLinear): bf16 1,233-1,396 GFLOP/s whole, 2,137 / 2,188 /
2,180 / 1,949 / 1,564 at 4,096 / 3,072 / 2,048 / 1,536 / 1,024-row chunks; fp32 with fp16 weights,
torch's libraries held to AVX2 (ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
MKL_ENABLE_INSTRUCTIONS=AVX2, the avx2 tier): 197-198 whole, 199 / 204 / 215-220 / 218 / 219-221
/ 225 at 4,096 / 3,072 / 2,048 / 1,536 / 1,024 / 512. Encoders get the same from the pooling runner,
which runs a step's sequences in sub-batches of 2,048 tokens (engine/pooling_runner.py)."""


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
    if not cpu_features.detect().is_amd:
        logger.debug("zentorch not used: this %s CPU is not AMD's", cpu_features.detect().vendor or "non-x86")
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
    """[N, K] fp32 -> the same N x K values in cpu_gemm.c's layout, kept in shape [N, K]: the outputs in
    panels of 16, each [K][16] (k-major), a last panel of N % 16 outputs [K][N % 16]."""
    n, k = weight.shape
    whole = n // 16 * 16
    panels = weight[:whole].reshape(-1, 16, k).transpose(1, 2).reshape(-1)   # [N // 16, K, 16]
    tail = weight[whole:].t().reshape(-1)                                     # [K, N % 16]
    return torch.cat([panels, tail]).view(n, k)


_ACTIVATIONS = {"none": lambda y: y, "silu": F.silu, "gelu": F.gelu,
                "gelu_tanh": functools.partial(F.gelu, approximate="tanh")}


def _native() -> GemmBackend | None:
    """vbatch's own fp32 GEMM (kernels/csrc/cpu_gemm.c, AVX2 + FMA), where the native kernels load."""
    from . import cpu_native
    kernels = cpu_native.load()
    return native_backend(kernels) if kernels is not None and kernels.has_gemm else None


def native_backend(kernels) -> GemmBackend:
    """The GEMM of one native build (cpu_native.NativeKernels with has_gemm) as a backend."""

    def linear(rows: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, act: str) -> torch.Tensor:
        return _ACTIVATIONS[act](kernels.gemm(rows, packed, bias, torch.get_num_threads()))

    return GemmBackend(name="native", pack=lambda w: pack_panels(w.detach().float().contiguous()), linear=linear,
                       linear_mul=lambda rows, packed, bias, other: linear(rows, packed, bias, "none") * other,
                       dtypes=(torch.float32,))


BACKEND_NAMES = ("onednn", "mkl", "zentorch", "native")


def backend_named(name: str) -> GemmBackend | None:
    """onednn | mkl | zentorch | native (None where zentorch, or the native kernels' GEMM, does not load)."""
    return {"onednn": lambda: ONEDNN, "mkl": lambda: MKL, "zentorch": _zentorch, "native": _native}[name]()


def default_backend(dtype: torch.dtype, cpu: cpu_features.CpuFeatures) -> GemmBackend:
    """The library measured fastest for `dtype` GEMMs on `cpu` (see the NOTE above): zentorch for
    bf16 on an AMD CPU where its wheel loads, oneDNN otherwise."""
    zen = _zentorch() if dtype == torch.bfloat16 and cpu.is_amd else None
    return zen or ONEDNN


@functools.cache
def gemm_backend(dtype: torch.dtype = torch.bfloat16) -> GemmBackend:
    """The GEMM library for `dtype` (decided once per process): VBATCH_GEMM if it names one that
    loads, else `default_backend` for this CPU."""
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
        backend = default_backend(dtype, cpu_features.detect())
    logger.info("CPU %s GEMMs: %s", str(dtype).removeprefix("torch."), backend.name)
    return backend


def describe(model: nn.Module) -> str | None:
    """The GEMM library of `model`'s packed linears ("zentorch 2.13.0.2", "onednn"), None if none is packed."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            if module.gemm_name != "zentorch":
                return module.gemm_name
            from importlib.metadata import PackageNotFoundError, version
            try:
                return f"zentorch {version('zentorch')}"
            except PackageNotFoundError:
                return "zentorch"
    return None


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


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int, backend: GemmBackend, act: str = "none") -> torch.Tensor:
    """[..., in] -> [..., out], the activation `act` applied to the GEMM's accumulator."""
    rows = x.reshape(-1, x.shape[-1])
    out = backend.linear(rows, packed_weight, bias, act)
    return out.view(*x.shape[:-1], out_features)


class PackedLinear(nn.Module):
    """`nn.Linear` with its weight in its GEMM library's blocked layout (oneDNN's or zentorch's, see
    `gemm_backend`); same forward signature and result.

    With the native kernels built (kernels/cpu_native.py, `native`), a plain [out, in] copy of the
    weight in `weight_dtype` is kept too and up to `SMALL_ROWS` rows go through `cpu_linear_small.c`
    instead: oneDNN reads the weight at about 16 GB/s at one row, the native kernel at about 28 (Zen
    4, whole model, 2 threads; 1.7x at 1-2 rows, 1.2x at 4, slower from 8). The price is that second
    copy of the weights (for a bf16 model the tied logits head shares the embedding's storage)."""

    SMALL_ROWS = 4

    def __init__(self, linear: nn.Linear, *, backend: GemmBackend | None = None, native=None,
                 weight_dtype: torch.dtype | None = None, pack: bool = True, quantization: str | None = None) -> None:
        super().__init__()
        dtype = linear.weight.dtype
        self.backend = backend or gemm_backend(dtype)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.quantization = quantization if quantization and self._quantizes() else None
        if self.quantization:  # Q8_0 rows for the kernel; their dequantized values for the GEMM library
            self.weight_dtype = torch.int8
            stored = q8_0.quantize(linear.weight)                   # [out, in * 17 / 16] int8
            # unpacked (cpu_q8_0_linear's integer GEMM packs the int8 rows itself): no fp32 copy
            self.compute_weight = q8_0.dequantize(stored, self.in_features).to(dtype) if pack else None
        else:
            self.weight_dtype = weight_dtype or dtype
            stored = linear.weight.detach().to(self.weight_dtype)   # [out, in]: the layer's weights, rounded once
            self.compute_weight = stored.to(dtype) if self.weight_dtype != dtype else stored
        # Buffers, not parameters: nothing trains, and the packed tensor is not a plain [out, in] matrix.
        self.register_buffer("packed_weight", self.backend.pack(self.compute_weight) if pack else None,
                             persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone(), persistent=False)
        self.native = native if native is not None and native.has_small_linear(dtype, self.weight_dtype) else None
        self.register_buffer("small_weight", stored.contiguous() if self.native else None, persistent=False)
        if pack:
            self.compute_weight = None  # the packed copy serves; only PackedGateUp still slices it

    @property
    def gemm_name(self) -> str:
        """The library its 5+-row GEMMs run in (`vbatch bench` prints it)."""
        return self.backend.name

    def _quantizes(self) -> bool:
        """Whether `quantization` applies to this layer (else it keeps weight_dtype, logged). Where
        it runs at all (fp32 models, the native kernels) kernels/ops.py `_cpu_ops` decides."""
        if not q8_0.can_quantize(self.in_features):
            logger.warning("a [%d, %d] linear keeps its unquantized weights: Q8_0 needs whole blocks of %d inputs",
                           self.out_features, self.in_features, q8_0.BLOCK)
            return False
        return True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        small = self._small(x)
        if small is not None:
            return small
        return packed_linear(x, self.packed_weight, self.bias, self.out_features, self.backend)

    def linear_gelu(self, x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
        """gelu(self(x)) with GELU fused into the GEMM (an encoder MLP's first projection); equal to
        activation_ref.gelu(self(x)) within fp32 rounding (tests/test_encoder_ops.py)."""
        small = self._small(x)
        if small is not None:
            return F.gelu(small, approximate=approximate)
        if self.backend is not ONEDNN:   # the post-op is oneDNN's; the other libraries' GEMM, then GELU
            return F.gelu(self(x), approximate=approximate)
        return packed_linear(x, self.packed_weight, self.bias, self.out_features, self.backend,
                             "gelu_tanh" if approximate == "tanh" else "gelu")

    def _small(self, x: torch.Tensor) -> torch.Tensor | None:  # [..., in] -> [..., out] or None (not small)
        if self.native is not None and x.numel() <= self.SMALL_ROWS * self.in_features:
            rows = self.native.linear_small(x.reshape(-1, self.in_features), self.small_weight, self.bias,
                                            torch.get_num_threads())
            if rows is not None:
                return rows.view(*x.shape[:-1], self.out_features)
        return None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"gemm={self.backend.name}, weights={self.quantization or str(self.weight_dtype).removeprefix('torch.')}")


class PackedGateUp(PackedLinear):
    """The merged [gate; up] projection of a gated MLP, with `silu_and_mul(x)` fused into its GEMMs.

    `silu_and_mul(x)` == `silu_and_mul(self(x))` (activation_ref): above SMALL_ROWS rows it is two
    GEMMs over the packed gate and up halves, the first with SiLU applied to its fp32 accumulator,
    the second multiplying its accumulator by the first's result, so the [rows, 2 * inter] product
    is never written, read back and converted (measured on Zen 4, 2 threads, SmolLM2's shapes, bf16:
    8,192 rows 94 -> 73 ms, 2,048 rows 19.5 -> 18.5, 256 rows 2.5 -> 2.3). In bf16, gate and up are
    not rounded to bf16 before the activation, so it differs from the reference by bf16 rounding
    only (tests/test_cpu_kernels.py). Up to SMALL_ROWS rows: the small-rows kernel and the native
    SiLU-and-mul, exactly as the separate ops (the fused decoder layer's equality test relies on it)."""

    def __init__(self, linear: nn.Linear, *, backend: GemmBackend | None = None, native=None,
                 weight_dtype: torch.dtype | None = None) -> None:
        super().__init__(linear, backend=backend, native=native, weight_dtype=weight_dtype, pack=False)
        half = self.out_features // 2
        weight, bias = self.compute_weight, linear.bias
        self.register_buffer("packed_gate", self.backend.pack(weight[:half]), persistent=False)
        self.register_buffer("packed_up", self.backend.pack(weight[half:]), persistent=False)
        self.register_buffer("bias_gate", None if bias is None else bias.detach()[:half].clone(), persistent=False)
        self.register_buffer("bias_up", None if bias is None else bias.detach()[half:].clone(), persistent=False)
        self.compute_weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # the Linear's contract: [..., in] -> [..., 2 * inter]
        small = self._small(x)
        if small is not None:
            return small
        half = self.out_features // 2
        return torch.cat([packed_linear(x, self.packed_gate, self.bias_gate, half, self.backend),
                          packed_linear(x, self.packed_up, self.bias_up, half, self.backend)], dim=-1)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., inter]
        small = self._small(x)
        if small is not None:
            return self.native.silu_and_mul(small, torch.get_num_threads())
        rows = x.reshape(-1, self.in_features)
        gate = self.backend.linear(rows, self.packed_gate, self.bias_gate, "silu")
        out = self.backend.linear_mul(rows, self.packed_up, self.bias_up, gate)
        return out.view(*x.shape[:-1], self.out_features // 2)


def pack_gate_up(linear: nn.Linear, native=None, weight_dtype: torch.dtype | None = None,
                 quantization: str | None = None) -> nn.Module:
    """The packed twin of a gated MLP's merged gate/up `linear`: for bf16 with `silu_and_mul` fused
    into its GEMMs; for fp32 one plain packed GEMM (the model then applies the op's SiLU-and-mul),
    because oneDNN's fp32 post-ops ran slower than the GEMM plus the native op on Zen 3 (2 threads,
    576 -> 2 x 1536: 256 rows 8.8 vs 6.3 ms, 2,048 rows 59 vs 48, 8,192 rows 264 vs 241). Any other
    dtype, or no oneDNN: the plain module."""
    if not can_pack(linear.weight.dtype):
        return linear
    if linear.weight.dtype != torch.bfloat16:
        return pack_linear(linear, native=native, weight_dtype=weight_dtype, quantization=quantization)
    return PackedGateUp(linear, native=native, weight_dtype=weight_dtype)


def pack_linear(linear: nn.Linear, native=None, weight_dtype: torch.dtype | None = None,
                quantization: str | None = None) -> nn.Module:
    """The packed twin of `linear`, its weights stored in `weight_dtype` (default: its own) or as
    `quantization` ("q8_0", fp32 models), the small-rows kernel of `native` (NativeKernels) for 1-4
    rows where it has one. Q8_0 layers multiply 5+ rows in integers (kernels/cpu_q8_0_linear.py)
    where `gemm_choice` says so."""
    if not can_pack(linear.weight.dtype):
        return linear
    if quantization == q8_0.NAME and q8_0.can_quantize(linear.in_features):
        from . import cpu_q8_0_linear
        choice = cpu_q8_0_linear.gemm_choice(native)
        if choice != "float":
            return cpu_q8_0_linear.PackedQ8_0Linear(linear, native=native, vnni=choice == "integer-vnni")
    return PackedLinear(linear, native=native, weight_dtype=weight_dtype, quantization=quantization)
