"""DecodeGraphs: CUDA graphs of the model's decode forward, captured once, replayed per step.

Built by the ModelRunner right after it allocates the KV cache (CUDA with the Triton ops only);
`run` replaces the eager forward for decode-only steps of at most the largest captured batch.
A decode step of a small model is dominated by kernel-launch overhead (hundreds of small
kernels); a replay launches them all at once.

How: static input buffers (token ids, positions, slots, lengths, block tables) sized for the
largest batch; for each capture size (1, 2, 4, 8, then every 16 up to max_num_seqs, at most
512) the forward is run twice eagerly (Triton compiles, cuBLAS picks kernels) and then
captured, largest first so every graph shares the first one's memory pool. A step of n
requests copies its inputs into the first n rows and pads up to the next captured size with
dummy requests of length 1 that live in the null block 0 (never handed out by the block
manager): their token writes go to slot 0 and their attention reads only that slot.

NOTE: only the Triton ops can be captured: the reference attention reads Python lengths
(`seq_lens_list`) that a replay would freeze. The logits (one GEMM) stay outside the graph.
It never touches request state and owns nothing but its buffers and graphs.
"""
from __future__ import annotations

import bisect
import logging
import time

import torch

from ..kernels.attention_metadata import AttentionMetadata

logger = logging.getLogger("vbatch.engine")

MAX_CAPTURE_SIZE = 512


def capture_sizes(max_num_seqs: int) -> list[int]:
    cap = max(1, min(max_num_seqs, MAX_CAPTURE_SIZE))
    sizes = [s for s in (1, 2, 4, 8) if s <= cap] + list(range(16, cap + 1, 16))
    return sizes if sizes[-1] == cap else sizes + [cap]


class DecodeGraphs:
    def __init__(self, model: torch.nn.Module, kv_caches: list, block_size: int, max_model_len: int,
                 sizes: list[int], device: torch.device) -> None:
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.max_model_len, self.sizes = max_model_len, sorted(sizes)
        max_batch, max_blocks = self.sizes[-1], -(-max_model_len // block_size)
        i32, i64 = torch.int32, torch.int64
        with torch.inference_mode():
            self.input_ids = torch.zeros(max_batch, dtype=i64, device=device)            # [B]
            self.positions = torch.zeros(max_batch, dtype=i64, device=device)            # [B]
            self.slot_mapping = torch.zeros(max_batch, dtype=i64, device=device)         # [B]: slot 0 = null block
            self.query_start_loc = torch.arange(max_batch + 1, dtype=i32, device=device)  # [B + 1], fixed
            self.seq_lens = torch.ones(max_batch, dtype=i32, device=device)              # [B]
            self.context_lens = torch.zeros(max_batch, dtype=i32, device=device)         # [B]
            self.block_tables = torch.zeros(max_batch, max_blocks, dtype=i32, device=device)  # [B, max_blocks]
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # size -> [size, hidden] static output
        self.capture_seconds = 0.0

    def _metadata(self, size: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=self.query_start_loc[:size + 1],
            seq_lens=self.seq_lens[:size], context_lens=self.context_lens[:size],
            block_tables=self.block_tables[:size], block_size=self.block_size,
            max_query_len=1, max_seq_len=self.max_model_len,
            query_lens_list=(1,) * size, seq_lens_list=(1,) * size)

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, self._metadata(size))

    @torch.inference_mode()
    def capture(self) -> "DecodeGraphs":
        t0 = time.perf_counter()
        pool = None
        for size in reversed(self.sizes):
            for _ in range(2):
                self._forward(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool() if pool is None else pool
            self.graphs[size] = graph
        torch.cuda.synchronize()
        self.capture_seconds = time.perf_counter() - t0
        logger.info("captured %d decode CUDA graphs (batch %d..%d) in %.1fs",
                    len(self.sizes), self.sizes[0], self.sizes[-1], self.capture_seconds)
        return self

    def can_run(self, attn: AttentionMetadata) -> bool:
        return (attn.is_decode_only and 0 < attn.num_reqs <= self.sizes[-1]
                and attn.block_tables.shape[1] <= self.block_tables.shape[1])

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor,
            attn: AttentionMetadata) -> torch.Tensor:  # -> [num_reqs, hidden]; valid until the next run
        n = attn.num_reqs
        size = self.sizes[bisect.bisect_left(self.sizes, n)]
        width = attn.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(attn.slot_mapping)
        self.seq_lens[:n].copy_(attn.seq_lens)
        self.context_lens[:n].copy_(attn.context_lens)
        self.block_tables[:n, :width].copy_(attn.block_tables)
        if size > n:  # dummy requests: one token at position 0 in the null block
            for buffer in (self.input_ids, self.positions, self.slot_mapping, self.context_lens):
                buffer[n:size].zero_()
            self.seq_lens[n:size].fill_(1)
            self.block_tables[n:size, 0].zero_()
        self.graphs[size].replay()
        return self.outputs[size][:n]


def capture_decode_graphs(runner) -> DecodeGraphs | None:
    """Graphs for `runner` (a ModelRunner with its KV cache), or None where they cannot run."""
    if runner.device.type != "cuda" or not runner.model.ops.graph_capturable:
        return None
    s = runner.config.scheduler
    return DecodeGraphs(runner.model, runner.kv_caches, runner.block_size, s.max_model_len,
                        capture_sizes(s.max_num_seqs), runner.device).capture()
