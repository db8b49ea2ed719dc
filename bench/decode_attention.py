"""The native paged attention on decode rows alone, as a decode step calls it once per layer.

    python bench/decode_attention.py [--batch 256] [--positions 384] [--layers 30] [--threads 2]
                                     [--order random|in-order] [--dtype bfloat16] [--kv-dtype ...]
                                     [--calls 20] [--repeats 5] [--tier avx2]

Builds a KV cache per layer with SmolLM2-135M's attention shapes (9 query heads, 3 kv heads of 64
dims, blocks of 16), gives each of --batch requests --positions positions in blocks placed at
random (--order random: a long-running engine's cache) or one after another (--order in-order: a
fresh engine's prefill allocations), and times --calls calls of the kernel over the layers in turn
(`vb_paged_attention_*` through ctypes with its arguments prepared once, so the call costs a few
microseconds, not the wrapper's tensor checks). Prints, best of --repeats: microseconds per call,
the cache bytes read per second, and nanoseconds per (position, kv head) for one thread.
  Memory-bound (the engine's case): the defaults (30 layers: 2.3 GB of bf16 cache).
  Arithmetic-bound: --batch 4 --positions 256 --layers 1 --threads 1 --calls 1000 (in L2).
docs/performance.md ("Decode attention in chunks: tried, not kept") records what it measured. Run it in its own
high-priority session on a shared machine (REFERENCE 8):
    setsid --wait bash -c 'echo -19 > /proc/$$/autogroup; exec nice -n -19 "$@"' _ python bench/decode_attention.py
"""
from __future__ import annotations

import argparse
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256, help="decode requests (query rows)")
    ap.add_argument("--positions", type=int, default=384, help="positions each request attends to")
    ap.add_argument("--layers", type=int, default=30, help="layer caches the calls cycle through")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--order", choices=("random", "in-order"), default="random", help="where a request's blocks lie")
    ap.add_argument("--dtype", default="bfloat16", help="queries: bfloat16 or float32")
    ap.add_argument("--kv-dtype", default=None, help="the cache (default: --dtype; float16 / bfloat16 under float32)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--calls", type=int, default=20, help="calls per timing")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tier", default=None, help="a lower native tier this CPU runs (default: its best)")
    args = ap.parse_args()

    import torch

    from vbatch.kernels import cpu_features, cpu_native, native_build

    q_heads, kv_heads, head_dim, bs = 9, 3, 64, args.block_size
    dtype = getattr(torch, args.dtype)
    kv_dtype = getattr(torch, args.kv_dtype) if args.kv_dtype else dtype
    tier = cpu_features.tier_named(args.tier) if args.tier else cpu_features.selected_tier()
    native = cpu_native.load(tier)
    if native is None or not native_build.has_variant(dtype, kv_dtype):
        raise SystemExit(f"no native {tier.name} attention for {args.dtype} queries over a {kv_dtype} cache")
    generator = torch.Generator().manual_seed(0)
    per_req = -(-args.positions // bs)
    num_blocks = args.batch * per_req + 1
    ids = torch.arange(1, num_blocks, dtype=torch.int32)
    if args.order == "random":
        ids = ids[torch.randperm(num_blocks - 1, generator=generator)]
    tables = ids.view(args.batch, per_req).contiguous()
    caches = [tuple(torch.randn(num_blocks, bs, kv_heads, head_dim, generator=generator).to(kv_dtype)
                    for _ in range(2)) for _ in range(args.layers)]
    query = torch.randn(args.batch, q_heads, head_dim, generator=generator).to(dtype)
    out = torch.empty_like(query)
    starts = torch.arange(args.batch + 1, dtype=torch.int32)
    lens = torch.full((args.batch,), args.positions, dtype=torch.int32)
    fn = native._fn("vb_paged_attention", dtype, kv_dtype)
    head = (query.data_ptr(), q_heads * head_dim, out.data_ptr())
    tail = (tables.data_ptr(), per_req, starts.data_ptr(), lens.data_ptr(), args.batch, q_heads, kv_heads, head_dim,
            bs, head_dim ** -0.5, args.threads)
    calls = [(*head, k.data_ptr(), v.data_ptr(), *tail) for k, v in caches]

    def timed() -> float:
        start = time.perf_counter()
        for i in range(args.calls):
            if fn(*calls[i % len(calls)]) != 0:
                raise SystemExit("the native attention refused the shape")
        return (time.perf_counter() - start) / args.calls

    timed()
    best = min(timed() for _ in range(args.repeats))
    cache_bytes = args.batch * args.positions * kv_heads * head_dim * 2 * kv_dtype.itemsize
    per_unit = best * 1e9 * args.threads / (args.batch * args.positions * kv_heads)
    print(f"{tier.name} {args.dtype} queries, {kv_dtype} cache, {args.batch} x {args.positions} positions, "
          f"{args.layers} layer(s), blocks {args.order}, {args.threads} thread(s): {best * 1e6:.1f} us per call, "
          f"{cache_bytes / best / 1e9:.1f} GB/s, {per_unit:.1f} ns per (position, kv head) and thread")


if __name__ == "__main__":
    main()
