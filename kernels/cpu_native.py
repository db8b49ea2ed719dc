"""Native CPU kernels: C sources in kernels/csrc, compiled once per machine, called through ctypes.

    load() -> NativeKernels | None   (None: no C compiler, a failed build, or VBATCH_CPU_NATIVE=0)
    NativeKernels.<kernel>_bf16(...)  raw bindings, one per C entry point (shapes checked by callers)

The ops built on them, with the references' signatures, are in kernels/cpu_native_ops.py.

NOTE: why C and ctypes rather than a torch extension: the kernel needs no torch headers (it takes
raw pointers), so one `cc` call builds it in about a second instead of a minute, and the library
links the same OpenMP runtime torch already loaded (libgomp, by soname), so its threads are
torch's threads. The build goes to $VBATCH_CACHE/kernels/<hash of source, flags and compiler>/,
written to a temporary name and renamed, so concurrent processes never load a half-written file.
NOTE: -march=native: the library is built on the machine that runs it (the cache key includes
the host's CPU flags), never shipped.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .attention_metadata import AttentionMetadata

logger = logging.getLogger("vbatch.kernels")

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "cpu_paged_attention.c", CSRC / "cpu_linear_small.c", CSRC / "cpu_elementwise.c",
           CSRC / "cpu_decoder_layer.c", CSRC / "cpu_sample.c")
HEADERS = (CSRC / "vb_simd.h", CSRC / "vb_kernels.h")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared",
         "-std=gnu11", "-ffp-contract=fast", "-Wall")
_ERRORS = {1: "unsupported shape (head_dim not a multiple of 16 or above 256, more than 16 query heads per kv head, "
               "or block size above 1024)",
           2: "out of memory for scratch buffers"}


class VbLayer(ctypes.Structure):
    """cpu_decoder_layer.c's VbLayer: one decoder layer's weights (pointers) and sizes."""

    _fields_ = [(name, ctypes.c_void_p) for name in (
        "input_norm", "post_norm", "qkv_weight", "qkv_bias", "o_weight", "o_bias", "gate_up_weight",
        "gate_up_bias", "down_weight", "down_bias")] + [
        (name, ctypes.c_int) for name in ("hidden", "num_q_heads", "num_kv_heads", "head_dim", "intermediate")] + [
        ("eps", ctypes.c_float), ("scale", ctypes.c_float)]


class VbStep(ctypes.Structure):
    """cpu_decoder_layer.c's VbStep: what every layer of one step shares (pointers) and scratch rows."""

    _fields_ = [("rows", ctypes.c_int), ("cos", ctypes.c_void_p), ("signed_sin", ctypes.c_void_p),
                ("slots", ctypes.c_void_p), ("block_tables", ctypes.c_void_p), ("table_stride", ctypes.c_int64),
                ("query_start", ctypes.c_void_p), ("seq_lens", ctypes.c_void_p), ("num_reqs", ctypes.c_int),
                ("block_size", ctypes.c_int)] + [
        (name, ctypes.c_void_p) for name in ("normed", "qkv", "attn", "proj", "gate_up", "act")]


class NativeKernelError(RuntimeError):
    """A native kernel refused its arguments (shape it was not built for, out of memory)."""


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return os.uname().machine


def _cache_dir() -> Path:
    return Path(os.environ.get("VBATCH_CACHE", Path.home() / ".cache" / "vbatch")) / "kernels"


def build(compiler: str | None = None) -> tuple[Path, bool]:
    """Compile the C source (or reuse an earlier build): (the shared library's path, True when it
    was compiled now rather than reused from the cache)."""
    cc = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise FileNotFoundError("no C compiler (cc/gcc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    texts = [source.read_text() for source in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*texts, " ".join(FLAGS), version, _cpu_flags()]).encode())
    target = _cache_dir() / key.hexdigest()[:16] / "libvbatch_cpu.so"
    if target.exists():
        return target, False
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *FLAGS, f"-I{CSRC}", *map(str, SOURCES), "-o", tmp], capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed to build {', '.join(s.name for s in SOURCES)}:\n{proc.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target, True


@dataclass(frozen=True)
class NativeKernels:
    library: ctypes.CDLL
    path: Path
    build_seconds: float   # finding or compiling the library (compiling: about a second per source)
    compiled_now: bool     # False: an earlier build of the same source, flags and compiler was reused

    def paged_attention_bf16(
        self,
        query: torch.Tensor,        # [num_tokens, num_q_heads, head_dim] bf16
        key_cache: torch.Tensor,    # [num_blocks, block_size, num_kv_heads, head_dim] bf16
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] bf16
        attn: AttentionMetadata,
        scale: float,
        num_threads: int,
    ) -> torch.Tensor:              # [num_tokens, num_q_heads, head_dim] bf16
        if query.stride(2) != 1 or query.stride(1) != query.shape[2]:  # rows may be apart (a qkv view)
            query = query.contiguous()
        out = torch.empty(query.shape, dtype=query.dtype)
        tables = attn.block_tables.contiguous()
        start, lens = attn.query_start_loc.contiguous(), attn.seq_lens.contiguous()
        assert tables.dtype == start.dtype == lens.dtype == torch.int32
        assert key_cache.is_contiguous() and value_cache.is_contiguous()
        _, block_size, num_kv_heads, head_dim = key_cache.shape
        rc = self.library.vb_paged_attention_bf16(
            query.data_ptr(), query.stride(0), out.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
            tables.data_ptr(), tables.stride(0), start.data_ptr(), lens.data_ptr(), attn.num_reqs,
            query.shape[1], num_kv_heads, head_dim, block_size, scale, num_threads)
        if rc != 0:
            raise NativeKernelError(f"native paged attention: {_ERRORS.get(rc, f'error {rc}')}")
        return out

    def linear_small_bf16(
        self,
        rows: torch.Tensor,         # [M, in] bf16, M <= 8 (cpu_linear_small.c's MAX_ROWS)
        weight: torch.Tensor,       # [out, in] bf16, contiguous
        bias: torch.Tensor | None,  # [out] bf16
        num_threads: int,
    ) -> torch.Tensor | None:       # [M, out] bf16; None: no such kernel in this build / M > 8
        rows = rows.contiguous()
        out = torch.empty(rows.shape[0], weight.shape[0], dtype=rows.dtype)
        rc = self.library.vb_linear_small_bf16(
            rows.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(), out.data_ptr(),
            rows.shape[0], weight.shape[0], weight.shape[1], num_threads)
        return out if rc == 0 else None

    def decoder_layer_bf16(self, layer: VbLayer, step: VbStep, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           hidden: torch.Tensor, residual: torch.Tensor, first_layer: bool, num_threads: int) -> None:
        """In place: hidden [rows, hidden] becomes the layer's output, residual the updated stream."""
        rc = self.library.vb_decoder_layer_bf16(ctypes.byref(layer), ctypes.byref(step), key_cache.data_ptr(),
                                                value_cache.data_ptr(), hidden.data_ptr(), residual.data_ptr(),
                                                int(first_layer), num_threads)
        if rc != 0:
            raise NativeKernelError(f"native decoder layer: {_ERRORS.get(rc, f'error {rc}')}")

    def sample_bf16(self, logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor,
                    num_threads: int) -> torch.Tensor:
        """logits [rows, vocab] bf16 (unit element stride); temperature [rows] (0: greedy), u [rows]
        in [0, 1) -> [rows] int64 token ids (cpu_sample.c)."""
        assert logits.stride(1) == 1
        temperature = temperature.to(torch.float32).contiguous()
        u = u.to(torch.float32).contiguous()
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        rc = self.library.vb_sample_bf16(logits.data_ptr(), logits.stride(0), logits.shape[0], logits.shape[1],
                                         temperature.data_ptr(), u.data_ptr(), out.data_ptr(), num_threads)
        if rc != 0:
            raise NativeKernelError(f"native sampler: {_ERRORS.get(rc, f'error {rc}')}")
        return out

    @functools.cached_property
    def has_small_linear(self) -> bool:
        """Whether this build has the small-rows linear kernel (it needs avx512_bf16)."""
        probe = torch.zeros(1, 32, dtype=torch.bfloat16)
        return self.linear_small_bf16(probe, torch.zeros(16, 32, dtype=torch.bfloat16), None, 1) is not None

    def rms_norm_bf16(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                      num_threads: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x, residual: [..., hidden] bf16 contiguous; weight [hidden] bf16 -> (normed, x + residual)."""
        out = torch.empty_like(x)
        new_residual = None if residual is None else torch.empty_like(x)
        self.library.vb_rms_norm_bf16(
            x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(), eps,
            out.data_ptr(), None if new_residual is None else new_residual.data_ptr(),
            x.numel() // x.shape[-1], x.shape[-1], num_threads)
        return out, new_residual

    def silu_and_mul_bf16(self, x: torch.Tensor, num_threads: int) -> torch.Tensor:
        """x: [..., 2d] bf16 contiguous (gate | up) -> [..., d]."""
        d = x.shape[-1] // 2
        out = torch.empty(*x.shape[:-1], d, dtype=x.dtype)
        self.library.vb_silu_and_mul_bf16(x.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1], d, num_threads)
        return out

    def rotary_bf16_(self, query: torch.Tensor, key: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                     num_threads: int) -> None:
        """In place. query [T, Hq, D], key [T, Hk, D] bf16 with unit head and element strides (rows
        may be apart: views of the fused qkv output); cos, signed_sin [T, D] bf16 contiguous."""
        self.library.vb_rotary_bf16(query.data_ptr(), query.stride(0), query.shape[1], key.data_ptr(), key.stride(0),
                                    key.shape[1], cos.data_ptr(), signed_sin.data_ptr(), query.shape[0],
                                    query.shape[2], num_threads)

    def write_kv_bf16(self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, slots: torch.Tensor) -> None:
        """key, value [T, Hk, D] bf16 (rows may be apart); caches contiguous; slots [T] int64 contiguous."""
        self.library.vb_write_kv_bf16(key.data_ptr(), key.stride(0), value.data_ptr(), value.stride(0),
                                      key_cache.data_ptr(), value_cache.data_ptr(), slots.data_ptr(),
                                      key.shape[0], key.shape[1] * key.shape[2])


def _bind(path: Path, build_seconds: float, compiled_now: bool) -> NativeKernels:
    lib = ctypes.CDLL(str(path))
    fn = lib.vb_paged_attention_bf16
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    fn.argtypes = [p, i64, p, p, p, p, i64, p, p, i32, i32, i32, i32, i32, ctypes.c_float, i32]
    fn.restype = ctypes.c_int
    fn = lib.vb_linear_small_bf16
    fn.argtypes = [p, p, p, p, i32, i32, i32, i32]
    fn.restype = ctypes.c_int
    f32 = ctypes.c_float
    for name, argtypes in (("vb_rms_norm_bf16", [p, p, p, f32, p, p, i64, i32, i32]),
                           ("vb_silu_and_mul_bf16", [p, p, i64, i32, i32]),
                           ("vb_rotary_bf16", [p, i64, i32, p, i64, i32, p, p, i64, i32, i32]),
                           ("vb_write_kv_bf16", [p, i64, p, i64, p, p, p, i64, i32])):
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = argtypes, None
    fn = lib.vb_decoder_layer_bf16
    fn.argtypes = [p, p, p, p, p, p, i32, i32]
    fn.restype = ctypes.c_int
    fn = lib.vb_sample_bf16
    fn.argtypes = [p, i64, i32, i32, p, p, p, i32]
    fn.restype = ctypes.c_int
    return NativeKernels(lib, path, build_seconds, compiled_now)


_loaded: NativeKernels | None | bool = False


def load() -> NativeKernels | None:
    """The native kernels, built on first use; None (logged once) when they cannot be had."""
    global _loaded
    if _loaded is False:
        _loaded = None
        if os.environ.get("VBATCH_CPU_NATIVE", "1") != "0":
            try:
                t0 = time.perf_counter()
                path, compiled_now = build()
                _loaded = _bind(path, time.perf_counter() - t0, compiled_now)
            except Exception as e:  # noqa: BLE001 - no compiler / failed build: the torch path runs instead
                logger.warning("native CPU kernels unavailable (%s); using the compiled torch path", e)
    return _loaded

