"""The native paged attention on decode rows alone, as a decode step calls it once per layer.

    python bench/decode_attention.py [--batch 256] [--positions 384] [--layers 30] [--threads 2]
                                     [--order random|in-order] [--dtype bfloat16] [--kv-dtype ...]
                                     [--calls 20] [--repeats 5] [--tier avx2]
                                     [--query-rows 1] [--against OTHER_BUILD]

Builds a KV cache per layer with SmolLM2-135M's attention shapes (9 query heads, 3 kv heads of 64
dims, blocks of 16), gives each of --batch requests --positions positions in blocks placed at
random (--order random: a long-running engine's cache) or one after another (--order in-order: a
fresh engine's prefill allocations), each cache on transparent huge pages as the engine's
(--no-huge-pages: 4 KiB pages, whose TLB misses the engine does not have: on Zen 3, random blocks,
67 against 57 ns per position and kv head), and times --calls calls of the kernel over the layers in turn
(`vb_paged_attention_*` through ctypes with its arguments prepared once, so the call costs a few
microseconds, not the wrapper's tensor checks). Prints, best of --repeats: microseconds per call,
the cache bytes read per second, and nanoseconds per (position, kv head) for one thread.
  Memory-bound (the engine's case): the defaults (30 layers: 2.3 GB of bf16 cache).
  Arithmetic-bound: --batch 4 --positions 256 --layers 1 --threads 1 --calls 1000 (in L2).
  Prefill: --query-rows 256 (each request's last 256 positions are query rows: the tiled path).
--against BUILD times another build of the same entry point in the same process, alternating rounds
(--repeats of them), and prints each's median and the median of the per-round time ratios: the way
to compare two commits' kernels on a noisy machine, where two processes minutes apart differ by
more than the change. BUILD: the other commit's build folder, $VBATCH_CACHE/kernels/<key>/ (built
by running anything of that checkout once), or its library; its entry point must take this commit's
arguments (388b602's bf16 one does: docs/benchmarks.md "Zen 4 after the AVX2 work").
docs/performance/intel-xeon.md ("Decode attention in chunks: tried, not kept") records what it measured. Run it in its own
high-priority session on a shared machine (REFERENCE 8):
    setsid --wait bash -c 'echo -19 > /proc/$$/autogroup; exec nice -n -19 "$@"' _ python bench/decode_attention.py
"""
from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=256, help="decode requests (query rows)")
    ap.add_argument("--positions", type=int, default=384, help="positions each request attends to")
    ap.add_argument("--layers", type=int, default=30, help="layer caches the calls cycle through")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--order", choices=("random", "in-order"), default="random", help="where a request's blocks lie")
    ap.add_argument("--huge-pages", action=argparse.BooleanOptionalAction, default=True,
                    help="the caches on transparent huge pages, as the engine's (--no-huge-pages: 4 KiB pages)")
    ap.add_argument("--dtype", default="bfloat16", help="queries: bfloat16 or float32")
    ap.add_argument("--kv-dtype", default=None, help="the cache (default: --dtype; float16 / bfloat16 under float32)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--calls", type=int, default=20, help="calls per timing")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tier", default=None, help="a lower native tier this CPU runs (default: its best)")
    ap.add_argument("--query-rows", type=int, default=1, help="query rows per request (1: decode; more: prefill)")
    ap.add_argument("--against", default=None, help="another build (its folder under $VBATCH_CACHE/kernels, or a library), timed alternately")
    args = ap.parse_args()

    import torch

    from vbatch.kernels import cpu_features, cpu_huge_pages, cpu_native, native_build

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
    def cache() -> torch.Tensor:   # on huge pages where the engine's are (kernels/cpu_huge_pages.py)
        values = torch.randn(num_blocks, bs, kv_heads, head_dim, generator=generator).to(kv_dtype)
        return cpu_huge_pages.empty(values.shape, kv_dtype).copy_(values) if args.huge_pages else values
    caches = [(cache(), cache()) for _ in range(args.layers)]
    rows = args.query_rows
    if not 1 <= rows <= args.positions:
        raise SystemExit(f"--query-rows must be 1 to --positions ({args.positions}), got {rows}")
    query = torch.randn(args.batch * rows, q_heads, head_dim, generator=generator).to(dtype)
    starts = torch.arange(args.batch + 1, dtype=torch.int32) * rows
    lens = torch.full((args.batch,), args.positions, dtype=torch.int32)
    variant = native_build.entry_suffix(dtype, kv_dtype)
    name = f"vb_paged_attention_{variant}"
    builds = {"this build": native.function("vb_paged_attention", dtype, kv_dtype)}
    if args.against:
        other = getattr(ctypes.CDLL(str(native_build.built_library(Path(args.against), variant))), name, None)
        if other is None:
            raise SystemExit(f"{args.against} has no {name}")
        other.restype, other.argtypes = builds["this build"].restype, builds["this build"].argtypes
        builds["--against"] = other
    outs = {label: torch.empty_like(query) for label in builds}
    tail = (tables.data_ptr(), per_req, starts.data_ptr(), lens.data_ptr(), args.batch, q_heads, kv_heads, head_dim,
            bs, head_dim ** -0.5, args.threads)
    calls = {label: [(query.data_ptr(), q_heads * head_dim, outs[label].data_ptr(), k.data_ptr(), v.data_ptr(), *tail)
                     for k, v in caches] for label in builds}

    def timed(label: str) -> float:
        fn, label_calls = builds[label], calls[label]
        start = time.perf_counter()
        for i in range(args.calls):
            if fn(*label_calls[i % len(label_calls)]) != 0:
                raise SystemExit(f"the native attention ({label}) refused the shape")
        return (time.perf_counter() - start) / args.calls

    times: dict[str, list[float]] = {label: [] for label in builds}
    for label in builds:
        timed(label)
    for r in range(args.repeats):  # alternating rounds: A B, B A, ...
        for label in (list(builds) if r % 2 == 0 else list(builds)[::-1]):
            times[label].append(timed(label))
    best = min(times["this build"])
    cache_bytes = args.batch * args.positions * kv_heads * head_dim * 2 * kv_dtype.itemsize
    per_unit = best * 1e9 * args.threads / (args.batch * args.positions * kv_heads)
    shape = f"{args.batch} x {args.positions} positions" + (f" ({rows} query rows each)" if rows > 1 else "")
    print(f"{tier.name} {args.dtype} queries, {kv_dtype} cache, {shape}, "
          f"{args.layers} layer(s), blocks {args.order}, {args.threads} thread(s): {best * 1e6:.1f} us per call, "
          f"{cache_bytes / best / 1e9:.1f} GB/s, {per_unit:.1f} ns per (position, kv head) and thread")
    if args.against:
        ratios = sorted(a / b for a, b in zip(times["this build"], times["--against"]))
        diff = (outs["this build"].float() - outs["--against"].float()).abs().max().item()
        print(f"this build {statistics.median(times['this build']) * 1e6:.1f} us, --against "
              f"{statistics.median(times['--against']) * 1e6:.1f} us (medians of {args.repeats} alternating rounds); "
              f"time ratio this / against: median {statistics.median(ratios):.3f} "
              f"(rounds {ratios[0]:.3f}-{ratios[-1]:.3f}); outputs differ by at most {diff:.3g}")


if __name__ == "__main__":
    main()
