"""Native CPU kernels: C sources in kernels/csrc, compiled once per machine, called through ctypes.

    load() -> NativeKernels | None   (None: no C compiler, a failed build, or VBATCH_CPU_NATIVE=0)
    NativeKernels.paged_attention_bf16(query, key_cache, value_cache, attn, scale, num_threads) -> out

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
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from .attention_metadata import AttentionMetadata

logger = logging.getLogger("vbatch.kernels")

SOURCES = (Path(__file__).with_name("csrc") / "cpu_paged_attention.c",
           Path(__file__).with_name("csrc") / "cpu_linear_small.c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math", "-fPIC", "-shared",
         "-std=gnu11", "-ffp-contract=fast", "-Wall")
_ERRORS = {1: "unsupported shape (head_dim not a multiple of 16 or above 256, more than 16 query heads per kv head, "
               "or block size above 1024)",
           2: "out of memory for scratch buffers"}


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


def build(compiler: str | None = None) -> Path:
    """Compile the C source (or reuse an earlier build) and return the shared library's path."""
    cc = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise FileNotFoundError("no C compiler (cc/gcc) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    texts = [source.read_text() for source in SOURCES]
    key = hashlib.sha256("\0".join([*texts, " ".join(FLAGS), version, _cpu_flags()]).encode())
    target = _cache_dir() / key.hexdigest()[:16] / "libvbatch_cpu.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([cc, *FLAGS, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed to build {', '.join(s.name for s in SOURCES)}:\n{proc.stderr[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


@dataclass(frozen=True)
class NativeKernels:
    library: ctypes.CDLL
    path: Path

    def paged_attention_bf16(
        self,
        query: torch.Tensor,        # [num_tokens, num_q_heads, head_dim] bf16
        key_cache: torch.Tensor,    # [num_blocks, block_size, num_kv_heads, head_dim] bf16
        value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] bf16
        attn: AttentionMetadata,
        scale: float,
        num_threads: int,
    ) -> torch.Tensor:              # [num_tokens, num_q_heads, head_dim] bf16
        query = query.contiguous()
        out = torch.empty_like(query)
        tables = attn.block_tables.contiguous()
        start, lens = attn.query_start_loc.contiguous(), attn.seq_lens.contiguous()
        assert tables.dtype == start.dtype == lens.dtype == torch.int32
        assert key_cache.is_contiguous() and value_cache.is_contiguous()
        _, block_size, num_kv_heads, head_dim = key_cache.shape
        rc = self.library.vb_paged_attention_bf16(
            query.data_ptr(), out.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(),
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


def _bind(path: Path) -> NativeKernels:
    lib = ctypes.CDLL(str(path))
    fn = lib.vb_paged_attention_bf16
    p, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    fn.argtypes = [p, p, p, p, p, i64, p, p, i32, i32, i32, i32, i32, ctypes.c_float, i32]
    fn.restype = ctypes.c_int
    fn = lib.vb_linear_small_bf16
    fn.argtypes = [p, p, p, p, i32, i32, i32, i32]
    fn.restype = ctypes.c_int
    return NativeKernels(lib, path)


_loaded: NativeKernels | None | bool = False


def load() -> NativeKernels | None:
    """The native kernels, built on first use; None (logged once) when they cannot be had."""
    global _loaded
    if _loaded is False:
        _loaded = None
        if os.environ.get("VBATCH_CPU_NATIVE", "1") != "0":
            try:
                _loaded = _bind(build())
            except Exception as e:  # noqa: BLE001 - no compiler / failed build: the torch path runs instead
                logger.warning("native CPU kernels unavailable (%s); using the compiled torch path", e)
    return _loaded


def paged_attention(
    query: torch.Tensor,        # [num_tokens, num_q_heads, head_dim] bf16
    key_cache: torch.Tensor,    # [num_blocks, block_size, num_kv_heads, head_dim] bf16
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim] bf16
    attn: AttentionMetadata,
    scale: float,
) -> torch.Tensor:              # [num_tokens, num_q_heads, head_dim] bf16
    """`attention_ref.paged_attention`'s contract through the C kernel: decode and prefill rows of
    the whole step in one call, on torch's thread count. Bound by kernels/ops.py only after
    `load()` succeeded; shapes the kernel was not built for take the compiled torch path."""
    from . import cpu_attention
    kernels = load()
    if kernels is not None:
        try:
            return kernels.paged_attention_bf16(query, key_cache, value_cache, attn, scale,
                                                torch.get_num_threads())
        except NativeKernelError as e:
            _warn_once(str(e))
    return cpu_attention.paged_attention(query, key_cache, value_cache, cpu_attention.prepare_attention(attn),
                                         scale)


_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        logger.warning("%s; using the compiled torch path", message)
