"""Physical ceilings for decode on this machine: measured GEMM rate and memory bandwidth -> tok/s.

Called by `vbatch bench throughput --ceilings` / `--latency` (cli/bench.py) and by the scripts
`bench/ceilings.py` and `bench/peers.py`. The napkin math (llm.c style):

- large-batch decode is compute-bound: each token costs 2 x (parameters in linear layers) FLOPs,
  so the ceiling is  measured GEMM FLOP/s / (2 x linear params)  tokens/s;
- batch-1 decode is bandwidth-bound: each token reads every linear weight once, so the ceiling is
  measured bytes/s / (linear params x bytes per element)  tokens/s.

Attention, norms and the sampler are left out: the ceilings are upper bounds, not predictions.
The math is pure (tested on known numbers); only `measure_*` touch torch.
"""
from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

DECODE_SHAPE = (256, 576, 1536)
"""(tokens, in, out) of the GEMM measured: a batch-256 decode step through SmolLM2's MLP up-projection."""


@dataclass(frozen=True)
class LinearShape:
    """Parameters in the linear layers of a llama-family decoder, from its config."""

    per_layer: int
    num_layers: int
    lm_head: int

    @property
    def total(self) -> int:
        return self.per_layer * self.num_layers + self.lm_head


def linear_params(config) -> LinearShape:
    """q, k, v, o, gate, up, down per layer, plus lm_head (counted even when tied to the embedding:
    decode multiplies by it every token). `config` is an HF config or anything with its fields."""
    hidden = int(config.hidden_size)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or hidden // heads)
    inter = int(config.intermediate_size)
    attn = hidden * heads * head_dim * 2 + hidden * kv_heads * head_dim * 2  # q, o + k, v
    mlp = 3 * hidden * inter                                                 # gate, up, down
    return LinearShape(per_layer=attn + mlp, num_layers=int(config.num_hidden_layers),
                       lm_head=hidden * int(config.vocab_size))


def compute_ceiling_tok_s(num_linear_params: int, gemm_flops_per_s: float) -> float:
    """Large-batch decode: tokens/s if every FLOP ran at the measured GEMM rate."""
    return gemm_flops_per_s / (2.0 * num_linear_params)


def bandwidth_ceiling_tok_s(num_linear_params: int, bytes_per_param: float, bytes_per_s: float) -> float:
    """Batch-1 decode: tokens/s if each token read every linear weight once at the measured bandwidth."""
    return bytes_per_s / (num_linear_params * bytes_per_param)


@dataclass(frozen=True)
class MachineRates:
    threads: int
    gemm_gflops: dict[str, float]
    """dtype name ('bfloat16', 'float32') -> GFLOP/s at DECODE_SHAPE (the best of the repeats)."""
    read_gb_s: float
    """Memory read bandwidth: a sum over a tensor far larger than the caches."""
    copy_gb_s: float
    """Memory copy bandwidth counting bytes read + written."""

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Ceilings:
    dtype: str
    num_linear_params: int
    compute_tok_s: float
    """Large-batch decode ceiling for `dtype`."""
    bandwidth_tok_s: float
    """Batch-1 decode ceiling: the linear weights, as stored, read once per token."""
    weight_dtype: str = ""
    """How the weights are stored (the bytes the bandwidth ceiling counts); default `dtype`."""

    def to_dict(self) -> dict:
        return asdict(self)


def ceilings_for(config, dtype: str, rates: MachineRates, weight_dtype: str | None = None) -> Ceilings:
    """The ceilings of a `dtype` model whose linear weights are stored as `weight_dtype` (default:
    `dtype`; an fp32 model streaming fp16 weights reads 2 bytes per weight, computes at the fp32 rate;
    q8_0 reads 17/16 bytes: an int8 and a 32nd of an fp16 scale)."""
    n = linear_params(config).total
    weight_dtype = weight_dtype or dtype
    nbytes = {"bfloat16": 2, "float16": 2, "q8_0": 17 / 16}.get(weight_dtype, 4)
    gflops = rates.gemm_gflops.get(dtype) or rates.gemm_gflops["float32"]
    return Ceilings(dtype=dtype, num_linear_params=n,
                    compute_tok_s=compute_ceiling_tok_s(n, gflops * 1e9),
                    bandwidth_tok_s=bandwidth_ceiling_tok_s(n, nbytes, rates.read_gb_s * 1e9),
                    weight_dtype=weight_dtype)


def _best_seconds(fn, repeats: int, min_seconds: float = 0.05) -> float:
    """The fastest of `repeats` timings (each the mean over >= min_seconds of calls).

    NOTE: the fastest, not the median: a ceiling is what the machine can do, and on a shared
    machine every interference only slows a run down (a peers run once measured 206 GFLOP/s
    against 384-427 in quiet minutes, which made vbatch "107% of the ceiling")."""
    fn()  # warm-up: first calls pick kernels and fault in pages
    times = []
    for _ in range(repeats):
        n, t0 = 0, time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= min_seconds:
                break
        times.append(elapsed / n)
    return min(times)


def measure_gemm_gflops(dtype_name: str, shape: tuple[int, int, int] = DECODE_SHAPE, repeats: int = 7) -> float:
    """GFLOP/s of the linear decode makes at `shape` = (tokens, in, out): the engine's own path
    (on CPU the prepacked weight of kernels/cpu_linear.py in the library the engine uses; plain
    `F.linear`, which reorders a bf16 weight on every call, would understate the machine)."""
    import torch
    import torch.nn.functional as F

    from ..kernels import cpu_linear, gemm_libraries

    dtype = getattr(torch, dtype_name)
    m, k, n = shape
    x = torch.randn(m, k).to(dtype)  # [tokens, in]
    linear = torch.nn.Linear(k, n, bias=False).to(dtype)
    packed = cpu_linear.pack_linear(linear) if gemm_libraries.can_pack(dtype) else None
    with torch.inference_mode():
        seconds = _best_seconds((lambda: packed(x)) if packed is not None else (lambda: F.linear(x, linear.weight)),
                                repeats)
    return 2.0 * m * k * n / seconds / 1e9


def measure_fma_peak_gflops(threads: int, repeats: int = 5) -> float | None:
    """fp32 multiply-adds per second on `threads` threads, registers only (kernels/csrc/cpu_fma_probe.c:
    independent chains on the native tier's vectors): the most any fp32 GEMM can reach here. None
    where the native kernels do not load."""
    from ..kernels import cpu_native

    native = cpu_native.load()
    if native is None:
        return None
    iters = 2_000_000
    seconds = _best_seconds(lambda: native.fma_probe(iters, 0.5, 0.25, threads), repeats)
    return 2.0 * native.fma_width * iters * threads / seconds / 1e9


def measure_bandwidth_gb_s(num_bytes: int = 512 * 2**20, repeats: int = 5) -> tuple[float, float]:
    """(read GB/s, copy GB/s) over an fp32 tensor of `num_bytes` (far larger than any cache).

    The read rate is the fastest of torch's sum() (one sequential stream per thread) and, where the
    native kernels load, a plain read with 1, 2, 4 and 8 streams per thread
    (kernels/csrc/cpu_read_probe.c): on some CPUs one stream per core keeps fewer misses in flight
    than the memory system can serve (Zen 3), on others it reads fastest (the Intel Xeon of
    session 21), and the small-rows linear reads its weights as several streams, so the best of
    them is the ceiling it is held to. Where the OS gives huge pages, the reads also run over such
    a tensor (vbatch's weights live on them, kernels/cpu_huge_pages.py; 4 KiB pages read 8-10%
    slower on that Xeon), and the best of both counts."""
    import torch

    from ..kernels import cpu_huge_pages, cpu_native

    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    native = cpu_native.load()
    threads = torch.get_num_threads()
    read_s = math.inf
    sources = [src] + ([cpu_huge_pages.empty(src.shape, src.dtype).fill_(1.0)] if cpu_huge_pages.available() else [])
    for buffer in sources:
        read_s = min(read_s, _best_seconds(lambda: buffer.sum(), repeats, min_seconds=0.2))
        for streams in (1, 2, 4, 8) if native is not None else ():
            read_s = min(read_s, _best_seconds(lambda: native.read_probe(buffer, streams, threads), repeats,
                                               min_seconds=0.2))
    del sources
    copy_s = _best_seconds(lambda: dst.copy_(src), repeats, min_seconds=0.2)
    return num_bytes / read_s / 1e9, 2 * num_bytes / copy_s / 1e9


def measure_rates(threads: int | None = None, dtypes: tuple[str, ...] = ("bfloat16", "float32")) -> MachineRates:
    """Measure GEMM rates and bandwidth with `threads` torch threads (None: torch's current setting)."""
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    gemm = {d: measure_gemm_gflops(d) for d in dtypes}
    read, copy = measure_bandwidth_gb_s()
    return MachineRates(threads=torch.get_num_threads(), gemm_gflops=gemm, read_gb_s=read, copy_gb_s=copy)
