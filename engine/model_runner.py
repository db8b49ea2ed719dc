"""ModelRunner: owns the model weights and the KV cache; runs one scheduled step.

Called by LLMEngine: `load_model()` once, `initialize_kv_cache()` once (sizes it from the
memory budget), then `execute_model(SchedulerOutput) -> ModelRunnerOutput` every step.
It never decides what to run (the Scheduler does) and never touches request state.
"""
from __future__ import annotations

import gc
import logging
import math
import time
from pathlib import Path

import psutil
import torch

from ..kernels import cpu_huge_pages
from ..kernels.ops import Ops, get_ops
from ..kernels.q8_0 import QuantizationError
from .compile_times import CompileTimes, native_load
from .config import EngineConfig
from .cpu_threads import ThreadBudget, cpu_thread_count
from .cuda_graphs import capture_decode_graphs
from .device import resolve_kv_cache_dtype, resolve_weight_dtype
from .errors import ConfigError
from .inputs import ModelInputs, prepare_inputs
from .models.registry import get_model_class
from .models.weights import iter_weights
from .sampler import Sampler, compute_prompt_logprobs, plain_temperature, uniform_per_row
from .sampling_metadata import SamplingMetadata
from .scheduler_output import Logprobs, ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("vbatch.engine")

_CPU_DEFAULT_KV_BYTES = 4 * 2**30


class ModelRunner:
    needs_kv_cache = True
    runs_pooling = False
    def __init__(self, config: EngineConfig, hf_config, model_path: Path,
                 device: torch.device, dtype: torch.dtype) -> None:
        self.config = config
        self.hf_config = hf_config
        self.model_path = model_path
        self.device = device
        self.dtype = dtype
        self.block_size = config.cache.block_size
        self.vocab_size = int(hf_config.vocab_size)
        model_cfg = config.model
        # Checked before anything loads: a bad dtype pair is a ConfigError at start.
        self.weight_dtype = resolve_weight_dtype(model_cfg.weight_dtype, dtype, device)
        self.requested_kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, dtype, device)
        self.kv_dtype = self.requested_kv_dtype or dtype  # final once the ops are chosen (load_model)
        self.ops: Ops | None = None   # chosen once in load_model (kernels/ops.py get_ops)
        self.sampler = Sampler()
        self.generator = torch.Generator(device=device).manual_seed(config.model.seed)
        # Seeded requests' own generators, by request id: runner state, dropped when they finish.
        self.request_generators: dict[str, torch.Generator] = {}
        self.model = None
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.num_blocks = 0
        self.load_seconds = 0.0
        self.load_started = 0.0  # perf_counter() when load_model began
        self.cuda_graphs = None  # engine/cuda_graphs.DecodeGraphs once the KV cache exists (CUDA + Triton)
        self.warmup_seconds = 0.0
        self.huge_pages = False  # CPU: the weights and KV cache are on huge pages (load_model)
        # CPU: the team of threads, fewer while other processes keep our cores busy (engine/cpu_threads.py).
        self.threads = (ThreadBudget(cpu_thread_count(config.model.num_threads), torch.set_num_threads)
                        if device.type == "cpu" else None)

    # ------------------------------------------------------------------ start-up
    def load_model(self) -> None:
        t0 = self.load_started = time.perf_counter()
        cls = get_model_class(self.hf_config)
        quantization = self.config.model.quantization
        try:
            self.ops = get_ops(self.device, self.dtype, weight_dtype=self.weight_dtype,
                               kv_cache_dtype=self.requested_kv_dtype, prefer_half=self.config.model.dtype == "auto",
                               quantization=quantization)
        except QuantizationError as e:
            raise ConfigError("quantization", str(e), hint="leave --quantization unset") from e
        self.kv_dtype = self.ops.kv_cache_dtype or self.dtype
        with torch.device(self.device):
            model = cls(self.hf_config, dtype=self.dtype, device=self.device,
                        max_model_len=self.config.scheduler.max_model_len, ops=self.ops)
        model.load_weights(iter_weights(self.model_path))
        if hasattr(model, "finalize_weights"):
            model.finalize_weights()   # CPU: prepacks every GEMM weight (and its small-rows copy)
        if self.device.type == "cpu":
            # One arena on huge pages (fewer TLB misses as a decode step streams the weights),
            # before the first forward keeps the weights' addresses (kernels/cpu_huge_pages.py).
            cpu_huge_pages.place_module(model)
            self.huge_pages = cpu_huge_pages.available()
        self.model = model.eval()
        # The native CPU sampler (kernels/csrc/cpu_sample.c) reads the model's own logits.
        self.sampler = Sampler(native=self.ops.native)
        logger.info("ops %s, linear weights stored as %s, KV cache as %s", self.ops.name,
                    self.ops.quantization or str(self.ops.weight_dtype or self.dtype).removeprefix("torch."),
                    str(self.kv_dtype).removeprefix("torch."))
        self.load_seconds = time.perf_counter() - t0

    def bytes_per_block(self) -> int:
        m = self.model
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return 2 * m.num_layers * self.block_size * m.num_kv_heads * m.head_dim * elem

    def max_useful_blocks(self) -> int:
        """Enough blocks for max_num_seqs sequences of max_model_len tokens (+1 reserved)."""
        s = self.config.scheduler
        return s.max_num_seqs * math.ceil(s.max_model_len / self.block_size) + 1

    def kv_budget_bytes(self) -> int:
        cache = self.config.cache
        if cache.kv_cache_memory is not None:
            return cache.kv_cache_memory
        if self.device.type == "cuda":
            return self._profile_cuda_budget()
        return min(_CPU_DEFAULT_KV_BYTES, int(psutil.virtual_memory().available * 0.25))

    def _profile_cuda_budget(self) -> int:
        """Run the largest step once on dummy tokens; what it leaves of the budget becomes KV blocks."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)
        n = self.config.scheduler.max_num_batched_tokens
        self._dummy_forward(n)
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device)
        total = torch.cuda.get_device_properties(self.device).total_memory
        budget = int(total * self.config.cache.gpu_memory_utilization) - peak
        logger.info("profiling: peak %.2f GiB of %.2f GiB; KV budget %.2f GiB", peak / 2**30, total / 2**30, budget / 2**30)
        return max(budget, 0)

    def _dummy_forward(self, num_tokens: int) -> None:
        """One prefill of `num_tokens` tokens over a scratch 1-block-per-16-token cache."""
        from ..kernels.attention_metadata import AttentionMetadata
        m = self.model
        nb = math.ceil(num_tokens / self.block_size) + 1
        caches = [tuple(torch.zeros(m.kv_cache_shape(nb, self.block_size), dtype=self.kv_dtype, device=self.device)
                        for _ in range(2)) for _ in range(m.num_layers)]
        ids = torch.zeros(num_tokens, dtype=torch.int64, device=self.device)
        pos = torch.arange(num_tokens, device=self.device)
        attn = AttentionMetadata(
            slot_mapping=pos + self.block_size, query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=self.device),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=self.device),
            context_lens=torch.zeros(1, dtype=torch.int32, device=self.device),
            block_tables=torch.arange(1, nb, dtype=torch.int32, device=self.device)[None],
            block_size=self.block_size, max_query_len=num_tokens, max_seq_len=num_tokens,
            query_lens_list=(num_tokens,), seq_lens_list=(num_tokens,))
        with torch.inference_mode():
            hidden = m(ids, pos, caches, attn)
            m.compute_logits(hidden[-1:])
        del caches, hidden
        gc.collect()

    def initialize_kv_cache(self) -> int:
        override = self.config.cache.num_gpu_blocks_override
        if override is not None:
            num_blocks = override
        else:
            num_blocks = min(self.kv_budget_bytes() // self.bytes_per_block(), self.max_useful_blocks())
        if num_blocks < 2:
            raise ConfigError("kv_cache_memory", f"leaves {num_blocks} KV blocks of {self.bytes_per_block()} bytes",
                              hint="raise --kv-cache-memory or lower --max-model-len")
        shape = self.model.kv_cache_shape(num_blocks, self.block_size)
        # NOTE: empty, not zeros: zeroing touches every page (the 4 GiB CPU default became 4 GiB of
        # RSS for any job). Every kernel reads only positions this step or earlier steps wrote, and
        # the kernel tests fill unowned blocks with NaN to prove no garbage leaks into a result.
        # CPU: advised for huge pages like the weights (kernels/cpu_huge_pages.py; still untouched).
        def empty() -> torch.Tensor:
            if self.device.type == "cpu":
                return cpu_huge_pages.empty(shape, self.kv_dtype)
            return torch.empty(shape, dtype=self.kv_dtype, device=self.device)
        self.kv_caches = [(empty(), empty()) for _ in range(self.model.num_layers)]
        self.num_blocks = num_blocks
        self.cuda_graphs = capture_decode_graphs(self)  # None off CUDA
        if self.ops is not None and self.ops.compiles_on_first_use:
            self._warm_up_decode()  # inductor's decode attention; the native kernel needs no warm-up
        return num_blocks

    def _warm_up_decode(self) -> None:
        """Run decode steps of batch 2, 3 and 1 over a scratch cache before any request arrives.

        The CPU bf16 decode attention without a C compiler is compiled by inductor on first use
        (kernels/cpu_attention.py);
        paying it here keeps it out of the first step and makes it measurable (`warmup_seconds`)."""
        from ..kernels.attention_metadata import AttentionMetadata
        t0 = time.perf_counter()
        m, bs = self.model, self.block_size
        # Three shapes: the second makes batch and length dims dynamic in the compiled decode
        # attention (one graph for every later batch >= 2), the third compiles batch 1.
        max_len = self.config.scheduler.max_model_len    # positions past it have no rotary entry
        for batch, seq_len in ((2, min(20, max_len)), (3, min(40, max_len)), (1, min(20, max_len))):
            blocks_per_req = -(-seq_len // bs)
            caches = [tuple(torch.zeros(m.kv_cache_shape(batch * blocks_per_req + 1, bs), dtype=self.kv_dtype)
                            for _ in range(2)) for _ in range(m.num_layers)]
            tables = torch.arange(1, batch * blocks_per_req + 1, dtype=torch.int32).view(batch, blocks_per_req)
            positions = torch.full((batch,), seq_len - 1, dtype=torch.int64)
            slots = tables[:, (seq_len - 1) // bs].to(torch.int64) * bs + (seq_len - 1) % bs
            attn = AttentionMetadata(
                slot_mapping=slots, query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
                seq_lens=torch.full((batch,), seq_len, dtype=torch.int32),
                context_lens=torch.full((batch,), seq_len - 1, dtype=torch.int32),
                block_tables=tables, block_size=bs, max_query_len=1, max_seq_len=seq_len,
                query_lens_list=(1,) * batch, seq_lens_list=(seq_len,) * batch)
            with torch.inference_mode():
                hidden = m(torch.zeros(batch, dtype=torch.int64), positions, caches, attn)
                m.compute_logits(hidden)
        self.warmup_seconds = time.perf_counter() - t0
        logger.info("CPU warm-up (kernel compilation) took %.1fs", self.warmup_seconds)

    def compile_times(self) -> CompileTimes:
        """What start-up compiled, and how long it took (kernels are never compiled inside a step)."""
        return CompileTimes(
            **native_load(None if self.ops is None else self.ops.native, self.load_started),
            torch_compile_s=self.warmup_seconds if self.ops is not None and self.ops.compiles_on_first_use else None,
            cuda_graphs_s=None if self.cuda_graphs is None else self.cuda_graphs.capture_seconds)

    # ------------------------------------------------------------------ per step
    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in sched.finished_request_ids:
            self.request_generators.pop(request_id, None)
        if self.threads is not None:
            self.threads.before_step()
        inputs = prepare_inputs(sched, self.block_size, self.device)
        if sched.num_steps > 1:
            return self._execute_decode_steps(sched, inputs)
        pruned = False
        if self.cuda_graphs is not None and self.cuda_graphs.can_run(inputs.attn):
            hidden = self.cuda_graphs.run(inputs.input_ids, inputs.positions, inputs.attn)        # [T, H]
        elif inputs.output_rows is not None and getattr(self.model, "prunes_last_layer", False):
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn,
                                inputs.output_rows)                                        # [rows, H]
            pruned = True
        else:
            hidden = self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn)   # [T, H]
        # The logits rows are listed in order, each once: as many as the hidden rows means all of them.
        if not pruned and inputs.logits_indices.shape[0] != hidden.shape[0]:
            hidden = hidden[inputs.logits_indices]                                          # [rows, H]
        # CPU with the native kernels: the sampler reads the model's own logits (bf16 ones it
        # converts when a row needs more than a temperature); prompt logprobs need fp32.
        keep = self.sampler.native is not None and not inputs.prompt_logprobs
        logits = self.model.compute_logits(hidden, keep_dtype=keep)                         # [rows, V]
        num = len(sched.scheduled)
        sampled: list[tuple[int, ...]] = [()] * num
        logprobs: list[Logprobs | None] = [None] * num
        if inputs.sample_reqs:
            self._sample(sched, inputs, logits, sampled, logprobs)
        prompt_lps: list[Logprobs | None] = [None] * num
        for sl in inputs.prompt_logprobs:
            req = sched.scheduled[sl.index].request
            lp = compute_prompt_logprobs(logits[sl.row_start:sl.row_start + sl.num],
                                         torch.tensor(sl.target_token_ids, dtype=torch.int64, device=self.device),
                                         req.sampling_params.prompt_logprobs)
            prompt_lps[sl.index] = Logprobs(lp.token_ids, lp.logprobs, lp.ranks, start_position=sl.start_position)
        return ModelRunnerOutput(
            req_ids=tuple(s.request.request_id for s in sched.scheduled),
            sampled_token_ids=tuple(sampled),
            logprobs=tuple(logprobs),
            prompt_logprobs=tuple(prompt_lps),
        )

    def decode_steps_rows(self) -> int:
        """The most requests a multi-step decode (SchedulerOutput.num_steps > 1) may hold here: the
        model's `decode_steps` with this KV cache (0: none; off CUDA graphs' device)."""
        model = self.model
        if self.cuda_graphs is not None or not self.kv_caches or not hasattr(model, "decode_steps_rows"):
            return 0
        return model.decode_steps_rows(self.kv_caches)

    def _execute_decode_steps(self, sched: SchedulerOutput, inputs: ModelInputs) -> ModelRunnerOutput:
        """A multi-step decode: the model samples each request's next sched.num_steps tokens as the
        sampler's plain rows do, feeding each back; fewer when a request samples a stop token (the
        steps end there, so every step runs, and draws for, the requests single steps would).

        The random rows' uniforms are drawn here, step after step, from the generators single steps
        would draw them from (engine/sampler.py `uniform_per_row`); when the steps end early the
        generators are put back and advanced by the steps that ran only, so later draws are the same
        as after single steps."""
        reqs = [s.request for s in sched.scheduled]
        meta = SamplingMetadata.build(reqs, vocab_size=self.vocab_size, device=self.device,
                                      generators_by_id=self.request_generators)
        assert all(meta.plain_rows), "multi-step decodes take plain rows only (SamplingParams.is_plain)"
        stops = [tuple(r.sampling_params.all_stop_token_ids) for r in reqs]   # EOS and stop_token_ids
        temperature, uniforms = plain_temperature(meta), None                               # [T] or None
        generators = (self.generator, *(g for _, g in meta.generators))
        if temperature is not None:
            states = [g.get_state() for g in generators]
            uniforms = self._uniforms(meta, sched.num_steps)                                # [steps, T]
        tokens = self.model.decode_steps(inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn,
                                         sched.num_steps, stops, temperature, uniforms)     # [steps run, T]
        if uniforms is not None and tokens.shape[0] < sched.num_steps:
            for g, state in zip(generators, states):
                g.set_state(state)
            self._uniforms(meta, tokens.shape[0])
        return ModelRunnerOutput(req_ids=tuple(s.request.request_id for s in sched.scheduled),
                                 sampled_token_ids=tuple(map(tuple, tokens.t().tolist())))

    def _uniforms(self, meta: SamplingMetadata, num_steps: int) -> torch.Tensor:  # [num_steps, rows]
        return torch.stack([uniform_per_row(meta.num_rows, meta.generators, self.generator) for _ in range(num_steps)])

    def _sample(self, sched: SchedulerOutput, inputs: ModelInputs, logits: torch.Tensor,
                sampled: list, logprobs: list) -> None:
        reqs = [sched.scheduled[i].request for i in inputs.sample_reqs]
        meta = SamplingMetadata.build(reqs, vocab_size=self.vocab_size, device=self.device,
                                      generators_by_id=self.request_generators)
        # The sampler may edit its rows in place: a fresh gather, or the logits themselves when they are
        # exactly the sample rows and no prompt logprobs read them afterwards.
        if not inputs.prompt_logprobs and inputs.sample_rows == tuple(range(logits.shape[0])):
            rows = logits                                                                     # [num_samples, V]
        else:
            rows = logits[list(inputs.sample_rows)]                                           # [num_samples, V]
        out = self.sampler(rows, meta, self.generator, owned=True)
        token_ids = out.sampled_token_ids.tolist()
        for j, i in enumerate(inputs.sample_reqs):
            sampled[i] = (token_ids[j],)
            if out.logprobs is not None:
                logprobs[i] = out.logprobs[j]
