"""Time single engine steps on the real model: decode at batch 1 / 64 / 256 and one 8,192-token prefill.

    python bench/step_probe.py [--threads 2] [--profile]

Calls the model's forward (and the logits head) directly on the engine's own KV cache, so the
numbers are the model step alone (no scheduler, sampler or detokenizer); docs/performance/avx512-bf16.md's
step tables come from here. Medians of 5 (prefill: 3) after 2 warm-up calls; `--profile` adds a
torch.profiler table per case (ctypes calls into the native kernels show up only as the gap
between the table's total and the wall time). Run it in its own high-priority session on a shared
machine (REFERENCE 8):
    setsid --wait bash -c 'echo -19 > /proc/$$/autogroup; exec nice -n -19 "$@"' _ python bench/step_probe.py
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def _loadavg() -> list[str]:
    with open("/proc/loadavg") as f:
        return f.read().split()[:3]


def decode_case(batch: int, length: int, block_size: int, num_blocks: int):
    from vbatch.kernels.attention_metadata import AttentionMetadata
    per_req = -(-length // block_size)
    tables = torch.arange(1, batch * per_req + 1, dtype=torch.int32).view(batch, per_req) % (num_blocks - 1) + 1
    positions = torch.full((batch,), length - 1, dtype=torch.int64)
    slots = tables[:, (length - 1) // block_size].to(torch.int64) * block_size + (length - 1) % block_size
    return positions, AttentionMetadata(
        slot_mapping=slots, query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.full((batch,), length, dtype=torch.int32),
        context_lens=torch.full((batch,), length - 1, dtype=torch.int32), block_tables=tables,
        block_size=block_size, max_query_len=1, max_seq_len=length, query_lens_list=(1,) * batch,
        seq_lens_list=(length,) * batch)


def prefill_case(lengths: list[int], block_size: int):
    from vbatch.kernels.attention_metadata import AttentionMetadata
    per_req = [-(-n // block_size) for n in lengths]
    tables = torch.zeros(len(lengths), max(per_req), dtype=torch.int32)
    next_block, slots, positions = 1, [], []
    for i, n in enumerate(lengths):
        tables[i, :per_req[i]] = torch.arange(next_block, next_block + per_req[i])
        next_block += per_req[i]
        p = torch.arange(n)
        positions.append(p)
        slots.append(tables[i, p // block_size].long() * block_size + p % block_size)
    starts = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    return torch.cat(positions), AttentionMetadata(
        slot_mapping=torch.cat(slots), query_start_loc=starts, seq_lens=torch.tensor(lengths, dtype=torch.int32),
        context_lens=torch.zeros(len(lengths), dtype=torch.int32), block_tables=tables, block_size=block_size,
        max_query_len=max(lengths), max_seq_len=max(lengths), query_lens_list=tuple(lengths),
        seq_lens_list=tuple(lengths))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--context", type=int, default=450, help="tokens in the cache per decode request")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    from vbatch import LLM
    llm = LLM(args.model, dtype="bfloat16", quiet=True, num_threads=args.threads, enable_prefix_caching=False)
    runner = llm.engine.runner
    model, bs = runner.model, runner.block_size
    print(f"ops {model.ops.name}, threads {torch.get_num_threads()}, blocks {runner.num_blocks}, load {_loadavg()}")
    cases = [(f"decode b{b} L{args.context}", *decode_case(b, args.context, bs, runner.num_blocks)) for b in (1, 64, 256)]
    rng, lengths = random.Random(0), []
    while sum(lengths) < 8192 - 512:
        lengths.append(rng.randint(128, 512))
    lengths.append(8192 - sum(lengths))
    cases.append((f"prefill {len(lengths)} prompts, 8192 tokens", *prefill_case(lengths, bs)))
    for name, positions, attn in cases:
        tokens = positions.shape[0]
        ids = torch.randint(100, 40000, (tokens,))

        def step():
            hidden = model(ids, positions, runner.kv_caches, attn)
            model.compute_logits(hidden[-attn.num_reqs:])
        with torch.inference_mode():
            for _ in range(2):
                step()
            times = []
            for _ in range(5 if tokens < 1000 else 3):
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            med = statistics.median(times)
            produced = attn.num_reqs if attn.is_decode_only else tokens
            print(f"{name}: median {med * 1e3:.1f} ms ({produced / med:.0f} tok/s), runs "
                  f"{[round(x * 1e3, 1) for x in times]}, load {_loadavg()}")
            if args.profile:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                    step()
                print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
