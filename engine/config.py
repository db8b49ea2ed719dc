"""Engine configuration: one frozen dataclass per subsystem, composed into EngineConfig.

Every field is documented; `validate()` raises a ConfigError naming the field and its
allowed range. No I/O here: values that need the model (max_model_len from config.json,
the device's best dtype) are resolved by the engine when it loads the model, via `replace`.
"""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field

from .errors import ConfigError

_DTYPES = ("auto", "float32", "bfloat16", "float16")
# vLLM's 8-bit KV caches: fp8 is E4M3 (scale 1.0, vLLM's default without calibrated scales)
_KV_DTYPES = (*_DTYPES, "fp8", "fp8_e4m3", "fp8_e5m2")
QUANTIZATIONS = (None, "q8_0")   # kernels/q8_0.py
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 2**30, "gb": 10**9, "gib": 2**30, "t": 2**40, "tb": 10**12, "tib": 2**40}


def parse_bytes(value: str | int | float, field_name: str = "kv_cache_memory") -> int:
    """'2GiB', '512MiB', '1.5G' (binary), '3000000' (bytes) -> bytes. Plain 'G' means GiB."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        n = int(value)
    else:
        m = _SIZE_RE.match(str(value))
        if not m:
            raise ConfigError(field_name, f"cannot read {value!r} as a size; use e.g. 2GiB, 512MiB or bytes")
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    if n <= 0:
        raise ConfigError(field_name, f"must be > 0 bytes, got {value!r}")
    return n


@dataclass(frozen=True)
class ModelConfig:
    model: str = "smollm2-135m-instruct"
    """A local HF folder, a .gguf file, a catalogue short name (`vbatch models list`) or a hub id."""
    tokenizer: str | None = None
    """Tokenizer folder or hub id; default: the model's own."""
    dtype: str = "auto"
    """auto | float32 | bfloat16 | float16. auto: bf16 where the device computes it fast and exactly
    enough (CUDA with bf16, CPUs with avx512_bf16 or AMX: the avx512-bf16 tier of
    kernels/cpu_features.py), else float32."""
    weight_dtype: str = "auto"
    """auto | float32 | float16 | bfloat16: how the linear layers' weights are stored. auto: as dtype,
    except that an fp32 model whose dtype is auto (a CPU without fast bf16, e.g. AVX2) stores them
    in the CPU tier's half-precision format (fp16 on AVX2, bf16 on the portable tier), widened to
    fp32 in registers: half the bytes per decode step, every product and sum still fp32 (tolerance:
    docs/performance/avx2-zen3.md). float16 / bfloat16 ask for that under dtype float32 on any CPU; float32
    keeps them exact."""
    quantization: str | None = None
    """None | q8_0: q8_0 quantizes the linear layers' weights at load (int8 and an fp16 scale per
    32 weights, as llama.cpp's Q8_0; kernels/q8_0.py), computed in fp32: about half the bytes of
    fp16 per decode step, for a small error (greedy agreement: docs/performance/avx2-zen3.md). CPU only;
    dtype auto then means float32. Never a default."""
    max_model_len: int | None = None
    """Prompt + output tokens per sequence; default: the model's max_position_embeddings."""
    seed: int = 0
    """Seeds the engine RNG that samples requests without their own seed."""
    generation_config: str = "auto"
    """auto: defaults from the model's generation_config.json; vllm: neutral defaults; else a folder."""
    device: str = "auto"
    """auto (cuda when available, else cpu) | cpu | cuda | cuda:N."""
    num_threads: int | None = None
    """CPU: torch intra-op threads, set by the engine at start. None: $VBATCH_NUM_THREADS if set,
    else the number of cores this process may run on (os.sched_getaffinity)."""

    def validate(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ConfigError("model", "must be a non-empty path, file, catalogue name or hub id")
        if self.dtype not in _DTYPES:
            raise ConfigError("dtype", f"must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.weight_dtype not in _DTYPES:
            raise ConfigError("weight_dtype", f"must be one of {', '.join(_DTYPES)}, got {self.weight_dtype!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError("quantization", f"must be one of {', '.join(q for q in QUANTIZATIONS if q)} "
                              f"(or unset), got {self.quantization!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError("max_model_len", f"must be >= 1, got {self.max_model_len}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ConfigError("num_threads", f"must be >= 1, got {self.num_threads}")
        if not (self.device in ("auto", "cpu", "cuda") or self.device.startswith("cuda:")):
            raise ConfigError("device", f"must be auto, cpu, cuda or cuda:N, got {self.device!r}")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block (vLLM: 16)."""
    kv_cache_memory: int | None = None
    """Bytes for the KV cache. None: on CPU min(4 GiB, 25% of free RAM); on CUDA what the
    profiling run leaves of `gpu_memory_utilization` of the device memory."""
    gpu_memory_utilization: float = 0.9
    """CUDA only: the share of device memory the engine may use (weights + activations + KV)."""
    kv_cache_dtype: str = "auto"
    """auto | float32 | float16 | bfloat16 | fp8 | fp8_e4m3 | fp8_e5m2: how keys and values are
    stored (vLLM's kv_cache_dtype). auto: the model's dtype, except that an fp32 model whose dtype is
    auto (a CPU without fast bf16) stores them in the CPU tier's half format, like its weights (half
    the cache's memory and of the bytes decode attention reads; scores and sums stay fp32). float16 /
    bfloat16 ask for that under dtype float32 on any CPU. fp8 (= fp8_e4m3, OCP E4M3FN, 3 mantissa
    bits, up to 448) and fp8_e5m2 (2 mantissa bits, up to 57344) store one byte per value under an
    fp32 or bf16 model, on the CPU: values rounded to nearest even and saturated, scale 1.0 (vLLM's
    default without calibrated scales); a quarter (fp32) or half (bf16) of the bytes, an accuracy
    cost (docs/performance/intel-xeon.md, "fp8 KV cache")."""
    enable_prefix_caching: bool = True
    """Reuse the KV blocks of identical prompt prefixes (chained block hashes, LRU eviction)."""
    num_gpu_blocks_override: int | None = None
    """Tests: exactly this many KV blocks, whatever the memory budget says."""

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ConfigError("block_size", f"must be a power of two >= 1, got {self.block_size}")
        if self.kv_cache_dtype not in _KV_DTYPES:
            raise ConfigError("kv_cache_dtype", f"must be one of {', '.join(_KV_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError("kv_cache_memory", f"must be > 0 bytes, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ConfigError("num_gpu_blocks_override", f"must be >= 2, got {self.num_gpu_blocks_override}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most sequences running at once (the decode batch size)."""
    max_num_batched_tokens: int | None = None
    """Token budget of one step, shared by decodes and (chunks of) prefills. None: 8192, raised to
    max_model_len when chunked prefill is off (a whole prompt must then fit one step)."""
    enable_chunked_prefill: bool = True
    """Cut prompts that do not fit the step's budget into chunks. Off: a prompt waits until it fits whole."""
    max_model_len: int = 2048
    """Filled from ModelConfig once the model is known."""
    num_scheduler_steps: int | None = None
    """Forwards one scheduled step may run back to back when every request decodes one token that
    it samples plainly (greedy or temperature only, nothing else read from the logits:
    SamplingParams.is_plain) and no waiting request has room: the model then samples and feeds back its tokens
    itself, and the scheduler applies them all at once (vLLM's multi-step scheduling). None: 8 where
    the model can run such steps in one native call (CPU native kernels, up to 4 requests), else 1.
    The tokens are those of single steps, the random draws included; streamed outputs arrive a few
    tokens at a time."""

    @property
    def token_budget(self) -> int:
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return 8192 if self.enable_chunked_prefill else max(8192, self.max_model_len)

    def validate(self) -> None:
        if self.max_num_seqs < 1:
            raise ConfigError("max_num_seqs", f"must be >= 1, got {self.max_num_seqs}")
        if self.num_scheduler_steps is not None and self.num_scheduler_steps < 1:
            raise ConfigError("num_scheduler_steps", f"must be >= 1, got {self.num_scheduler_steps}")
        if self.max_num_batched_tokens is None:
            return
        if self.max_num_batched_tokens < 1:
            raise ConfigError("max_num_batched_tokens", f"must be >= 1, got {self.max_num_batched_tokens}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ConfigError("max_num_batched_tokens",
                              f"must be >= max_model_len ({self.max_model_len}) when chunked prefill is off, "
                              f"got {self.max_num_batched_tokens}",
                              hint="raise --max-num-batched-tokens, lower --max-model-len, or enable chunked prefill")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def validate(self) -> "EngineConfig":
        self.model.validate()
        self.cache.validate()
        self.scheduler.validate()
        return self

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)
