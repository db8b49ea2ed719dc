"""PoolingModelRunner: runs encoder-only pooling models (BERT embeddings and classifiers); no KV cache.

The ModelRunner of models whose class says `needs_kv_cache = False`, chosen by the engine at start
(engine/runners.py). Same contract as the decoder runner: `load_model()`, `initialize_kv_cache()`
(allocates nothing, returns 0 blocks, so the scheduler uses NoKVCache), then
`execute_model(SchedulerOutput) -> ModelRunnerOutput` each step, whose `pooler_outputs` hold one
result tensor per scheduled request. Each request runs whole in one step (pooling is never chunked).
Token models (BERT) take packed token ids and go through the Pooler; tensor models (Prithvi) take
each request's named tensors, stacked by shape, and pool their own outputs (`model.pool`).
"""
from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

import torch

from ..kernels.ops import Ops, get_ops
from .compile_times import CompileTimes, native_load
from .config import EngineConfig
from .cpu_threads import ThreadBudget, cpu_thread_count
from .encoder_inputs import prepare_encoder_batch
from .errors import ConfigError
from .models.pooling_config import PoolerConfig, read_pooler_config
from .models.registry import get_model_class
from .models.weights import iter_weights
from .pooler import Pooler
from .pooling_params import PoolingModelInfo
from .scheduler_output import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("vbatch.engine")

# The step's sequences go through the model in sub-batches of about this many tokens: the wide
# GEMMs' [rows, 1536] fp32 outputs then stay in cache (measured here, MiniLM, 2 threads: 8,192-row
# steps 137.8 sentences/s, 2,048 146.4, 1,024 139.3; medians of 4 alternating runs).
SUB_BATCH_TOKENS = 2048


class PoolingModelRunner:
    needs_kv_cache = False
    runs_pooling = True

    def __init__(self, config: EngineConfig, hf_config, model_path: Path,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.hf_config = hf_config
        self.model_path = model_path
        self.device = device
        self.dtype = dtype
        self.ops: Ops | None = None
        self.model = None
        self.pooler: Pooler | None = None
        self.pooler_config: PoolerConfig | None = None
        self.load_seconds = 0.0
        self.load_started = 0.0  # perf_counter() when load_model began
        self.takes_tensors = False
        # CPU: the team of threads, fewer while other processes keep our cores busy (engine/cpu_threads.py).
        self.threads = (ThreadBudget(cpu_thread_count(config.model.num_threads), torch.set_num_threads)
                        if device.type == "cpu" else None)

    def load_model(self) -> None:
        t0 = self.load_started = time.perf_counter()
        cls = get_model_class(self.hf_config)
        # Encoders are compute-bound (every token of every prompt through every GEMM): weights stay
        # in the model's dtype, where the prepacked GEMMs are fastest (and are never quantized).
        if self.config.model.quantization is not None:
            raise ConfigError("quantization", f"{self.config.model.quantization} applies to generative models; "
                              f"{type(self).__name__} runs pooling models in their own dtype",
                              hint="leave --quantization unset for embedding and encoder models")
        self.ops = get_ops(self.device, self.dtype)
        with torch.device(self.device):
            model = cls(self.hf_config, dtype=self.dtype, device=self.device, ops=self.ops)
        model.load_weights(iter_weights(self.model_path))
        model.finalize_weights()
        self.model = model.eval()
        self.takes_tensors = getattr(cls, "input_kind", "tokens") == "tensors"
        if self.takes_tensors:
            logger.info("ops %s; tensor inputs (%s)", self.ops.name, ", ".join(cls.input_names))
        else:
            self.pooler_config = read_pooler_config(self.model_path, cls.default_pooling_type)
            self.pooler = Pooler(self.pooler_config, classify=getattr(model, "classify", None))
            logger.info("ops %s; pooling %s (%s)", self.ops.name, self.pooler_config.pooling_type,
                        self.pooler_config.source)
        self.load_seconds = time.perf_counter() - t0

    def model_info(self, name: str) -> PoolingModelInfo:
        cfg = self.hf_config
        dims = getattr(cfg, "matryoshka_dimensions", None)
        return PoolingModelInfo(name=name, supported_tasks=tuple(self.model.supported_tasks()),
                                hidden_size=self.model.hidden_size,
                                matryoshka_dimensions=tuple(dims) if dims else None,
                                is_matryoshka=bool(getattr(cfg, "is_matryoshka", False) or dims))

    def check_tensor_inputs(self, data: dict) -> tuple[dict, int]:
        """A tensor prompt's inputs, checked by the model, and the cost it declares (InputError if wrong)."""
        return self.model.check_inputs(data)

    def initialize_kv_cache(self) -> int:
        return 0  # an encoder keeps nothing between steps

    def compile_times(self) -> CompileTimes:
        return CompileTimes(**native_load(None if self.ops is None else self.ops.native, self.load_started),
                            torch_compile_s=None, cuda_graphs_s=None)

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        if self.threads is not None:
            self.threads.before_step()
        if self.takes_tensors:
            results = self._execute_tensors(sched)
        else:
            results = []
            for part in _sub_batches(sched, SUB_BATCH_TOKENS):
                batch = prepare_encoder_batch(part, self.device)
                hidden = self.model(batch)                                               # [T, H]
                results += self.pooler(hidden, batch.seq_lens, [s.request.pooling_params for s in part.scheduled])
        return ModelRunnerOutput(
            req_ids=tuple(s.request.request_id for s in sched.scheduled),
            sampled_token_ids=tuple(() for _ in sched.scheduled),
            pooler_outputs=tuple(results))


    def _execute_tensors(self, sched: SchedulerOutput) -> list[torch.Tensor]:
        """Same-shaped requests stack into batches of about `sub_batch_cost` tokens; results in step order."""
        model = self.model
        groups: dict[tuple, list[int]] = {}
        for i, s in enumerate(sched.scheduled):
            groups.setdefault(model.batch_key(s.request.model_inputs), []).append(i)
        results: list[torch.Tensor | None] = [None] * len(sched.scheduled)
        cap = getattr(model, "sub_batch_cost", SUB_BATCH_TOKENS)
        for rows in groups.values():
            per = max(1, cap // max(1, sched.scheduled[rows[0]].num_new_tokens))
            for start in range(0, len(rows), per):
                part = rows[start:start + per]
                out = model.forward_batch([sched.scheduled[i].request.model_inputs for i in part])
                for i, o in zip(part, out):
                    results[i] = model.pool(o, sched.scheduled[i].request.pooling_params.use_activation).cpu()
        return results


def _sub_batches(sched: SchedulerOutput, max_tokens: int) -> list[SchedulerOutput]:
    """The step's requests in order, cut into runs of at most `max_tokens` tokens (a longer request alone)."""
    parts, current, size = [], [], 0
    for s in sched.scheduled:
        if current and size + s.num_new_tokens > max_tokens:
            parts.append(current)
            current, size = [], 0
        current.append(s)
        size += s.num_new_tokens
    if current:
        parts.append(current)
    return [dataclasses.replace(sched, scheduled=tuple(p), num_scheduled_tokens=sum(s.num_new_tokens for s in p))
            for p in parts]
