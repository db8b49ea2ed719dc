"""Native CPU kernels: C sources in kernels/csrc, compiled once per machine and CPU tier, called through ctypes.

    load(tier=None, variants=("f32",)) -> NativeKernels | None   (None: no C compiler, a failed build, or
                                                                VBATCH_CPU_NATIVE=0)
    NativeKernels.prepare(variants)             build and bind more variants now (the others: on first use)
    NativeKernels.<kernel>(...)                 raw bindings, fp32 or bf16 by the tensors' dtype
                                                (the GEMMs' bindings: kernels/cpu_native_gemm.py)

The ops built on them, with the references' signatures, are in kernels/cpu_native_ops.py.

NOTE: why C and ctypes rather than a torch extension: the kernels need no torch headers (they take
raw pointers), so `cc` builds the variants an engine needs in about ten seconds on two cores, and the library links
the same OpenMP runtime torch already loaded (libgomp, by soname), so its threads are torch's
threads. How the library is compiled and cached, and its variants: kernels/native_build.py.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from . import q8_0
from .attention_metadata import AttentionMetadata
from .cpu_features import CpuTier, selected_tier
from .cpu_native_gemm import NativeGemms
from .cpu_native_structs import VbDecode, VbStep
from .native_build import (BASE_VARIANT, NativeKernelError, build, entry_points_of, entry_suffix, has_variant,
                           library_path)

logger = logging.getLogger("vbatch.kernels")

ACTIVATION_DTYPES = (torch.float32, torch.bfloat16)
# cpu_linear_small.c's weight formats (vb_kernels.h VB_WEIGHT_*); an int8 weight is always in the
# Q8_0 row layout (kernels/q8_0.py)
WEIGHT_FORMAT = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.int8: 3}
_ERRORS = {1: "unsupported shape (head_dim not a multiple of 16 or above 256, more than 16 query heads per kv head, "
               "or block size above 1024)",
           2: "out of memory for scratch buffers"}


@dataclass(frozen=True)
class NativeLoad:
    """One load of native kernel variants: when it ended (perf_counter()), how long it took, and
    whether it compiled (False: an earlier build of the same sources, flags and compiler was reused)."""
    done_at: float
    seconds: float
    compiled: bool


@dataclass(frozen=True)
class NativeKernels(NativeGemms):
    tier: CpuTier
    compiler: str | None = None   # None: $CC, cc or gcc (native_build.build)
    _libraries: dict = field(default_factory=dict, repr=False, compare=False)  # variant -> (its folder, bound ctypes.CDLL)
    _loads: list = field(default_factory=list, repr=False, compare=False)      # NativeLoad, in order
    _probes: dict = field(default_factory=dict, repr=False, compare=False)  # probe results (has_*), by key
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)  # one build at a time

    def prepare(self, variants: Sequence[str]) -> None:
        """Build (or find) and bind the variants (native_build.VARIANTS' suffixes) not loaded yet, in one
        pool of compiles. The engine asks for its own at start-up, so that no step compiles."""
        with self._lock:
            self._prepare([v for v in dict.fromkeys(variants) if v not in self._libraries])

    def _prepare(self, missing: list[str]) -> None:
        if not missing:
            return
        t0 = time.perf_counter()
        folder, compiled = build(self.tier, missing, compiler=self.compiler, compiling=self._say_compiling)
        for variant in missing:
            self._libraries[variant] = folder, _bind(library_path(folder, variant), variant)
        done = time.perf_counter()
        self._loads.append(NativeLoad(done, done - t0, any(compiled.values())))
        if any(compiled.values()):
            print(f"vbatch: compiled in {done - t0:.1f} s", file=sys.stderr, flush=True)

    def _say_compiling(self, folder: Path, variants: list[str]) -> None:
        # the one wait of a first run on a machine that vbatch does not otherwise explain
        print(f"vbatch: compiling the native CPU kernels for this machine ({self.tier.name} tier: "
              f"{', '.join(variants)}), once; kept in {folder}", file=sys.stderr, flush=True)

    @property
    def folder(self) -> Path:
        """The build folder of the tier's libraries (native_build.build; a benchmark's --against takes it)."""
        return next(iter(self._libraries.values()))[0]

    def library(self, variant: str) -> ctypes.CDLL:
        """`variant`'s library, built on first use."""
        if variant not in self._libraries:
            self.prepare([variant])
        return self._libraries[variant][1]

    def function(self, name: str, dtype: torch.dtype, kv_dtype: torch.dtype | None = None):
        """The entry point `name` for `dtype` activations over a `kv_dtype` KV cache (default: `dtype`),
        its argument types set."""
        variant = entry_suffix(dtype, kv_dtype)
        return getattr(self.library(variant), f"{name}_{variant}")

    def loads_since(self, started: float) -> list[NativeLoad]:
        """The loads that ended at or after `started` (perf_counter())."""
        return [load for load in self._loads if load.done_at >= started]

    def paged_attention(
        self,
        query: torch.Tensor,        # [num_tokens, num_q_heads, head_dim] fp32 / bf16
        key_cache: torch.Tensor,    # [num_blocks, block_size, num_kv_heads, head_dim]: query's dtype, fp16 / bf16
        value_cache: torch.Tensor,  # under fp32 queries, or fp8 (E4M3FN / E5M2) under either (VARIANTS)
        attn: AttentionMetadata,
        scale: float,
        num_threads: int,
    ) -> torch.Tensor:              # [num_tokens, num_q_heads, head_dim], query's dtype
        if query.stride(2) != 1 or query.stride(1) != query.shape[2]:  # rows may be apart (a qkv view)
            query = query.contiguous()
        out = torch.empty(query.shape, dtype=query.dtype)
        tables = attn.block_tables.contiguous()
        start, lens = attn.query_start_loc.contiguous(), attn.seq_lens.contiguous()
        assert tables.dtype == start.dtype == lens.dtype == torch.int32
        assert key_cache.is_contiguous() and value_cache.is_contiguous()
        assert key_cache.dtype == value_cache.dtype
        _, block_size, num_kv_heads, head_dim = key_cache.shape
        rc = self.function("vb_paged_attention", query.dtype, key_cache.dtype)(
            query.data_ptr(), query.stride(0), out.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
            tables.data_ptr(), tables.stride(0), start.data_ptr(), lens.data_ptr(), attn.num_reqs,
            query.shape[1], num_kv_heads, head_dim, block_size, scale, num_threads)
        if rc != 0:
            raise NativeKernelError(f"native paged attention: {_ERRORS.get(rc, f'error {rc}')}")
        return out

    def encoder_attention(
        self,
        q: torch.Tensor,            # [num_tokens, num_heads, head_dim] fp32 / bf16, rows any stride apart
        k: torch.Tensor,            # [num_tokens, num_kv_heads, head_dim], the same row stride as q
        v: torch.Tensor,
        seq_lens: Sequence[int],
        scale: float,
        num_threads: int,
    ) -> torch.Tensor | None:       # [num_tokens, num_heads, head_dim]; None: a layout it does not take
        """kernels/csrc/cpu_encoder_attention.c; the reference is encoder_attention_ref.py."""
        t, heads, dim = q.shape
        if (q.dtype not in ACTIVATION_DTYPES or not (q.dtype == k.dtype == v.dtype) or dim % 16 or dim > 256
                or not (q.stride(0) == k.stride(0) == v.stride(0)) or q.stride(1) != dim or k.stride(1) != dim
                or v.stride(1) != dim or q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1):
            return None
        lens = torch.tensor(seq_lens, dtype=torch.int32)
        starts = torch.cumsum(lens, 0, dtype=torch.int64) - lens
        out = torch.empty((t, heads, dim), dtype=q.dtype)
        rc = self.function("vb_encoder_attention", q.dtype)(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), q.stride(0), out.data_ptr(), starts.data_ptr(),
            lens.data_ptr(), len(seq_lens), heads, k.shape[1], dim, scale, num_threads)
        if rc != 0:
            raise NativeKernelError("native encoder attention: out of memory for its scratch")
        return out

    def linear_small(
        self,
        rows: torch.Tensor,         # [M, in] fp32 / bf16, M <= 32 (cpu_linear_small.c's MAX_ROWS)
        weight: torch.Tensor,       # [out, in] contiguous: fp32, fp16 or bf16 (fp32 rows), bf16 (bf16 rows);
                                    # or int8 [out, in * 17 / 16], Q8_0 rows (kernels/q8_0.py; fp32 rows)
        bias: torch.Tensor | None,  # [out], rows' dtype
        num_threads: int,
    ) -> torch.Tensor | None:       # [M, out], rows' dtype; None: no such kernel in this build / M > 32
        rows = rows.contiguous()
        in_features = q8_0.in_features_of(weight) if weight.dtype == torch.int8 else weight.shape[1]
        assert weight.is_contiguous() and rows.shape[1] == in_features
        out = torch.empty(rows.shape[0], weight.shape[0], dtype=rows.dtype)
        rc = self.function("vb_linear_small", rows.dtype)(
            rows.data_ptr(), weight.data_ptr(), WEIGHT_FORMAT[weight.dtype], None if bias is None else bias.data_ptr(),
            out.data_ptr(), rows.shape[0], weight.shape[0], in_features, num_threads)
        return out if rc == 0 else None

    def read_probe(self, buffer: torch.Tensor, streams: int, num_threads: int) -> int:
        """Read `buffer` (contiguous, a whole number of 8-byte words) once, each thread its share as
        `streams` (1, 2, 4, 8) sequential streams side by side (cpu_read_probe.c): for timing the
        memory system. Returns the wrapping sum of its 64-bit words."""
        assert buffer.is_contiguous() and streams in (1, 2, 4, 8) and buffer.numel() * buffer.element_size() % 8 == 0
        return self.function("vb_read_probe", torch.float32)(buffer.data_ptr(), buffer.numel() * buffer.element_size(),
                                                         streams, num_threads)

    def fma_probe(self, iters: int, x: float, y: float, num_threads: int) -> float:
        """Run independent chains of a = a * x + y (chain c from 1 + c / 16, in every lane of this tier's
        vectors) for `iters` steps in each of `num_threads` threads (cpu_fma_probe.c): for timing the
        cores' multiply-add peak, 2 x fma_width FLOPs per step and thread. Returns the sum of the final
        values."""
        return self.function("vb_fma_probe", torch.float32)(iters, x, y, num_threads)

    @property
    def fma_width(self) -> int:
        """Multiply-adds per step and thread of fma_probe (this tier's fp32 lanes x its chains)."""
        return int(self.function("vb_fma_width", torch.float32)())

    @property
    def vector_lanes(self) -> int:
        """fp32 lanes of this tier's vectors (16 AVX-512, 8 AVX2, 4 portable on SSE2/NEON)."""
        return int(self.function("vb_vector_lanes", torch.float32)())

    def has_small_linear(self, dtype: torch.dtype, weight_dtype: torch.dtype | None = None) -> bool:
        """Whether this build has the small-rows linear kernel for `dtype` rows and `weight_dtype`
        weights (default: the rows' dtype; int8: Q8_0 rows); bf16 rows need avx512_bf16, Q8_0 fp32 rows."""
        weight_dtype = weight_dtype or dtype
        key = (dtype, weight_dtype)
        if key not in self._probes:
            probe = torch.zeros(1, q8_0.BLOCK, dtype=dtype)
            weights = (q8_0.quantize(torch.zeros(16, q8_0.BLOCK)) if weight_dtype == torch.int8
                       else torch.zeros(16, q8_0.BLOCK, dtype=weight_dtype))
            self._probes[key] = (has_variant(dtype) and weight_dtype in WEIGHT_FORMAT
                                       and self.linear_small(probe, weights, None, 1) is not None)
        return self._probes[key]

    def decoder_layers(self, layers: ctypes.Array, step: VbStep, key_caches: ctypes.Array, value_caches: ctypes.Array,
                       kv_dtype: torch.dtype, hidden: torch.Tensor, residual: torch.Tensor, first_layer: bool,
                       num_threads: int) -> None:
        """Consecutive layers in one call, in place: hidden [rows, hidden] becomes the last layer's
        output, residual the updated stream. layers: a ctypes array of VbLayer; key_caches and
        value_caches: ctypes arrays of the layers' cache pointers (contiguous caches of kv_dtype), as
        many as `layers`."""
        assert len(key_caches) == len(value_caches) == len(layers)
        rc = self.function("vb_decoder_layers", hidden.dtype, kv_dtype)(
            layers, len(layers), ctypes.byref(step), key_caches, value_caches, hidden.data_ptr(), residual.data_ptr(),
            int(first_layer), num_threads)
        if rc != 0:
            raise NativeKernelError(f"native decoder layers: {_ERRORS.get(rc, f'error {rc}')}")

    def decode_steps(self, layers: ctypes.Array, step: VbStep, decode: VbDecode, key_caches: ctypes.Array,
                     value_caches: ctypes.Array, kv_dtype: torch.dtype, tokens: torch.Tensor, positions: torch.Tensor,
                     hidden: torch.Tensor, residual: torch.Tensor, num_threads: int) -> int:
        """Up to tokens.shape[0] - 1 decode steps (cpu_decode_steps.c): tokens [steps + 1, rows]
        int64, row 0 the tokens fed at positions [rows] int64; each step writes the next row. hidden and
        residual: [rows, hidden] scratch of the model's dtype. Returns the steps run (fewer when a row
        sampled one of its stop tokens: the call ends with that step)."""
        assert tokens.is_contiguous() and positions.is_contiguous() and tokens.dtype == positions.dtype == torch.int64
        done = self.function("vb_decode_steps", hidden.dtype, kv_dtype)(
            layers, len(layers), ctypes.byref(step), ctypes.byref(decode), key_caches, value_caches, tokens.data_ptr(),
            positions.data_ptr(), hidden.data_ptr(), residual.data_ptr(), tokens.shape[0] - 1, num_threads)
        if done < 0:
            raise NativeKernelError("native decode steps: " + ("arguments out of range" if done == -100
                                                               else _ERRORS.get(-done, f"error {-done}")))
        return done

    def sample(self, logits: torch.Tensor, temperature: torch.Tensor | None, u: torch.Tensor | None,
               num_threads: int) -> torch.Tensor:
        """logits [rows, vocab] fp32 / bf16 (unit element stride); temperature [rows] (0: greedy; None:
        every row greedy), u [rows] in [0, 1) (None when every row is greedy) -> [rows] int64 token ids
        (cpu_sample.c)."""
        assert logits.stride(1) == 1
        if temperature is not None:
            temperature = temperature.to(torch.float32).contiguous()
            u = u.to(torch.float32).contiguous()
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        rc = self.function("vb_sample", logits.dtype)(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1],
                                                 None if temperature is None else temperature.data_ptr(),
                                                 None if temperature is None else u.data_ptr(), out.data_ptr(),
                                                 num_threads)
        if rc != 0:
            raise NativeKernelError(f"native sampler: {_ERRORS.get(rc, f'error {rc}')}")
        return out

    def rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 num_threads: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x, residual: [..., hidden] contiguous; weight [hidden], x's dtype -> (normed, x + residual)."""
        out = torch.empty_like(x)
        new_residual = None if residual is None else torch.empty_like(x)
        self.function("vb_rms_norm", x.dtype)(
            x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), eps,
            out.data_ptr(), None if new_residual is None else new_residual.data_ptr(),
            x.numel() // x.shape[-1], x.shape[-1], num_threads)
        return out, new_residual

    def silu_and_mul(self, x: torch.Tensor, num_threads: int) -> torch.Tensor:
        """x: [..., 2d] contiguous (gate | up) -> [..., d]."""
        d = x.shape[-1] // 2
        out = torch.empty(*x.shape[:-1], d, dtype=x.dtype)
        self.function("vb_silu_and_mul", x.dtype)(x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], d, num_threads)
        return out

    def rotary_(self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                num_threads: int) -> None:
        """In place. query [T, Hq, D], key [T, Hk, D] with unit head and element strides (rows may be
        apart: views of the fused qkv output); cos, signed_sin [T, D] contiguous, query's dtype."""
        self.function("vb_rotary", query.dtype)(
            query.data_ptr(), query.stride(0), query.shape[1], key.data_ptr(), key.stride(0), key.shape[1],
            cos.data_ptr(), signed_sin.data_ptr(), query.shape[0], query.shape[2], num_threads)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                 value_cache: torch.Tensor, slots: torch.Tensor, num_threads: int) -> None:
        """key, value [T, Hk, D] (rows may be apart); caches contiguous, in key's dtype, a half precision
        (rounded to nearest even, as .to() does) or fp8 (rounded so, and saturated: cache_ref's clamp
        and .to()); slots [T] int64 contiguous."""
        self.function("vb_write_kv", key.dtype, key_cache.dtype)(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                                           key_cache.data_ptr(), value_cache.data_ptr(), slots.data_ptr(),
                                           key.shape[0], key.shape[1] * key.shape[2], num_threads)


def _bind(path: Path, variant: str) -> ctypes.CDLL:
    """`variant`'s library at `path`, its entry points' argument and result types set."""
    lib = ctypes.CDLL(str(path))
    p, i32, i64, f32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float
    signatures = {  # name: (argtypes, restype)
        "vb_paged_attention": ([p, i64, p, p, p, p, i64, p, p, i32, i32, i32, i32, i32, f32, i32], ctypes.c_int),
        "vb_linear_small": ([p, p, i32, p, p, i32, i32, i32, i32], ctypes.c_int),
        "vb_rms_norm": ([p, p, p, f32, p, p, i64, i32, i32], None),
        "vb_silu_and_mul": ([p, p, i64, i32, i32], None),
        "vb_rotary": ([p, i64, i32, p, i64, i32, p, p, i64, i32, i32], None),
        "vb_write_kv": ([p, i64, p, i64, p, p, p, i64, i32, i32], None),
        "vb_decoder_layers": ([p, i32, p, p, p, p, p, i32, i32], ctypes.c_int),
        "vb_sample": ([p, i64, i32, i32, p, p, p, i32], ctypes.c_int),
        "vb_decode_steps": ([p, i32, p, p, p, p, p, p, p, p, i32, i32], ctypes.c_int),
        "vb_encoder_attention": ([p, p, p, i64, p, p, p, i32, i32, i32, i32, f32, i32], ctypes.c_int),
        "vb_read_probe": ([p, i64, i32, i32], ctypes.c_uint64),
        "vb_fma_probe": ([i64, f32, f32, i32], ctypes.c_float),
        "vb_gemm": ([p, i64, p, p, p, i64, i32, i32, i32, i32], ctypes.c_int),
        "vb_gemm_f16": ([p, i64, p, p, p, i64, i32, i32, i32, i32], ctypes.c_int),
        "vb_gemm_gated": ([p, i64, p, p, p, i64, i32, i32, i32, i32, i32], ctypes.c_int),
        "vb_gemm_gated_f16": ([p, i64, p, p, p, i64, i32, i32, i32, i32, i32], ctypes.c_int),
        "vb_gemm_q8": ([p, i64, p, p, p, i64, i32, i32, i32, i32, i32], ctypes.c_int),
        "vb_gemm_q8_gated": ([p, i64, p, p, p, i64, i32, i32, i32, i32, i32], ctypes.c_int),
        "vb_fma_width": ([], ctypes.c_int),
        "vb_vector_lanes": ([], ctypes.c_int),
    }
    names = entry_points_of(variant) or signatures
    for name in names:
        argtypes, restype = signatures[name]
        fn = getattr(lib, f"{name}_{variant}")
        fn.argtypes, fn.restype = argtypes, restype
    return lib


_loaded: dict[str, NativeKernels | None] = {}


def load(tier: CpuTier | None = None, variants: Sequence[str] = (BASE_VARIANT,)) -> NativeKernels | None:
    """The native kernels of `tier` (default: cpu_features.selected_tier()) with `variants` (suffixes of
    native_build.VARIANTS; default the fp32 one, the probes' and GEMMs') built now, the others on first
    use; None (logged once) when they cannot be had."""
    tier = tier or selected_tier()
    if tier.name not in _loaded:
        _loaded[tier.name] = None
        if os.environ.get("VBATCH_CPU_NATIVE", "1") != "0":
            try:
                kernels = NativeKernels(tier)
                kernels.prepare(variants)
                _loaded[tier.name] = kernels
            except Exception as e:  # noqa: BLE001 - no compiler / failed build: the torch path runs instead
                logger.warning("native CPU kernels (%s tier) unavailable (%s); using the torch path", tier.name, e)
        return _loaded[tier.name]
    kernels = _loaded[tier.name]
    if kernels is not None:
        kernels.prepare(variants)
    return kernels
