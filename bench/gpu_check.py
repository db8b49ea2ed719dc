"""GPU check: every Triton op against its reference at real shapes, then engine throughput on CUDA.

    pip install -e .[gpu]        # torch with CUDA must already be there
    python bench/gpu_check.py [--model smollm2-135m-instruct] [--skip-throughput] [--prompts 256]

(a) For each op and shape (SmolLM2-135M: 9 q heads, 3 kv heads, head_dim 64, hidden 576; an
8B-style GQA shape: 32/8 heads, head_dim 128, hidden 4096), the max abs difference from the
PyTorch reference on the same device, pass/fail against the stated tolerance, and the time of
both with llm.c-style napkin math: bytes the op must move / time, against the device's peak.
(b) `vbatch.LLM` throughput (256 prompts of 128-512 random tokens, 128 output tokens,
ignore_eos) with CUDA graphs and without, in output tokens/s.
(c) Exit status 1 when any check fails (2 when CUDA or triton is missing).
A few minutes on one GPU; nothing here runs on CPU.
"""
from __future__ import annotations

import argparse
import random
import sys
import time

import torch

# Peak HBM bandwidth (GB/s) of common parts, for the napkin math; unknown parts print GB/s only.
PEAK_GBPS = {"H200": 4800, "H100 SXM": 3350, "H100 PCIe": 2000, "H100": 3350, "A100-SXM4-80GB": 2039,
             "A100": 1555, "L40S": 864, "L4": 300, "A10G": 600, "RTX 4090": 1008, "RTX 4070": 504}
SHAPES = {  # name: (num_q_heads, num_kv_heads, head_dim, hidden)
    "smollm2-135m": (9, 3, 64, 576),
    "gqa-8b": (32, 8, 128, 4096),
}
failures: list[str] = []
DEVICE = "cuda"   # a smoke test of this script may point it elsewhere


def peak_gbps() -> float | None:
    name = torch.cuda.get_device_name()
    for key, value in PEAK_GBPS.items():
        if key in name:
            return float(value)
    return None


def timed(fn, repeats: int = 20) -> float:
    """Median seconds of one call (after a warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def report(name: str, diff: float, tol: float, fast_s: float, ref_s: float, nbytes: float) -> None:
    ok = diff <= tol
    peak = peak_gbps()
    gbps = nbytes / fast_s / 1e9
    of_peak = f" ({gbps / peak:5.1%} of {peak:.0f})" if peak else ""
    print(f"{'PASS' if ok else 'FAIL'} {name:<44} max|diff| {diff:9.3g} (tol {tol:g})  "
          f"triton {fast_s * 1e6:8.1f} us  ref {ref_s * 1e6:8.1f} us  x{ref_s / fast_s:5.1f}  "
          f"{gbps:7.1f} GB/s{of_peak}")
    if not ok:
        failures.append(name)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def make_metadata(context_lens: list[int], query_lens: list[int], block_size: int, num_blocks: int):
    from vbatch.kernels.attention_metadata import AttentionMetadata
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    per_req = [-(-s // block_size) for s in seq_lens]
    free = random.Random(0).sample(range(1, num_blocks), sum(per_req))   # block 0 is the null block
    tables = torch.zeros(len(seq_lens), max(per_req), dtype=torch.int32)
    slots, used = [], 0
    for r, n in enumerate(per_req):
        tables[r, :n] = torch.tensor(free[used:used + n], dtype=torch.int32)
        used += n
        slots += [int(tables[r, p // block_size]) * block_size + p % block_size
                  for p in range(context_lens[r], seq_lens[r])]
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    dev = DEVICE
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, device=dev), query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev), block_tables=tables.to(dev),
        block_size=block_size, max_query_len=max(query_lens), max_seq_len=max(seq_lens),
        query_lens_list=tuple(query_lens), seq_lens_list=tuple(seq_lens))


def check_ops(shape_name: str, dtype: torch.dtype) -> None:
    from vbatch.kernels import (attention_ref, cache_ref, norm_ref, rotary_ref, triton_attention, triton_cache,
                                triton_norm, triton_rotary)
    hq, hk, d, hidden = SHAPES[shape_name]
    tag = f"{shape_name} {str(dtype).removeprefix('torch.')}"
    el = torch.empty((), dtype=dtype).element_size()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    dev, bs = DEVICE, 16
    rng = random.Random(1)

    # RMSNorm / fused add + RMSNorm: 4096 rows.
    x, res = (torch.randn(4096, hidden, device=dev, dtype=dtype) for _ in range(2))
    w = (1 + 0.1 * torch.randn(hidden, device=dev)).to(dtype)
    report(f"rms_norm {tag}", max_diff(triton_norm.rms_norm(x, w, 1e-5), norm_ref.rms_norm(x, w, 1e-5)), tol,
           timed(lambda: triton_norm.rms_norm(x, w, 1e-5)), timed(lambda: norm_ref.rms_norm(x, w, 1e-5)),
           2 * x.numel() * el)
    a, b = triton_norm.fused_add_rms_norm(x, res, w, 1e-5), norm_ref.fused_add_rms_norm(x, res, w, 1e-5)
    report(f"fused_add_rms_norm {tag}", max(max_diff(a[0], b[0]), max_diff(a[1], b[1])), tol,
           timed(lambda: triton_norm.fused_add_rms_norm(x, res, w, 1e-5)),
           timed(lambda: norm_ref.fused_add_rms_norm(x, res, w, 1e-5)), 4 * x.numel() * el)

    # Rotary: 4096 tokens.
    cache = rotary_ref.build_rope_cache(d, 8192, 10000.0, None).to(dev)
    q, k = torch.randn(4096, hq, d, device=dev, dtype=dtype), torch.randn(4096, hk, d, device=dev, dtype=dtype)
    pos = torch.randint(0, 8192, (4096,), device=dev)
    a, b = triton_rotary.apply_rotary(pos, q, k, cache), rotary_ref.apply_rotary(pos, q, k, cache)
    report(f"apply_rotary {tag}", max(max_diff(a[0], b[0]), max_diff(a[1], b[1])), tol,
           timed(lambda: triton_rotary.apply_rotary(pos, q, k, cache)),
           timed(lambda: rotary_ref.apply_rotary(pos, q, k, cache)), 2 * (q.numel() + k.numel()) * el)

    # Decode: 128 requests of 128..2048 tokens; prefill: 4 chunks of 512 on 0..1024 cached tokens.
    cases = {"decode": ([rng.randint(127, 2047) for _ in range(128)], [1] * 128),
             "chunked prefill": ([0, 256, 1024, 700], [512] * 4),
             "mixed": ([rng.randint(100, 1000) for _ in range(32)] + [300, 0], [1] * 32 + [512, 512])}
    for case, (ctx, qlens) in cases.items():
        num_blocks = sum(-(-(c + n) // bs) for c, n in zip(ctx, qlens)) + 1
        attn = make_metadata(ctx, qlens, bs, num_blocks)
        kc, vc = (torch.randn(num_blocks, bs, hk, d, device=dev, dtype=dtype) for _ in range(2))
        query = torch.randn(attn.num_tokens, hq, d, device=dev, dtype=dtype)
        key, value = (torch.randn(attn.num_tokens, hk, d, device=dev, dtype=dtype) for _ in range(2))
        kc2, vc2 = kc.clone(), vc.clone()
        triton_cache.write_kv_cache(key, value, kc, vc, attn.slot_mapping)
        cache_ref.write_kv_cache(key, value, kc2, vc2, attn.slot_mapping)
        report(f"write_kv_cache {case} {tag}", max(max_diff(kc, kc2), max_diff(vc, vc2)), 0.0,
               timed(lambda: triton_cache.write_kv_cache(key, value, kc, vc, attn.slot_mapping)),
               timed(lambda: cache_ref.write_kv_cache(key, value, kc2, vc2, attn.slot_mapping)),
               4 * key.numel() * el)
        scale = d ** -0.5
        out = triton_attention.paged_attention(query, kc, vc, attn, scale)
        ref = attention_ref.paged_attention(query, kc, vc, attn, scale)
        kv_bytes = 2 * sum(attn.seq_lens_list) * hk * d * el + 2 * query.numel() * el
        report(f"paged_attention {case} {tag}", max_diff(out, ref), tol,
               timed(lambda: triton_attention.paged_attention(query, kc, vc, attn, scale)),
               timed(lambda: attention_ref.paged_attention(query, kc, vc, attn, scale), repeats=5), kv_bytes)


def check_sampler(vocab: int = 49152, rows: int = 256) -> None:
    from vbatch.kernels import sampling_ref, triton_sampler
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    logits = torch.randn(rows, vocab, device=DEVICE, generator=gen) * 3
    g = torch.Generator().manual_seed(1)
    params = dict(temperature=torch.rand(rows, generator=g) * 1.5,
                  top_k=torch.randint(0, 100, (rows,), generator=g),
                  top_p=torch.where(torch.rand(rows, generator=g) < 0.5, 1.0, 0.5 + 0.5 * torch.rand(rows, generator=g)),
                  min_p=torch.where(torch.rand(rows, generator=g) < 0.5, 0.0, 0.1 * torch.rand(rows, generator=g)))
    params = {k: v.to(DEVICE) for k, v in params.items()}
    seeds, offsets = torch.arange(rows, device=DEVICE) * 7919, torch.full((rows,), 3, device=DEVICE)
    masked = triton_sampler.apply_sampling_masks(logits, **params)
    expected = sampling_ref.apply_sampling_masks(logits, **params)
    mismatched = ((masked > float("-inf")) != (expected > float("-inf"))).float().mean().item()
    tokens = triton_sampler.sample_tokens(logits, **params, seeds=seeds, offsets=offsets)
    ref_tokens = sampling_ref.sample_tokens(logits, **params, seeds=seeds, offsets=offsets)
    agree = (tokens == ref_tokens).float().mean().item()
    # GPU exp/log are approximate: allow boundary flips on a few elements, not on whole rows.
    report(f"sampler masks ({rows}x{vocab}) mismatch fraction", mismatched, 1e-5,
           timed(lambda: triton_sampler.apply_sampling_masks(logits, **params), repeats=5),
           timed(lambda: sampling_ref.apply_sampling_masks(logits, **params), repeats=3), logits.numel() * 8)
    report(f"sampler tokens ({rows} rows) disagreement", 1 - agree, 0.01,
           timed(lambda: triton_sampler.sample_tokens(logits, **params, seeds=seeds, offsets=offsets), repeats=5),
           timed(lambda: sampling_ref.sample_tokens(logits, **params, seeds=seeds, offsets=offsets), repeats=3),
           logits.numel() * 4)


def throughput(model: str, num_prompts: int, output_len: int) -> None:
    from vbatch import LLM, SamplingParams
    llm = LLM(model, device="cuda", enable_prefix_caching=False, quiet=True)
    runner = llm.engine.runner
    graphs = runner.cuda_graphs
    if graphs is None:
        failures.append("no CUDA graphs were captured (are the Triton ops bound?)")
        print("FAIL no CUDA graphs captured; ops:", runner.model.ops.name)
    else:
        print(f"captured {len(graphs.sizes)} decode graphs in {graphs.capture_seconds:.1f}s")
    rng = random.Random(0)
    vocab = int(runner.vocab_size)
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(rng.randint(128, 512))]}
               for _ in range(num_prompts)]
    params = SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True, seed=None)
    llm.generate(prompts[:8], params)   # warm-up: Triton compiles the prefill variants
    results = {}
    for label in ("cuda graphs", "eager"):
        runner.cuda_graphs = graphs if label == "cuda graphs" else None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - t0
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        if generated != num_prompts * output_len:
            failures.append(f"throughput {label}: {generated} tokens, expected {num_prompts * output_len}")
        results[label] = generated / elapsed
        print(f"{label:<12} {num_prompts} prompts: {elapsed:6.2f}s  {generated / elapsed:9.1f} output tok/s  "
              f"{num_prompts / elapsed:6.2f} req/s")
    runner.cuda_graphs = graphs
    if graphs is not None:
        print(f"CUDA graphs speed-up: x{results['cuda graphs'] / results['eager']:.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="catalogue name or local HF folder")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--skip-ops", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 2
    try:
        import triton
    except ImportError:
        print("triton is not installed: pip install -e .[gpu]", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"peak {peak_gbps() or '?'} GB/s")
    if not args.skip_ops:
        for shape in SHAPES:
            for dtype in (torch.bfloat16, torch.float32):
                try:
                    check_ops(shape, dtype)
                except Exception as err:  # one broken op must not hide the others' results
                    failures.append(f"{shape} {dtype}: {type(err).__name__}: {err}")
                    print(f"FAIL {shape} {dtype}: {type(err).__name__}: {err}")
        try:
            check_sampler()
        except Exception as err:
            failures.append(f"sampler: {type(err).__name__}: {err}")
            print(f"FAIL sampler: {type(err).__name__}: {err}")
    if not args.skip_throughput:
        try:
            throughput(args.model, args.prompts, args.output_len)
        except Exception as err:
            failures.append(f"throughput: {type(err).__name__}: {err}")
            print(f"FAIL throughput: {type(err).__name__}: {err}")
    print(f"\n{len(failures)} failure(s)" + "".join(f"\n  - {f}" for f in failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
