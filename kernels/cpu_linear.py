"""Prepacked linear layers for bf16 on CPU (the CPU model's GEMMs): zentorch's where it is
installed, oneDNN's (inside torch) otherwise.

`pack_linear(nn.Linear) -> PackedLinear` is bound as `Ops.pack_linear` for bf16 on CPUs with
avx512_bf16 (kernels/ops.py); the model calls it once per Linear after its weights are loaded
(`LlamaForCausalLM.finalize_weights`). The oracle is `F.linear` on the same bf16 tensors.

NOTE: why prepack. A plain bf16 `F.linear` on this CPU runs oneDNN too, but reorders the weight
into oneDNN's blocked layout on every call: measured here (2 threads, SmolLM2 layer shapes) a
packed weight makes the per-layer GEMMs 2.5x faster at batch 1 (0.33 -> 0.13 ms) and 1.4x at batch
64 (1.6 -> 1.1 ms). The packed layout is only a weight layout: one packed tensor serves every
batch size (checked from 1 to 300 rows; the batch-size hint changes nothing measurable).
Accumulation is fp32 inside oneDNN; the output is rounded to bf16, exactly as `F.linear` does.

NOTE: zentorch. AMD's ZenDNN plugin (`pip install -c constraints-cpu.txt ".[zen]"`, a wheel per torch
release) prepacks the same way and was measured here 2-8% faster than oneDNN on the model's shapes
with weights rotating out of cache as in a model step (M = 64: 330-386 vs 307-365 GFLOP/s, M = 256:
414-438 vs 401-423, M = 2,048: 440-447 vs 414-445), one engine step 2-8% faster (decode batch 64
85.6 -> 79.0 ms, batch 256 283.8 -> 272.7, an 8k-token prefill 4.73 -> 4.62 s). It is used when
`import zentorch` works (its wheel refuses any other torch minor) unless VBATCH_ZENTORCH=0.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
from typing import Callable

import torch
from torch import nn

logger = logging.getLogger(__name__)

_PACK_BATCH_HINT = 64  # oneDNN wants a batch-size hint for the reorder; any size runs on the result


@dataclasses.dataclass(frozen=True)
class GemmBackend:
    """One library's prepacked bf16 GEMM: pack a [out, in] weight once, then run rows through it."""

    name: str
    pack: Callable[[torch.Tensor], torch.Tensor]                                    # [out, in] -> packed
    # (rows [M, in], packed, bias [out] | None, activation "none" | "silu") -> [M, out]
    linear: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, str], torch.Tensor]
    # (rows [M, in], packed, bias, other [M, out]) -> (rows W^T + bias) * other, [M, out]
    linear_mul: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]


_ONEDNN_ACTIVATION = {"none": "none", "silu": "swish"}

ONEDNN = GemmBackend(
    name="onednn",
    pack=lambda w: torch.ops.mkldnn._reorder_linear_weight(w.detach().contiguous(), _PACK_BATCH_HINT),
    linear=lambda rows, packed, bias, act: torch.ops.mkldnn._linear_pointwise(
        rows, packed, bias, _ONEDNN_ACTIVATION[act], [], ""),
    linear_mul=lambda rows, packed, bias, other: torch.ops.mkldnn._linear_pointwise.binary(
        rows, other, packed, bias, "mul"),
)


def _zentorch() -> GemmBackend | None:
    if os.environ.get("VBATCH_ZENTORCH", "1") == "0":
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


@functools.cache
def gemm_backend() -> GemmBackend:
    """zentorch's GEMMs where they load, else oneDNN's (decided once per process)."""
    backend = _zentorch() or ONEDNN
    logger.info("CPU bf16 GEMMs: %s", backend.name)
    return backend


def describe(model: nn.Module) -> str | None:
    """The GEMM library of `model`'s packed linears ("zentorch 2.13.0.2", "onednn"), None if none is packed."""
    for module in model.modules():
        if isinstance(module, PackedLinear):
            if module.backend.name != "zentorch":
                return module.backend.name
            from importlib.metadata import PackageNotFoundError, version
            try:
                return f"zentorch {version('zentorch')}"
            except PackageNotFoundError:
                return "zentorch"
    return None


def can_pack(dtype: torch.dtype) -> bool:
    """True when this torch build and CPU run prepacked bf16 oneDNN linears."""
    if dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()) and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    except (AttributeError, RuntimeError):
        return False


def pack_weight(weight: torch.Tensor, backend: GemmBackend | None = None) -> torch.Tensor:  # [out, in] -> packed
    return (backend or gemm_backend()).pack(weight)


def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                  out_features: int, backend: GemmBackend | None = None) -> torch.Tensor:  # [..., in] -> [..., out]
    rows = x.reshape(-1, x.shape[-1])
    out = (backend or gemm_backend()).linear(rows, packed_weight, bias, "none")
    return out.view(*x.shape[:-1], out_features)


class PackedLinear(nn.Module):
    """`nn.Linear` with its weight in its GEMM library's blocked layout (zentorch's or oneDNN's, see
    `gemm_backend`); same forward signature and result.

    With the native kernels built (kernels/cpu_native.py), the plain [out, in] weight is kept too
    and up to `SMALL_ROWS` rows go through `cpu_linear_small.c` instead: oneDNN reads the weight at
    about 16 GB/s at one row, the native kernel at about 28 (whole model, 2 threads, measured
    here; 1.7x at 1-2 rows, 1.2x at 4, slower from 8). The price is a second copy of the weights
    (the tied logits head shares the embedding's storage, so it costs nothing)."""

    SMALL_ROWS = 4

    def __init__(self, linear: nn.Linear, pack: bool = True, backend: GemmBackend | None = None) -> None:
        super().__init__()
        from . import cpu_native
        self.backend = backend or gemm_backend()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Buffers, not parameters: nothing trains, and the packed tensor is not a plain [out, in] matrix.
        self.register_buffer("packed_weight", self.backend.pack(linear.weight) if pack else None, persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone(), persistent=False)
        self.native = cpu_native.load()
        self.register_buffer("weight", linear.weight.detach().contiguous() if self.native else None, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        small = self._small(x)
        if small is not None:
            return small
        return packed_linear(x, self.packed_weight, self.bias, self.out_features, self.backend)

    def _small(self, x: torch.Tensor) -> torch.Tensor | None:  # [..., in] -> [..., out] or None (not small)
        if self.native is not None and x.numel() <= self.SMALL_ROWS * self.in_features:
            rows = self.native.linear_small_bf16(x.reshape(-1, self.in_features), self.weight, self.bias,
                                                 torch.get_num_threads())
            if rows is not None:
                return rows.view(*x.shape[:-1], self.out_features)
        return None

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"gemm={self.backend.name}")


class PackedGateUp(PackedLinear):
    """The merged [gate; up] projection of a gated MLP, with `silu_and_mul(x)` fused into its GEMMs.

    `silu_and_mul(x)` == `silu_and_mul(self(x))` (activation_ref): above SMALL_ROWS rows it is two
    GEMMs (zentorch's or oneDNN's) over the packed gate and up halves, the first with SiLU applied to its fp32
    accumulator, the second multiplying its accumulator by the first's bf16 result, so the
    [rows, 2 * inter] product is never written, read back and converted (measured here, 2
    threads, SmolLM2's shapes: 8,192 rows 94 -> 73 ms, 2,048 rows 19.5 -> 18.5, 256 rows 2.5 ->
    2.3). Gate and up are not rounded to bf16 before the activation, so it differs from the
    reference by bf16 rounding only (tests/test_cpu_kernels.py). Up to SMALL_ROWS rows: the small-rows
    kernel and the native SiLU-and-mul, exactly as the separate ops (the fused decoder layer's
    equality test relies on it)."""

    def __init__(self, linear: nn.Linear, backend: GemmBackend | None = None) -> None:
        super().__init__(linear, pack=False, backend=backend)
        half = self.out_features // 2
        weight, bias = linear.weight.detach(), linear.bias
        self.register_buffer("packed_gate", self.backend.pack(weight[:half]), persistent=False)
        self.register_buffer("packed_up", self.backend.pack(weight[half:]), persistent=False)
        self.register_buffer("bias_gate", None if bias is None else bias.detach()[:half].clone(), persistent=False)
        self.register_buffer("bias_up", None if bias is None else bias.detach()[half:].clone(), persistent=False)

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
            from .cpu_native_ops import silu_and_mul
            return silu_and_mul(small)
        rows = x.reshape(-1, self.in_features)
        gate = self.backend.linear(rows, self.packed_gate, self.bias_gate, "silu")
        out = self.backend.linear_mul(rows, self.packed_up, self.bias_up, gate)
        return out.view(*x.shape[:-1], self.out_features // 2)


def pack_gate_up(linear: nn.Linear) -> nn.Module:
    """The packed twin of a gated MLP's merged gate/up `linear`, with `silu_and_mul` fused (bf16 only)."""
    if not can_pack(linear.weight.dtype):
        return linear
    return PackedGateUp(linear)


def pack_linear(linear: nn.Linear) -> nn.Module:
    """The packed twin of `linear` (bf16 only; any other dtype keeps the plain module)."""
    if not can_pack(linear.weight.dtype):
        return linear
    return PackedLinear(linear)
